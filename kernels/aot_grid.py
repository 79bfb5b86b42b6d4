"""Which kernel variants a GPU can be asked to run, and compiling all of them for sm_80, sm_89 and sm_90.

    grid_cases() -> [Case]                  every kernel x target, over the values the wrappers can choose
    tile_cases() -> [Case]                  every tile the wrappers can pick, per target, at its hardest
    compile_grid(cases, jobs) -> [result]   compiled in `jobs` fresh processes (TRITON_INTERPRET unset)

A case is one value per axis of its kernel (dtype, query heads per KV head, head dim, block size, window, the
dtype of the index tensors...); its constexprs come from the wrapper's own choice function (`decode_constants`,
`prefill_constants`, ...), so the grid follows the code. The full product is thousands of compilations; the
cases of each kernel and target take every value of every axis at least once, always include the largest tile
of each dtype (the most registers and shared memory), and are spread so that the three targets together see
as many pairs of values as they can. A new variant is one more `KernelSpec`: the FP8 KV cache's (float8 K/V
tiles dequantised into the query's dtype before the dots) are three, labelled "(fp8 KV)". The grid is a sample,
not a proof: ptxas may spill a register or two, to fit one more program per SM, in a combination it leaves out
(issue 31 found two; tests/kernels/test_kernels_compile.py compiles them too).
tests/kernels/test_kernels_compile.py checks every result; scripts/kernel_table.py writes the README's table.

# The kernels are explained in chapters/03_paged_attention.ipynb; compiling them ahead of time is in no chapter.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

DTYPES = ("float32", "float16", "bfloat16")
GROUPS = (1, 2, 3, 4, 5, 7, 8, 16)  # query heads per KV head: MHA, ..., Llama-3-405B (128:8)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # 80 and 96 are not powers of two; 256 is the wrappers' limit
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # every block size the engine accepts
WINDOWS = (False, True)
KV_HEADS = (1, 2, 3, 8, 40)
KV_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # an FP8 cache's formats (kv_cache_dtype "fp8_e4m3", "fp8_e5m2")


def _decode(case: dict, split_k: bool = False) -> dict:
    from .paged_decode import decode_constants

    return decode_constants(_torch_dtype(case["dtype"]), case["group"], case["head_dim"], case["block_size"],
                            case["window"], split_k=split_k, kv_fp8="kv_dtype" in case)


def _prefill(case: dict) -> dict:
    from .paged_prefill import prefill_constants

    dtype = _torch_dtype(case["dtype"])
    return prefill_constants(dtype, case["group"], case["head_dim"], case["block_size"], case["window"],
                             kv_fp8="kv_dtype" in case)


def _reduce(case: dict) -> dict:
    from .paged_decode import reduce_constants

    return reduce_constants(case["head_dim"], case["window"])


def _store_kv(case: dict) -> dict:
    from .store_kv import store_kv_constants

    return store_kv_constants(case["num_kv_heads"], case["head_dim"])


@dataclass(frozen=True)
class KernelSpec:
    """One @triton.jit kernel: its axes, its wrapper's choice of constexprs, the dtypes of its pointers."""

    name: str  # the kernel's name in `module`
    module: str
    axes: dict[str, tuple]
    constants: Callable[[dict], dict]  # case -> constexprs, through the wrapper's choice function
    pointers: dict[str, str] = field(default_factory=dict)  # pointer -> dtype, or an axis naming it; else "dtype"
    uses_dot: bool = False  # its 16-bit variants must run tl.dot on tensor cores
    archs: tuple[int, ...] = (80, 89, 90)
    label: str = ""  # its name in the grid and the table, where one kernel has several specs

    @property
    def id(self) -> str:
        return self.label or self.name

    def largest(self) -> list[dict]:
        """Partial cases always compiled: the biggest tile of each dtype."""
        big = {a: max(self.axes[a]) for a in ("group", "head_dim", "num_kv_heads") if a in self.axes}
        return [{"dtype": dtype, **big} for dtype in self.axes["dtype"]]


