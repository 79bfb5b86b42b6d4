"""CPU attention that reads the paged KV cache in place: small C++ kernels, built at first use.

`paged_decode_cpu(query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window, out)`
computes what `decode_attention` (attention.py, the reference) computes, without gathering the blocks first:
the kernel (csrc/paged_decode_cpu.cpp) walks each sequence's block table and reads K and V once, where they
lie. `paged_prefill_cpu` does the same for a step's prefill chunks (csrc/paged_prefill_cpu.cpp; the reference is
`prefill_attention`, chunk by chunk): tiles of query rows against the keys, as a matrix product's inner kernel.
They are compiled with the system's C++ compiler and OpenMP through `torch.utils.cpp_extension` the first
time they are asked for (vLLM's CPU backend also builds C++ attention; pagedlab builds it lazily so that a
`pip install` needs no compiler), and cached in ~/.cache/pagedlab/torch_extensions under a name that hashes
the source text, the flags, the torch it builds against and the CPU, so later processes load it in about a second
(a first build took 38-98 s on a busy 2-core machine; `make install` builds it, and a lazy first build says so in
a line before and after). The source is copied into the build folder and compiled from there, so every checkout,
virtual environment and wheel with the same source shares one build.
Where it cannot be built (no compiler, no OpenMP) one warning says so and `kernel()` returns None: the
caller then runs the torch path. PAGEDLAB_CPU_KERNEL=0 in the environment turns the kernel off.

# Explained in chapters/03_paged_attention.ipynb
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sysconfig
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # attention.py imports this module
    from pagedlab.worker.attention import PrefillTensors

logger = logging.getLogger("pagedlab")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"
# built into the same extension: Llama's RMSNorm and SiLU-and-multiply in one pass (`pagedlab.worker.cpu_fused`)
FUSED_SOURCE = SOURCE.with_name("fused_cpu.cpp")
# and a Llama decoder layer's decode step in one call, on those kernels (`cpu_fused.decode_layer_inputs`)
LAYER_SOURCE = SOURCE.with_name("llama_layer_cpu.cpp")
# and prefill attention, every chunk of a step in one call (`paged_prefill_cpu`)
PREFILL_SOURCE = SOURCE.with_name("paged_prefill_cpu.cpp")
# the float vectors the attention kernels share, included by them
VECTOR_HEADER = SOURCE.with_name("cpu_vector.h")
CACHE_DIR = Path(os.environ.get("PAGEDLAB_CACHE", Path.home() / ".cache" / "pagedlab")) / "torch_extensions"


@dataclass(frozen=True)
class KernelBuild:
    """What loading the kernel gave: the module (None if it could not be built), why not, and the cost."""

    module: object | None
    error: str | None
    seconds: float  # compiling (first use) or loading from the cache
    compiled: bool  # True if this process compiled it, False if it came from the cache


def compiler_flags() -> list[str]:
    # Reassociating float sums lets the compiler vectorise the dot products' final additions (a tree, not
    # sixteen additions in a row); nothing else of -ffast-math, which would also flush denormals process-wide.
    flags = ["-O3", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")  # built on the machine that runs it, so its own vector units
    elif platform.machine() in ("aarch64", "arm64"):
        flags.append("-mcpu=native")
    return flags


def _cpu_signature() -> str:
    """The CPU the build is for (-march=native): its model and feature flags, as the OS reports them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() + platform.machine()


def _sources() -> tuple[Path, ...]:
    return SOURCE, FUSED_SOURCE, LAYER_SOURCE, PREFILL_SOURCE


def build_name() -> str:
    """The extension's name: one per source text, flags, torch build and CPU, so a cache never goes stale. Where
    the source lies is left out (the build compiles a copy kept beside it), and torch's folder is in: torch's build
    file names its headers by that path, so two torch installs sharing one name would rebuild on every load."""
    digest = hashlib.sha256()
    texts = [source.read_text() for source in (*_sources(), VECTOR_HEADER)]
    for part in (*texts, " ".join(compiler_flags()), torch.__version__, str(Path(torch.__file__).parent),
                 sysconfig.get_paths()["include"], _cpu_signature()):
        digest.update(part.encode())
    return f"pagedlab_paged_decode_cpu_{digest.hexdigest()[:16]}"


def _source_copy(directory: Path, source: Path | None = None) -> Path:
    """A source (default the attention kernel's), copied into the build folder (written atomically, once): the
    path torch's build file names."""
    source = source or SOURCE
    copy = directory / source.name
    text = source.read_text()
    if not copy.exists() or copy.read_text() != text:
        partial = copy.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(copy)
    return copy


def _disabled() -> bool:
    return os.environ.get("PAGEDLAB_CPU_KERNEL", "1").strip().lower() in ("0", "false", "no", "off")


