"""What an FP8 KV cache buys and costs on SmolLM2-135M-Instruct (float32 weights, CPU): capacity and accuracy.

    python scripts/kv_cache_dtype.py [--num-tokens 2048] [--num-prompts 24] [--max-tokens 32] [--budget-mib 64]

Capacity: bytes per token and tokens per GiB of each KV dtype (float32, bfloat16, fp8 e4m3 and e5m2), and the
chat workload's sequences running at once in one fixed budget (pagedlab's scheduler on that many blocks).
Accuracy, against the same model with a float32 cache: perplexity over the first --num-tokens tokens of English
text that ships with Python (pydoc_data), the mean KL divergence of the next-token distributions, the share of
positions whose argmax agrees, and greedy agreement over chat prompts (tokens before the first divergence), for
e4m3 and e5m2 with scales of 1.0 and with scales calculated from the first batch. The README quotes the output;
docs/bench/kv_cache_dtype.txt stores it.

# Explained in chapters/10_quantised_kv.ipynb
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from pagedlab import LLM
from pagedlab.bench.agreement import Agreement, chat_prompts, pagedlab_greedy
from pagedlab.bench.capacity import paged_concurrency
from pagedlab.bench.kv_accuracy import compare, english_text, teacher_forced
from pagedlab.bench.workloads import chat
from pagedlab.core.block_table import cdiv
from pagedlab.models import load_model
from pagedlab.worker.kv_cache import GiB, KVCacheSpec

CAPACITY_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CANDIDATES = [("fp8_e4m3", False), ("fp8_e4m3", True), ("fp8_e5m2", False), ("fp8_e5m2", True)]


def capacity_table(model, tokenizer, budget_mib: int, block_size: int = 16) -> None:
    workload = chat(tokenizer, model.get_input_embeddings().num_embeddings, num_requests=128)
    lengths = [(r.num_prompt_tokens, r.max_tokens) for r in workload.requests]
    print(f"| KV dtype | bytes/token | tokens/GiB | sequences at once in {budget_mib} MiB (peak / mean) |")
    print("|---|---:|---:|---:|")
    for name, dtype in CAPACITY_DTYPES.items():
        spec = KVCacheSpec.from_model_config(model.config, dtype)
        slots = budget_mib * 2**20 // spec.bytes_per_block(block_size) * block_size
        running = paged_concurrency(lengths, slots, block_size)
        print(f"| {name} | {spec.bytes_per_token} | {GiB // spec.bytes_per_token:,} | "
              f"{running.peak} / {running.mean_saturated:.1f} |")
    print(f"\n({workload.description}; block size {block_size}; bookkeeping through the real scheduler)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=2048)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget-mib", type=int, default=64)
    args = parser.parse_args()
    model, tokenizer = load_model(None, None, "float32", "cpu")
    capacity_table(model, tokenizer, args.budget_mib)

    text_ids = tokenizer(english_text())["input_ids"][: args.num_tokens]
    prompts = chat_prompts(tokenizer, args.num_prompts)
    num_blocks = max(cdiv(len(text_ids), 16), args.num_prompts * cdiv(200 + args.max_tokens, 16)) + 2
    config = dict(block_size=16, num_kv_blocks=num_blocks, preemption_mode="recompute")
    reference = LLM(model, tokenizer, **config)
    reference_tokens = pagedlab_greedy(reference, prompts, args.max_tokens)
    reference_logprobs = list(teacher_forced(reference, text_ids))  # [256, vocab] float32 per chunk
    print("| KV cache | scales | perplexity | mean KL (nats) | max KL | argmax agrees | greedy: identical | "
          "greedy: tokens before divergence |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name, calculate in CANDIDATES:
        start = time.perf_counter()
        llm = LLM(model, tokenizer, kv_cache_dtype=name, calculate_kv_scales=calculate, **config)
        # the text first: with calculated scales its first chunk sets them (prose, not a chat template)
        text = compare(reference_logprobs, llm, text_ids)
        agreement = Agreement.measure(reference_tokens, pagedlab_greedy(llm, prompts, args.max_tokens))
        if not rows:
            print(f"| float32 | - | {text.reference_perplexity:.3f} | 0 | 0 | 100% | "
                  f"{len(prompts)}/{len(prompts)} | 100% |")
        rows.append(name)
        print(f"| {name} | {'first batch' if calculate else '1.0'} | {text.candidate_perplexity:.3f} | "
              f"{text.mean_kl:.2e} | {text.max_kl:.2e} | {100 * text.argmax_agreement:.1f}% | "
              f"{agreement.num_identical}/{agreement.num_prompts} | {100 * agreement.fraction:.1f}% |",
              flush=True)
        print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    print(f"\n(SmolLM2-135M-Instruct, float32 weights, CPU; perplexity over {text.num_tokens} tokens of "
          f"pydoc_data's English in prefill chunks of 256; greedy over {len(prompts)} chat prompts x up to "
          f"{args.max_tokens} tokens, against the float32 cache)")


if __name__ == "__main__":
    main()
