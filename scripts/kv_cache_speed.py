"""What an FP8 KV cache costs in speed on this CPU: SmolLM2-135M-Instruct (float32 weights), greedy, a batch of
chat prompts, with the cache in float32 (the C++ decode kernel, and the torch path for a like-for-like
comparison) and in FP8 (the torch path: the C++ kernel takes only full-precision caches).

    python scripts/kv_cache_speed.py [--batch 16] [--max-tokens 64] [--rounds 3] [--threads 1]

Each configuration generates the same number of tokens (ignore_eos); the rounds are interleaved and the table
gives the median output tokens/s with the min-max range. On a GPU, `make gpu-check` measures the bytes a decode
step reads instead.

# Explained in chapters/10_quantised_kv.ipynb
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from pagedlab import LLM, SamplingParams
from pagedlab.bench.agreement import chat_prompts
from pagedlab.models import load_model

CONFIGS = {  # name -> LLM options
    "float32 cache, C++ kernel": dict(kv_cache_dtype="auto"),
    "float32 cache, torch path": dict(kv_cache_dtype="auto", attention_backend="torch"),
    "fp8_e4m3 cache, torch path": dict(kv_cache_dtype="fp8_e4m3"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(None, None, "float32", "cpu")
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts(tokenizer, args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {name: LLM(model, tokenizer, max_num_seqs=args.batch, kv_cache_memory=256 * 2**20, **options)
               for name, options in CONFIGS.items()}
    for llm in engines.values():  # warm-up: kernels built, buffers allocated
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    speeds = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            speeds[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    print(f"SmolLM2-135M-Instruct, float32 weights, {args.batch} chat prompts x {args.max_tokens} tokens, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; "
          f"median of {args.rounds} interleaved rounds\n")
    print("| KV cache | bytes/token | output tok/s | range |")
    print("|---|---:|---:|---:|")
    for name, llm in engines.items():
        s = speeds[name]
        print(f"| {name} | {llm.stats().kv_bytes_per_token:,} | {statistics.median(s):.1f} | "
              f"{min(s):.1f}-{max(s):.1f} |")


if __name__ == "__main__":
    main()