@functools.cache  # one build per process: a loaded extension cannot be unloaded, so this is its handle
def load() -> KernelBuild:
    """Compile (first use on this machine) or load (afterwards) the kernel; never raises."""
    from torch.utils import cpp_extension

    name = build_name()
    directory = CACHE_DIR / name
    compiled = not any(directory.glob("*.so"))
    start = time.perf_counter()
    if compiled:
        logger.warning("compiling pagedlab's C++ CPU attention kernel for this CPU, once (about a minute) ...")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(directory / "lock")
        flags = compiler_flags()
        _source_copy(directory, VECTOR_HEADER)  # beside the sources that include it
        sources = [str(_source_copy(directory, source)) for source in _sources()]
        cpp_extension.load(name, sources, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(directory), verbose=False, is_python_module=False)
        module = getattr(torch.ops, name)  # the operators it registered (TORCH_LIBRARY), paged_decode among them
    except Exception as error:  # no compiler, no OpenMP, no ninja, a read-only home...: the torch path runs
        message = _first_error(error)
        warnings.warn(
            f"pagedlab: the C++ CPU attention kernel could not be built ({message}); decode attention runs on "
            "the slower torch path (gather + SDPA). Install a C++ compiler with OpenMP (gcc, g++) to use it.",
            RuntimeWarning, stacklevel=2,
        )
        return KernelBuild(None, message, time.perf_counter() - start, False)
    seconds = time.perf_counter() - start
    if compiled:
        logger.warning("pagedlab's C++ CPU attention kernel compiled in %.0f s, cached in %s", seconds, directory)
    else:
        logger.info("C++ CPU attention kernel loaded in %.1f s (%s)", seconds, directory)
    return KernelBuild(module, None, seconds, compiled)


STALE_LOCK_S = 600  # a first build takes one or two minutes; a lock this old is from a build that was killed


def _clear_stale_lock(lock: Path) -> None:
    """Remove the lock of a build that was interrupted (Ctrl-C, a killed process): torch's builder would wait
    for it forever. A lock younger than STALE_LOCK_S may be another process building now, and is kept."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing a stale build lock left by an interrupted build: %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


def _first_error(error: Exception) -> str:
    """The line of a build failure that says what went wrong (the compiler's first error, if it printed one)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    for line in lines:
        if "error" in line.lower() and "subcommand failed" not in line:
            return line[:300]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


def kernel():
    """The compiled kernel module, or None where it is turned off or could not be built."""
    if _disabled():
        return None
    return load().module


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: on CPU, float32/bfloat16/float16, cache contiguous."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and key_cache.dtype == query.dtype
        and key_cache.is_contiguous()
        and query.stride(-1) == 1
    )


def paged_decode_cpu(
    query: torch.Tensor,  # [num_seqs, q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    context_lens: torch.Tensor,  # [num_seqs] int64
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None = None,
    module=None,
) -> torch.Tensor:
    """Decode attention by the C++ kernel (`module`, default `kernel()`); raises RuntimeError if unavailable."""
    module = module or kernel()
    if module is None:
        raise RuntimeError("the C++ CPU attention kernel is not available (see the warning from its build)")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    block_tables = block_tables.to(torch.long).contiguous()  # no copy when they already are
    context_lens = context_lens.to(torch.long).contiguous()
    module.paged_decode(out, query, key_cache, value_cache, block_tables, context_lens, float(scale),
                        int(sliding_window or 0))
    return out


PREFILL_HEAD_DIMS = (64, 80, 128)  # compiled into the prefill kernel
PREFILL_MAX_GROUP = 48  # query heads per KV head in one of its tiles


def supports_prefill(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the prefill kernel takes these tensors: `supports`, and a head_dim and grouping it was built for."""
    return (supports(query, key_cache) and query.shape[-1] in PREFILL_HEAD_DIMS
            and query.shape[1] // key_cache.shape[2] <= PREFILL_MAX_GROUP)


def paged_prefill_cpu(
    query: torch.Tensor,  # [num_tokens, q_heads, head_dim]: the flat batch (decodes' rows are left alone)
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], the chunks' new K and V written
    value_cache: torch.Tensor,
    inputs: PrefillTensors,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    module=None,
) -> torch.Tensor:
    """Every prefill chunk's attention (causal, after its cached context) by the C++ kernel, into its rows of
    `out`; what `attention.prefill_attention` computes chunk by chunk. Raises RuntimeError if unavailable."""
    module = module or kernel()
    if module is None:
        raise RuntimeError("the C++ CPU attention kernel is not available (see the warning from its build)")
    module.paged_prefill(out, query, key_cache, value_cache, inputs.block_tables, inputs.query_start_loc,
                         inputs.num_context, float(scale), int(sliding_window or 0))
    return out


if __name__ == "__main__":  # `make install` builds the kernel here, so that no first decode waits for it
    build = load()
    print(f"C++ CPU attention kernel: {'ready' if build.module else 'not built: ' + str(build.error)} "
          f"({'compiled' if build.compiled else 'cached'}, {build.seconds:.0f} s)")
