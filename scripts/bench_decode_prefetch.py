"""The C++ decode kernel's prefetching, A/B: where its software prefetches put the rows, and whether the scoring
pass also asks for the value rows, on reads that come from memory (not from the cache of the last call).

    .venv/bin/python scripts/bench_decode_prefetch.py --threads 1
    .venv/bin/python scripts/bench_decode_prefetch.py --threads 2 --dtype bfloat16

Each variant is the kernel's own source (pagedlab/worker/csrc/paged_decode_cpu.cpp) built with its two macros set
(`PAGEDLAB_PREFETCH_LOCALITY`, `PAGEDLAB_PREFETCH_VALUES`) into a temporary folder (about a minute each). One round
runs every layer of a model-sized cache once per variant, the variants alternating; a layer's K and V are read
again only after all the other layers', so they come from memory as in an engine step. The table gives the median
time a layer over the rounds (the first left out) with the range, and the KV bytes read over that time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from pagedlab.bench.report import cpu_model
from pagedlab.worker.cpu_attention import SOURCE, compiler_flags

VARIANTS = {  # name: (locality, value rows prefetched while scoring)
    "next block into L1": (3, 0),
    "next block into L2": (2, 0),
    "+ value rows into L2 (shipped)": (2, 1),
}


def build(name: str, locality: int, values: int, folder: Path):
    directory = folder / name
    directory.mkdir()
    defines = [f"-DPAGEDLAB_PREFETCH_LOCALITY={locality}", f"-DPAGEDLAB_PREFETCH_VALUES={values}"]
    cpp_extension.load(name, [str(SOURCE)], extra_cflags=compiler_flags() + defines, extra_ldflags=["-fopenmp"],
                       build_directory=str(directory), is_python_module=False)
    return getattr(torch.ops, name).paged_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=240, help="the longest context; the others down to 30 less")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    layers, block_size, q_heads, kv_heads, head_dim = 30, 16, 9, 3, 64  # SmolLM2-135M
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = max(1024, 2 * args.num_seqs * blocks_per_seq)
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(layers, 2, num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator)[: args.num_seqs * blocks_per_seq]
    tables = tables.view(args.num_seqs, blocks_per_seq).contiguous()
    lens = torch.randint(args.context - 30, args.context + 1, (args.num_seqs,), generator=generator)
    lens = lens.sort(descending=True).values  # the engine's order: longest first
    query = torch.randn(args.num_seqs, q_heads, head_dim, generator=generator).to(dtype)
    read_bytes = int(lens.sum()) * kv_heads * head_dim * 2 * cache.element_size()

    with tempfile.TemporaryDirectory() as folder:
        kernels = {name: build(f"prefetch_variant_{i}", *spec, Path(folder)) for i, (name, spec) in
                   enumerate(VARIANTS.items())}
        times = {name: [] for name in kernels}
        outputs = {}
        for _ in range(args.rounds):
            for name, kernel in kernels.items():
                out = torch.empty_like(query)
                start = time.perf_counter()
                for layer in range(layers):
                    kernel(out, query, cache[layer, 0], cache[layer, 1], tables, lens, head_dim**-0.5, 0)
                times[name].append((time.perf_counter() - start) / layers)
                outputs[name] = out
    reference = outputs[next(iter(outputs))]
    assert all(torch.equal(out, reference) for out in outputs.values()), "prefetching changed a result"

    print(f"# {cpu_model()}, {args.threads} thread(s), torch {torch.__version__}, {args.dtype}; {args.num_seqs} "
          f"sequences of {args.context - 30}-{args.context} keys, {layers} layers' caches; median (min-max) of "
          f"{args.rounds - 1} rounds")
    print(f"{'variant':<32} {'ms a layer':>22} {'GB/s':>6}")
    for name, samples in times.items():
        kept = samples[1:]
        median = statistics.median(kept)
        cell = f"{1e3 * median:.3f} ({1e3 * min(kept):.3f}-{1e3 * max(kept):.3f})"
        print(f"{name:<32} {cell:>22} {read_bytes / median / 1e9:6.1f}")


if __name__ == "__main__":
    main()