_DECODE_AXES = dict(dtype=DTYPES, group=GROUPS, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES, window=WINDOWS)
# block tables, lengths and row offsets: int32 whatever the caller passed (the wrappers' `as_index`)
_INDEX = dict(block_tables_ptr="int32", context_lens_ptr="int32")
_PREFILL_INDEX = dict(block_tables_ptr="int32", query_start_loc_ptr="int32", num_context_ptr="int32")
_SCALES = dict(kv_scales_ptr="float32")  # a float8 cache's K and V scales (read by the FP8 variants only)
_FP8_CACHE = dict(key_cache_ptr="kv_dtype", value_cache_ptr="kv_dtype")
# 16-bit models only, as vLLM runs an FP8 cache; a float32 model over a float8 cache compiles too, but at head
# dim 256 with 16 query heads per KV head its decode and prefill tiles spill 128-160 bytes a thread
_FP8_DECODE_AXES = {**_DECODE_AXES, "dtype": ("float16", "bfloat16"), "kv_dtype": KV_DTYPES}
_FP8 = " (fp8 KV)"
FP8_ARCHS = (89, 90)  # Triton converts e4m3 only from sm_89 (Ada, Hopper): sm_80 rejects it
_PARTIALS = dict(partial_max_ptr="float32", partial_sum_ptr="float32", partial_out_ptr="float32")
KERNELS = (
    KernelSpec("store_kv_kernel", "store_kv", dict(dtype=DTYPES, num_kv_heads=KV_HEADS, head_dim=HEAD_DIMS),
               _store_kv, dict(slot_mapping_ptr="int64")),
    KernelSpec("paged_decode_kernel", "paged_decode", _DECODE_AXES, _decode, {**_INDEX, **_SCALES}, uses_dot=True),
    KernelSpec("paged_decode_split_kernel", "paged_decode", _DECODE_AXES, lambda case: _decode(case, split_k=True),
               {**_INDEX, **_PARTIALS, **_SCALES}, uses_dot=True),
    KernelSpec("paged_decode_reduce_kernel", "paged_decode",
               dict(dtype=DTYPES, head_dim=HEAD_DIMS, window=WINDOWS), _reduce,
               {"context_lens_ptr": "int32", **_PARTIALS}),
    KernelSpec("paged_prefill_kernel", "paged_prefill",
               dict(dtype=DTYPES, group=GROUPS, head_dim=HEAD_DIMS, block_size=BLOCK_SIZES, window=WINDOWS),
               _prefill, {**_PREFILL_INDEX, **_SCALES}, uses_dot=True),
    # the same kernels over a float8 cache (KV_FP8): the query and output in the model's dtype
    KernelSpec("paged_decode_kernel", "paged_decode", _FP8_DECODE_AXES, _decode, {**_INDEX, **_SCALES, **_FP8_CACHE},
               uses_dot=True, label="paged_decode_kernel" + _FP8, archs=FP8_ARCHS),
    KernelSpec("paged_decode_split_kernel", "paged_decode", _FP8_DECODE_AXES,
               lambda case: _decode(case, split_k=True), {**_INDEX, **_PARTIALS, **_SCALES, **_FP8_CACHE},
               uses_dot=True, label="paged_decode_split_kernel" + _FP8, archs=FP8_ARCHS),
    KernelSpec("paged_prefill_kernel", "paged_prefill", _FP8_DECODE_AXES, _prefill,
               {**_PREFILL_INDEX, **_SCALES, **_FP8_CACHE}, uses_dot=True, label="paged_prefill_kernel" + _FP8,
               archs=FP8_ARCHS),
)


def covering_cases(axes: dict[str, tuple], pinned: list[dict], seen: Counter) -> list[dict]:
    """Cases that take every value of every axis at least once, starting with the `pinned` partial cases.
    Each free axis of a case takes a value not yet taken if there is one, else the value whose pairs with the
    case's other values were seen least, then the value seen least (`seen`, shared between calls, counts the
    values and pairs compiled so far)."""
    untaken = {axis: list(values) for axis, values in axes.items()}
    pending = [dict(p) for p in pinned]
    cases = []
    while pending or any(untaken.values()):
        case = pending.pop(0) if pending else {}
        for axis, values in axes.items():
            if axis not in case:
                choices = untaken[axis] or values
                case[axis] = min(choices, key=lambda v: (sum(seen[axis, v, a, case[a]] for a in case), seen[axis, v]))
        for axis, value in case.items():
            if value in untaken[axis]:
                untaken[axis].remove(value)
            seen[axis, value] += 1
            seen.update((axis, value, other, case[other]) for other in case if other != axis)
        cases.append(case)
    return cases


