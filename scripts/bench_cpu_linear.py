"""The model's linear layers on CPU: `nn.Linear` (MKL on the weight as it lies) against oneDNN on a weight packed
once (`pagedlab.worker.cpu_linear`, the engine's default for float32), on SmolLM2-135M's shapes.

    .venv/bin/python scripts/bench_cpu_linear.py --threads 1
    .venv/bin/python scripts/bench_cpu_linear.py --threads 2 --rows 1 32 256

Each row count and shape is timed for both, interleaved (`--repeats` rounds of `--calls` calls, the median
reported with its range), on random weights of the shape (the values do not change the time).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from pagedlab.bench.report import cpu_model
from pagedlab.worker.cpu_linear import ROW_HINT

SHAPES = {  # SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49,152
    "q_proj, o_proj": (576, 576),
    "k_proj, v_proj": (192, 576),
    "gate_proj, up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_model()}, {args.threads} thread(s), torch {torch.__version__}, float32; "
          f"median (min-max) of {args.repeats} rounds")
    print(f"{'rows':>5}  {'layer':<18} {'N x K':>11}  {'nn.Linear us':>22}  {'oneDNN packed us':>22}  speed-up")
    for rows in args.rows:
        for name, (n, k) in SHAPES.items():
            x, weight = torch.randn(rows, k), torch.randn(n, k) * 0.05
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROW_HINT)
            calls = max(2, args.calls * 576 * 576 // (n * k) // max(1, rows // 32))
            variants = {
                "torch": lambda x=x, weight=weight: F.linear(x, weight),
                "onednn": lambda x=x, w=packed: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            }
            times = {name: [] for name in variants}
            for fn in variants.values():
                timed(fn, 3)  # warm up
            for _ in range(args.repeats):
                for variant, fn in variants.items():
                    times[variant].append(1e6 * timed(fn, calls))
            cells = [f"{statistics.median(t):9.1f} ({min(t):.0f}-{max(t):.0f})" for t in times.values()]
            ratio = statistics.median(times["torch"]) / statistics.median(times["onednn"])
            print(f"{rows:>5}  {name:<18} {f'{n} x {k}':>11}  {cells[0]:>22}  {cells[1]:>22}  {ratio:7.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
