"""A quick end-to-end throughput harness: a chat-like workload through `pagedlab.LLM`.

    .venv/bin/python scripts/profile_engine.py                      # 48 requests, fp32
    .venv/bin/python scripts/profile_engine.py --num-requests 128 --dtype bfloat16
    .venv/bin/py-spy record -o /tmp/engine.svg -- .venv/bin/python scripts/profile_engine.py

The workload is fixed by `--seed`: chat-templated prompts of 20 to 400 tokens (random words in a user
message), output lengths drawn from an exponential of mean 128 clipped to [16, 512], greedy, ignore_eos.
It prints output tokens per second, the number of steps and the mean batch (scheduled requests per step).
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def chat_workload(tokenizer, num_requests: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompt token ids (chat-templated, 20-400 tokens) and output lengths, the same for the same seed."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3]
    words.sort()
    prompts, output_lens = [], []
    for _ in range(num_requests):
        target = rng.randint(20, 400)
        text = " ".join(rng.choice(words) for _ in range(target))
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else list(ids["input_ids"])
        if len(ids) > target:  # keep the template's head and tail, shorten the message in the middle
            head, tail = ids[:8], ids[-5:]
            ids = head + ids[8 : 8 + max(target - 13, 0)] + tail
        prompts.append(ids)
        output_lens.append(int(min(max(rng.expovariate(1 / 128), 16), 512)))
    return prompts, output_lens


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--no-trace", action="store_true", help="record_trace=False")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from pagedlab import LLM, SamplingParams

    options = dict(max_num_seqs=args.max_num_seqs, block_size=args.block_size, record_trace=not args.no_trace)
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(dtype=args.dtype, device="cpu", **options)
    prompts, output_lens = chat_workload(llm.get_tokenizer(), args.num_requests, args.seed)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    warm_up = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], warm_up, use_tqdm=False)

    steps_before = llm.stats().num_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    num_steps = llm.stats().num_steps - steps_before
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(p) for p in prompts)
    scheduled = num_in + num_out  # every request-step computes at least one token; decodes are one each
    print(
        f"requests={args.num_requests} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"prompt_tokens={num_in} output_tokens={num_out}"
    )
    print(f"time={elapsed:.1f}s  output tok/s={num_out / elapsed:.1f}  total tok/s={scheduled / elapsed:.1f}")
    # on a machine shared with other jobs, CPU seconds per output token is the steadier figure
    print(f"cpu={cpu:.1f}s (all threads)  output tokens per cpu-second={num_out / cpu:.1f}  load={_load()}")
    print(f"steps={num_steps}  mean batch (decodes per step)={num_out / max(num_steps, 1):.1f}")


if __name__ == "__main__":
    main()
