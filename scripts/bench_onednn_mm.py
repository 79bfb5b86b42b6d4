"""pagedlab's packed linear (torch's `mkldnn._linear_pointwise`, ideep's inner product) against vLLM's CPU linear
(`onednn_mm`: a oneDNN matmul whose primitives it caches by row count), on the same weights, in vLLM's environment:

    make vllm-env
    .venv-vllm/bin/python scripts/bench_onednn_mm.py --threads 2 --dtype bfloat16

Two measurements, each the median of alternated rounds: the fixed cost of one call (a 192 x 64 weight, so that
nothing but the call is timed), and a decode step's GEMMs on SmolLM2's shapes (q/k/v stacked, o, gate/up stacked,
down) with 30 layers' own weights, so that, as in a step, every weight is read from memory and not from a cache.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # [out, in]
NUM_LAYERS = 30


def _cpu_linear():
    """pagedlab's `cpu_linear`, loaded from its file: vLLM's environment cannot import the pagedlab package (the
    two pin different transformers), and this module needs only torch."""
    path = Path(__file__).resolve().parents[1] / "pagedlab" / "worker" / "cpu_linear.py"
    spec = importlib.util.spec_from_file_location("cpu_linear", path)
    module = sys.modules["cpu_linear"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def _median_s(fn, calls: int, rounds: int = 7) -> float:
    for _ in range(max(1, calls // 10)):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    args = parser.parse_args()
    from vllm import _custom_ops as ops  # only in vLLM's environment

    cpu_linear = _cpu_linear()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    def torch_linear(weight):
        packed = cpu_linear.pack(weight)
        return lambda x: cpu_linear.packed_linear(x, packed, None)

    def vllm_linear(weight):
        handler = ops.create_onednn_mm(weight.t(), 32)  # as vLLM's dispatch_cpu_unquantized_gemm makes it
        return lambda x: ops.onednn_mm(handler, x, None)

    print(f"{args.threads} thread(s), {args.dtype}")
    weight = torch.randn(192, 64, dtype=dtype)
    calls = [torch_linear(weight), vllm_linear(weight)]
    print("one call, a 192 x 64 weight (us): rows, pagedlab's, vLLM's")
    for rows in args.rows:
        x = torch.randn(rows, 64, dtype=dtype)
        ours, theirs = (_median_s(functools.partial(call, x), 2000) * 1e6 for call in calls)
        print(f"  {rows:4} {ours:7.1f} {theirs:7.1f}")

    layers = [[torch.randn(n, k, dtype=dtype) * 0.05 for n, k in SHAPES.values()] for _ in range(NUM_LAYERS)]
    steps = {name: [[make(w) for w in ws] for ws in layers] for name, make in
             (("pagedlab", torch_linear), ("vllm", vllm_linear))}
    print(f"a decode step's {len(SHAPES) * NUM_LAYERS} GEMMs, each layer's own weights (ms): rows, pagedlab's, vLLM's,"
          " ratio")
    for rows in args.rows:
        xs = [torch.randn(rows, k, dtype=dtype) for _, k in SHAPES.values()]
        got = {name: [fn(x) for fn, x in zip(fns[0], xs)] for name, fns in steps.items()}  # the same products
        for a, b in zip(got["pagedlab"], got["vllm"]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        times = {name: [] for name in steps}
        for _ in range(9):
            for name, fns in steps.items():
                start = time.perf_counter()
                for layer in fns:
                    for fn, x in zip(layer, xs):
                        fn(x)
                times[name].append(time.perf_counter() - start)
        ours, theirs = (statistics.median(times[name]) * 1e3 for name in steps)
        print(f"  {rows:4} {ours:7.2f} {theirs:7.2f} {ours / theirs:6.2f}")


if __name__ == "__main__":
    main()