@dataclass(frozen=True)
class Case:
    kernel: str
    arch: int
    values: dict  # axis -> value


def grid_cases(kernels: tuple[KernelSpec, ...] = KERNELS) -> list[Case]:
    cases = []
    seen_by_axes: dict[str, Counter] = {}
    for spec in kernels:
        # shared by the targets, and by kernels with the same axes (decode, split-K and prefill share their
        # K/V loop): they complement each other
        seen = seen_by_axes.setdefault(repr(spec.axes), Counter())
        for arch in spec.archs:
            cases += [Case(spec.id, arch, values) for values in covering_cases(spec.axes, spec.largest(), seen)]
    return cases


def tile(spec: KernelSpec, values: dict) -> tuple:
    """What sets a variant's registers and shared memory: its dtypes and the tile its wrapper picks (the BLOCK_*
    sizes but the cache's block size, and the warps), the same for many values of group, head dim and block size."""
    constants = spec.constants(values)
    sizes = tuple(sorted((k, v) for k, v in constants.items() if k == "num_warps" or
                         (k.startswith("BLOCK_") and k != "BLOCK_SIZE")))
    return (values["dtype"], values.get("kv_dtype"), *sizes)


def tile_cases(kernels: tuple[KernelSpec, ...] = KERNELS) -> list[Case]:
    """Every tile each wrapper can pick, for every target, each at its hardest: the case that maps to it with
    the sliding window on, a head dim and a group that fill the tile only in part (masked loads,
    where any case does), then the largest head dim, group and block size. About 1,500 compilations: swept by
    scripts/kernel_sweep.py, not in CI (whose grid is a sample of them)."""
    cases = []
    for spec in kernels:
        hardest: dict[tuple, dict] = {}
        for combo in itertools.product(*spec.axes.values()):
            values = dict(zip(spec.axes, combo))
            if values.get("window", True) is not True:
                continue
            constants = spec.constants(values)
            rank = (values["head_dim"] != constants.get("BLOCK_D", values["head_dim"]),
                    "group" in values and values["group"] != constants.get("BLOCK_G", values["group"]),
                    values["head_dim"], values.get("group", 0), values.get("block_size", 0),
                    values.get("num_kv_heads", 0))
            key = tile(spec, values)
            if key not in hardest or rank > hardest[key][0]:
                hardest[key] = (rank, values)
        cases += [Case(spec.id, arch, values) for arch in spec.archs for _, values in hardest.values()]
    return cases


