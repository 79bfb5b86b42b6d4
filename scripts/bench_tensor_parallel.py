"""Step time and all-reduce time per step at tensor_parallel_size 1, 2, ... on this machine, and the same split
on paper for a GPU-sized model.

    .venv/bin/python scripts/bench_tensor_parallel.py                        # a random Llama, sizes 1 and 2
    .venv/bin/python scripts/bench_tensor_parallel.py --model smollm2 --sizes 1 3

Every size's engine is built first, then the sizes take turns running the same seeded greedy workload
(`--repeats` rounds, medians reported), so that the machine's load falls on all of them alike. A step's time is
the driver's wall time around `LLMEngine.step()`; the all-reduce time is what rank 0 spent blocked in
`dist.all_reduce` (waiting for the slowest rank included), divided by the steps. The threads are split evenly:
size 1 runs `--threads` threads in this process, each of N ranks `--threads / N`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from pagedlab import SamplingParams
from pagedlab.engine import LLMEngine
from pagedlab.worker.tensor_parallel import tensor_parallel_cost

GPU_EXAMPLE = dict(  # Llama-3-8B's shapes (no weights needed for arithmetic)
    hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, tie_word_embeddings=False,
)


def random_llama(folder: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def run(engine: LLMEngine, prompts, max_tokens: int) -> tuple[list[float], list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    times, tokens = [], {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        tokens.update({o.request_id.split("-")[0]: o.outputs[0].token_ids for o in outputs if o.finished})
    return times, [list(tokens[f"r{i}"]) for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a folder, 'smollm2' (embedded), or none: a random Llama")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = None if args.model == "smollm2" else args.model or random_llama(tempfile.mkdtemp())
    config = dict(block_size=16, num_kv_blocks=(args.prompt_len + args.max_tokens) // 16 * args.num_requests + 16,
                  preemption_mode="recompute", dtype="float32")
    engines = {n: LLMEngine.from_pretrained(model, tensor_parallel_size=n, **config) for n in args.sizes}
    generator = torch.Generator().manual_seed(0)
    vocab = engines[args.sizes[0]].model.config.vocab_size
    prompts = torch.randint(0, vocab, (args.num_requests, args.prompt_len), generator=generator).tolist()
    step_times = {n: [] for n in args.sizes}
    reduce_per_step = {n: [] for n in args.sizes}
    results = {}
    for engine in engines.values():  # warm-up (kernel loads, first-touch allocations), untimed
        run(engine, prompts[:2], 2)
    for _ in range(args.repeats):
        for n, engine in engines.items():
            if n > 1:
                engine.worker.collective_rpc("collective_stats", True)
            times, results[n] = run(engine, prompts, args.max_tokens)
            step_times[n].append(statistics.median(times))
            if n > 1:
                stats = engine.worker.collective_rpc("collective_stats", True)[0]
                reduce_per_step[n].append((stats.all_reduce_s / len(times), stats.num_all_reduce / len(times),
                                           stats.all_reduce_bytes / len(times)))
    hf_config = engines[args.sizes[0]].model.config
    print(f"model: {hf_config.num_hidden_layers} layers, hidden {hf_config.hidden_size}, "
          f"{hf_config.num_attention_heads}/{hf_config.num_key_value_heads} heads, vocab {hf_config.vocab_size}; "
          f"{args.num_requests} requests x {args.prompt_len} prompt + {args.max_tokens} tokens, float32, "
          f"{args.threads} threads in all; medians of {args.repeats} rounds")
    print(f"{'size':>4} {'step ms':>9} {'all-reduce ms/step':>19} {'share':>6} {'all-reduces/step':>17} "
          f"{'KiB reduced/step':>17} {'KV MiB/rank':>12} {'same tokens':>12}")
    first = args.sizes[0]
    for n, engine in engines.items():
        step_ms = 1e3 * statistics.median(step_times[n])
        if n > 1:
            seconds, count, nbytes = (statistics.median(r[i] for r in reduce_per_step[n]) for i in range(3))
            kv = engine.worker.collective_rpc("kv_cache_bytes")[0]
        else:
            seconds = count = nbytes = 0.0
            kv = engine.worker.model_runner.kv_cache.nbytes
        print(f"{n:>4} {step_ms:>9.1f} {1e3 * seconds:>19.1f} {100 * seconds * 1e3 / step_ms:>5.0f}% {count:>17.0f} "
              f"{nbytes / 1024:>17.0f} {kv / 2**20:>12.1f} {str(results[n] == results[first]):>12}")
    for engine in engines.values():
        engine.shutdown()

    from transformers import LlamaConfig

    paper = LlamaConfig(**GPU_EXAMPLE)
    print("\nOn paper, Llama-3-8B in bfloat16 (2 bytes a value):")
    print(f"{'size':>4} {'weights GiB/rank':>17} {'KV KiB/token/rank':>18} {'all-reduces/step':>17} "
          f"{'KiB/token reduced':>18} {'KiB/token sent (ring)':>22}")
    for n in (1, 2, 4, 8):
        c = tensor_parallel_cost(paper, n)
        print(f"{n:>4} {c.weight_bytes_per_rank / 2**30:>17.2f} {c.kv_bytes_per_token_per_rank / 1024:>18.0f} "
              f"{c.num_all_reduce_per_step if n > 1 else 0:>17} "
              f"{c.all_reduce_bytes_per_token / 1024 if n > 1 else 0:>18.0f} "
              f"{c.ring_bytes_sent_per_token / 1024:>22.0f}")


if __name__ == "__main__":
    main()
