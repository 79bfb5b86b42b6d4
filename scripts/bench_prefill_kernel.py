"""The C++ prefill kernel against the torch path it replaced, A/B: per call, and per engine step.

    .venv/bin/python scripts/bench_prefill_kernel.py --threads 2
    .venv/bin/python scripts/bench_prefill_kernel.py --threads 1 --dtype bfloat16

Per call: one layer's prefill attention over SmolLM2's shapes (9 query heads over 3 KV heads of 64, blocks of 16),
`cpu_attention.paged_prefill_cpu` (every chunk in one call, blocks read in place) against `prefill_attention`
chunk by chunk (each chunk's blocks gathered, then torch's SDPA, causal, or with a mask over a cached context).
Per step: SmolLM2 in an engine, a lone 300-token prompt (a first token's wait) and the prefix workload's step of
21 questions of ~70 tokens behind a cached 400-token system prompt, the kernel on and off (the attention function's
`supports_prefill` patched) alternating. Medians of the rounds with their ranges; the CPU is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

from pagedlab.bench.report import cpu_model
from pagedlab.worker import cpu_attention
from pagedlab.worker.attention import PrefillChunk, PrefillTensors, prefill_attention

CALLS = {  # name: (cached tokens, new tokens) per chunk
    "21 x 70 new after 400 cached": [(400, 70)] * 21,
    "one 300-token prompt": [(0, 300)],
    "one 1,500-token prompt": [(0, 1500)],
    "4 x 300 new after 1,000 cached": [(1000, 300)] * 4,
}


def _median(times: list[float]) -> str:
    return f"{statistics.median(times):8.3f} ({min(times):.3f}-{max(times):.3f})"


def per_call(dtype: torch.dtype, rounds: int) -> None:
    print(f"per call, ms a layer ({dtype}):")
    for name, shape in CALLS.items():
        times = _one_shape(shape, dtype, rounds)
        ratio = statistics.median(times["torch"]) / statistics.median(times["kernel"])
        print(f"  {name:32s} torch {_median(times['torch'])}  kernel {_median(times['kernel'])}  {ratio:.2f}x")


def _one_shape(shape: list[tuple[int, int]], dtype: torch.dtype, rounds: int) -> dict[str, list[float]]:
    kernel = cpu_attention.kernel()
    q_heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    generator = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shape) + 1
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype)
    value_cache = torch.randn(key_cache.shape, generator=generator).to(dtype)
    chunks, row, used = [], 0, 1
    for context, new in shape:
        count = -(-(context + new) // block_size)
        chunks.append(PrefillChunk(row, row + new, context, torch.arange(used, used + count)))
        row, used = row + new, used + count
    query = torch.randn(row, q_heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(row, kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(key.shape, generator=generator).to(dtype)
    out = torch.empty_like(query)
    inputs = PrefillTensors.build(chunks)

    def torch_path():
        for c in chunks:
            rows = slice(c.start, c.end)
            out[rows] = prefill_attention(query[rows], key[rows], value[rows], key_cache, value_cache, c, None, None)

    def kernel_path():
        cpu_attention.paged_prefill_cpu(query, key_cache, value_cache, inputs, head_dim**-0.5, None, out, kernel)

    times = {"torch": [], "kernel": []}
    for _ in range(rounds):
        for label, run in (("torch", torch_path), ("kernel", kernel_path)):
            start = time.perf_counter()
            for _ in range(10):
                run()
            times[label].append((time.perf_counter() - start) / 10 * 1e3)
    return times


def per_step(dtype: str, rounds: int) -> None:
    from pagedlab.engine import EngineConfig, LLMEngine
    from pagedlab.models import load_model
    from pagedlab.sampling_params import SamplingParams

    model, tokenizer = load_model(None, None, dtype=dtype)
    engine = LLMEngine(model, tokenizer, EngineConfig(enable_prefix_caching=True, max_num_batched_tokens=2048,
                                                      record_trace=True))
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    system = torch.randint(100, vocab, (400,), generator=generator).tolist()
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def step_time(prompts: list[list[int]]) -> float:
        engine.reset_prefix_cache()
        engine.add_request("warm", {"prompt_token_ids": system}, one_token)  # the system prompt into the cache
        while engine.has_unfinished_requests():
            engine.step()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, one_token)
        start = time.perf_counter()
        engine.step()  # the prefills (and their one token each)
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed * 1e3

    cases = {
        "one 300-token prompt": [torch.randint(100, vocab, (300,), generator=generator).tolist()],
        "21 questions after a cached 400": [system + torch.randint(100, vocab, (70,), generator=generator).tolist()
                                            for _ in range(21)],
    }
    print(f"per engine step, ms (SmolLM2, {dtype}):")
    for name, prompts in cases.items():
        times = {"torch": [], "kernel": []}
        for _ in range(rounds):
            for label in ("torch", "kernel"):
                off = mock.patch.object(cpu_attention, "supports_prefill", return_value=False)
                with off if label == "torch" else contextlib.nullcontext():
                    times[label].append(step_time(prompts))
        ratio = statistics.median(times["torch"]) / statistics.median(times["kernel"])
        print(f"  {name:32s} torch {_median(times['torch'])}  kernel {_median(times['kernel'])}  {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-engine", action="store_true", help="the per-call table only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_model()}, {args.threads} thread(s), torch {torch.__version__}")
    per_call(getattr(torch, args.dtype), args.rounds)
    if not args.no_engine:
        per_step(args.dtype, args.rounds)


if __name__ == "__main__":
    main()