def cases_digest(cases: list[Case]) -> str:
    """A short digest of the cases (kernel, target, values): a stored sweep names the cases it compiled."""
    text = json.dumps([(c.kernel, c.arch, c.values) for c in cases], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def representative_args(spec: KernelSpec, kernel, values: dict) -> dict:
    """A value for each runtime parameter of the kernel, as the wrapper would pass it: pointers of their
    dtype; strides a multiple of head_dim (every layout here has head_dim innermost); the window in use or 0."""
    from .aot import pointer

    args = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            continue
        if name.endswith("_ptr"):
            dtype = spec.pointers.get(name, "dtype")
            args[name] = pointer(_torch_dtype(values.get(dtype, dtype)))
        elif name == "scale_log2e":
            args[name] = 0.18
        elif name == "sliding_window":
            args[name] = 4096 if values.get("window") else 0
        elif name == "num_partitions":
            args[name] = 3
        elif "stride" in name:
            args[name] = 24 * values["head_dim"]
        else:
            raise ValueError(f"{spec.name}: no representative value for parameter {name!r}; add a rule here")
    return args


def compile_case(case: Case) -> dict:
    """Compile one case (in this process: TRITON_INTERPRET must be unset); a JSON-able result."""
    from .aot import compile_for_target, problems

    spec = next(s for s in KERNELS if s.id == case.kernel)
    kernel = getattr(importlib.import_module(f"{__package__}.{spec.module}"), spec.name)
    constants = spec.constants(case.values)
    result = dict(kernel=case.kernel, arch=case.arch, case=case.values, constants=constants)
    needs_tensor_cores = spec.uses_dot and case.values["dtype"] in ("float16", "bfloat16")
    try:
        report = compile_for_target(kernel, representative_args(spec, kernel, case.values), constants, case.arch)
    except Exception as error:  # the compiler rejected it: that is the finding
        return {**result, "error": f"{type(error).__name__}: {error}", "problems": ["does not compile"]}
    return {**vars(report), **result, "error": None, "problems": problems(report, needs_tensor_cores)}


def compile_grid(cases: list[Case], jobs: int = 2, env: dict | None = None) -> list[dict]:
    """Compile `cases` in `jobs` fresh Python processes (without TRITON_INTERPRET); results in case order."""
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)
    payload = [dict(kernel=c.kernel, arch=c.arch, values=c.values) for c in cases]
    parts = [payload[i::jobs] for i in range(jobs)]
    processes = [
        subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for part in parts if part
    ]
    results = []
    for process, part in zip(processes, parts):
        out, err = process.communicate(json.dumps(part))
        if process.returncode:
            raise RuntimeError(f"the compile worker failed (exit status {process.returncode}):\n{err[-4000:]}")
        results += [json.loads(line) for line in out.splitlines()]
    order = {(c.kernel, c.arch, json.dumps(c.values, sort_keys=True)): i for i, c in enumerate(cases)}
    return sorted(results, key=lambda r: order[(r["kernel"], r["arch"], json.dumps(r["case"], sort_keys=True))])


def markdown_table(results: list[dict]) -> str:
    """The README's table: per kernel and target, the variants compiled and the worst of them."""
    import triton


    lines = [
        f"Compiled by triton {triton.__version__} on a CPU (`python scripts/kernel_table.py --write-readme`; "
        "tests/kernels/test_kernels_compile.py",
        "checks it is current). Over the variants of each kernel: the most shared memory and registers per "
        "thread, the warps,",
        "the variants that spill registers, and the tensor-core instruction of the 16-bit `tl.dot`s.",
        "",
    ]
    return "\n".join(lines) + "\n" + results_table(results)


def results_table(results: list[dict]) -> str:
    """Per kernel and target: the variants compiled and the worst of them (the README's table, the sweep's)."""
    from .aot import TARGETS

    lines = [
        "| kernel | target | variants | shared memory (max) | registers (max) | warps | spills | 16-bit dot |",
        "|:--|:--|--:|--:|--:|:--|:--|:--|",
    ]
    for spec in KERNELS:
        for arch in spec.archs:
            mine = [r for r in results if r["kernel"] == spec.id and r["arch"] == arch]
            ok = [r for r in mine if r["error"] is None]
            gpus, max_shared = TARGETS[arch]
            shared = max(r["shared"] for r in ok) / 1024 if ok else 0
            spilling = [r for r in ok if r["local_bytes"] or r["ptx_local"]]
            spills = f"{len(spilling)}, up to {max(r['local_bytes'] for r in spilling)} B" if spilling else "none"
            if len(ok) < len(mine):
                spills += f" ({len(mine) - len(ok)} do not compile)"
            sixteen = {r["tensor_cores"] or "none" for r in ok if r["case"]["dtype"] in ("float16", "bfloat16")}
            dot = ", ".join(sorted(sixteen)) if spec.uses_dot else "no dot"
            warps = ", ".join(str(w) for w in sorted({r["num_warps"] for r in ok}))
            name = f"`{spec.name}`{spec.id[len(spec.name):]}"  # the label's words after the kernel's name
            lines.append(
                f"| {name} | sm_{arch} ({gpus}) | {len(mine)} | {shared:.1f} of {max_shared // 1024} KB "
                f"| {max((r['registers'] for r in ok), default=0)} | {warps} | {spills} | {dot} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Worker: a JSON list of cases on stdin, one JSON result per line on stdout."""
    import warnings

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # Triton 3.9's note on its default
    for item in json.load(sys.stdin):
        print(json.dumps(compile_case(Case(item["kernel"], item["arch"], item["values"]))), flush=True)


if __name__ == "__main__":
    main()
