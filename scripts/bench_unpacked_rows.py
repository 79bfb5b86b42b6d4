"""The engine's decode step with a few sequences: every linear product on oneDNN's packed weights against up to
`cpu_linear.MKL_ROWS` rows through MKL on the module's own weight (the engine's default on an Intel CPU; elsewhere
it packs every product: MKL's generic kernels lose there), SmolLM2 float32.

    .venv/bin/python scripts/bench_unpacked_rows.py --threads 1
    .venv/bin/python scripts/bench_unpacked_rows.py --threads 2 --seqs 1 4 8

For each batch size, `--rounds` rounds alternate the two: each adds that many requests of 100-token prompts, runs
their prefill, then `--max-tokens` decode steps, and takes the median step (the first 5 and last 2 left out). The
table gives the median over the rounds with their range.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedlab.bench.report import cpu_model
from pagedlab.config import EngineConfig
from pagedlab.engine import LLMEngine
from pagedlab.models import load_model
from pagedlab.sampling_params import SamplingParams
from pagedlab.worker import cpu_linear

PATHS = {"packed": -1, "MKL up to 3 rows": cpu_linear.MKL_ROWS}


def median_step_ms(engine: LLMEngine, tag: str, seqs: int, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": list(range(100 + i, 200 + i))}, params)
    engine.step()  # the prefills
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return 1e3 * statistics.median(steps[5:-2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(None, None, torch.float32, torch.device("cpu"))
    engine = LLMEngine(model, tokenizer, EngineConfig(block_size=16, num_kv_blocks=512, linear_backend="onednn"))
    print(f"# {cpu_model()}, {args.threads} thread(s), torch {torch.__version__}, SmolLM2 float32; decode step ms, "
          f"median (min-max) of {args.rounds} rounds")
    print(f"{'seqs':>4}  " + "  ".join(f"{name:>22}" for name in PATHS) + "  saved ms")
    this_cpu = cpu_linear.UNPACKED_ROWS
    try:
        for seqs in args.seqs:
            times = {name: [] for name in PATHS}
            for round_ in range(args.rounds):
                for name, rows in PATHS.items():
                    cpu_linear.UNPACKED_ROWS = rows
                    times[name].append(median_step_ms(engine, f"{seqs}-{round_}-{rows}", seqs, args.max_tokens))
            medians = [statistics.median(t) for t in times.values()]
            cells = [f"{m:9.1f} ({min(t):.1f}-{max(t):.1f})" for m, t in zip(medians, times.values())]
            print(f"{seqs:>4}  " + "  ".join(f"{c:>22}" for c in cells) + f"  {medians[0] - medians[1]:+8.1f}",
                  flush=True)
    finally:
        cpu_linear.UNPACKED_ROWS = this_cpu


if __name__ == "__main__":
    main()
