"""Throughput and each stage's busy share at pipeline_parallel_size 1, 2, ... on this machine, with one batch in
flight (the bubble, measured) and with one per stage (`max_concurrent_batches`), and the same cut on paper for a
GPU-sized model.

    .venv/bin/python scripts/bench_pipeline_parallel.py                       # a random Llama, 1, 2 and 4 stages
    .venv/bin/python scripts/bench_pipeline_parallel.py --model smollm2 --sizes 1 2 3

Every engine is built first, then they take turns running the same seeded greedy workload (`--repeats` rounds,
medians reported), so that the machine's load falls on all of them alike. A run's time is the driver's wall time
around its `LLMEngine.step()` calls (with P batches in flight a step completes one batch of about 1/P of the
requests, so steps are not compared: output tokens per second are). A stage's busy time is its time in
`execute_model` less the time it waited to receive the previous stage's hidden states (`StageStats`); its share is
that over the run's wall time. Each of P stages gets `--threads / P` threads (at least one).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from bench_tensor_parallel import random_llama, run  # this folder, as scripts run: the same model and workload

from pagedlab.engine import LLMEngine
from pagedlab.worker.pipeline_parallel import pipeline_cost

GPU_EXAMPLE = dict(  # Llama-3-70B's shapes (no weights needed for arithmetic)
    hidden_size=8192, num_hidden_layers=80, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
    vocab_size=128256, tie_word_embeddings=False,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a folder, 'smollm2' (embedded), or none: a random Llama")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = None if args.model == "smollm2" else args.model or random_llama(tempfile.mkdtemp())
    config = dict(block_size=16, num_kv_blocks=(args.prompt_len + args.max_tokens) // 16 * args.num_requests + 16,
                  preemption_mode="recompute", dtype="float32")
    torch.set_num_threads(args.threads)  # a stage process takes its share of them (pagedlab.worker.executor)
    kinds = [(n, b) for n in args.sizes for b in sorted({1, n})]  # (stages, batches in flight)
    engines = {(n, b): LLMEngine.from_pretrained(model, pipeline_parallel_size=n, max_concurrent_batches=b, **config)
               for n, b in kinds}
    generator = torch.Generator().manual_seed(0)
    vocab = engines[kinds[0]].model.config.vocab_size
    prompts = torch.randint(0, vocab, (args.num_requests, args.prompt_len), generator=generator).tolist()
    tok_s = {kind: [] for kind in kinds}
    busy = {kind: [] for kind in kinds}  # per round: each stage's busy share
    sent = {kind: [] for kind in kinds}  # per round: KiB sent per output token by stage 0
    results = {}
    for engine in engines.values():  # warm-up (first-touch allocations), untimed
        run(engine, prompts[:2], 2)
    for _ in range(args.repeats):
        for (n, b), engine in engines.items():
            if n > 1:
                engine.worker.collective_rpc("pipeline_stats", True)
            times, results[n, b] = run(engine, prompts, args.max_tokens)
            num_tokens = args.num_requests * args.max_tokens
            tok_s[n, b].append(num_tokens / sum(times))
            if n > 1:
                stats = engine.worker.collective_rpc("pipeline_stats", True)
                busy[n, b].append([s.busy_s / sum(times) for s in stats])
                sent[n, b].append(stats[0].bytes_sent / 1024 / num_tokens)
    hf_config = engines[kinds[0]].model.config
    print(f"model: {hf_config.num_hidden_layers} layers, hidden {hf_config.hidden_size}, "
          f"{hf_config.num_attention_heads}/{hf_config.num_key_value_heads} heads, vocab {hf_config.vocab_size}; "
          f"{args.num_requests} requests x {args.prompt_len} prompt + {args.max_tokens} tokens, float32, "
          f"{args.threads} threads in all; medians of {args.repeats} rounds (range)")
    print(f"{'stages':>6} {'in flight':>9} {'output tok/s':>20} {'busy share per stage (range)':>44} "
          f"{'KiB sent/token':>14} {'KV MiB per stage':>18} {'same tokens':>12}")
    for (n, b), engine in engines.items():
        rate = tok_s[n, b]
        throughput = f"{statistics.median(rate):.1f} ({min(rate):.1f}-{max(rate):.1f})"
        if n > 1:
            shares = " ".join(f"{100 * statistics.median(r[s] for r in busy[n, b]):.0f}% "
                              f"({100 * min(r[s] for r in busy[n, b]):.0f}-{100 * max(r[s] for r in busy[n, b]):.0f})"
                              for s in range(n))
            kib = f"{statistics.median(sent[n, b]):.1f}"
            kv = " ".join(f"{x / 2**20:.1f}" for x in engine.worker.collective_rpc("kv_cache_bytes"))
        else:
            shares, kib, kv = "-", "0", f"{engine.worker.model_runner.kv_cache.nbytes / 2**20:.1f}"
        same = results[n, b] == results[kinds[0]]
        print(f"{n:>6} {b:>9} {throughput:>20} {shares:>44} {kib:>14} {kv:>18} {str(same):>12}")
    for engine in engines.values():
        engine.shutdown()

    from transformers import LlamaConfig

    paper = LlamaConfig(**GPU_EXAMPLE)
    print("\nOn paper, Llama-3-70B in bfloat16 (2 bytes a value), one batch in flight (P in flight: no bubble):")
    print(f"{'stages':>6} {'weights GiB/stage (first, last)':>32} {'KV KiB/token/stage':>19} "
          f"{'KiB/token sent':>15} {'bubble':>7}")
    for n in (1, 2, 4, 8):
        c = pipeline_cost(paper, n)
        weights = f"{c.weight_bytes_per_stage[0] / 2**30:.1f}, {c.weight_bytes_per_stage[-1] / 2**30:.1f}"
        print(f"{n:>6} {weights:>32} {c.kv_bytes_per_token_per_stage[0] / 1024:>19.0f} "
              f"{c.bytes_sent_per_token / 1024 if n > 1 else 0:>15.0f} {c.bubble_fraction:>7.0%}")


if __name__ == "__main__":
    main()
