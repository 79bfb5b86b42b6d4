"""The command line: `pagedlab generate "prompt"` and `pagedlab bench --workload chat`.

Also `python -m pagedlab ...`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedlab", description="PagedAttention and continuous batching.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate a completion for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--model", default=None, help="model name, folder or Hub id (default: the embedded SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("-v", "--verbose", action="store_true", help="log the engine's set-up")
    _bench_parser(commands)
    return parser


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _bench_parser(commands) -> None:
    from pagedlab.bench import COMPARATORS, WORKLOADS

    bench = commands.add_parser(
        "bench", help="run a benchmark workload: print a table, write JSON and PNG plots",
        description="Seeded workloads through pagedlab (and comparators, in the same process).",
    )  # fmt: skip
    bench.add_argument("--workload", default="chat", choices=WORKLOADS)
    bench.add_argument("--compare", type=_names, default=(), help=f"comma-separated: {', '.join(COMPARATORS)}")
    bench.add_argument("--num-requests", type=int, default=None, help="default per workload (chat 128)")
    bench.add_argument("--out", default="bench-results", help="folder for the JSON, text table and plots")
    bench.add_argument("--model", default=None, help="model name, folder or Hub id (default: the embedded SmolLM2)")
    bench.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32, bfloat16 or float16")
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    bench.add_argument("--repeats", type=int, default=1, help="runs per pagedlab system (median time)")
    bench.add_argument("--hf-repeats", type=int, default=1, help="runs per Hugging Face comparator")
    bench.add_argument("--hf-batch-size", type=_ints, default=(8, 16, 32, 64, 128),
                       help="hf-static batch sizes (the best of those whose KV fits in pagedlab's budget is reported)")
    bench.add_argument("--max-num-seqs", type=int, default=256)
    bench.add_argument("--max-num-batched-tokens", type=int, default=2048)
    bench.add_argument("--block-size", type=int, default=16)
    bench.add_argument("--scale", type=float, default=1.0, help="nano-vllm: shrink lengths and request count")
    bench.add_argument("--request-rate", type=_floats, default=(1.0,), help="serving: requests/s, comma-separated")
    bench.add_argument("--sweep-max-num-seqs", type=_ints, default=(), help="chat/nano-vllm: e.g. 8,32,128,256")
    bench.add_argument("--overhead-sizes", type=_ints, default=(256, 1024), help="overhead: running sequences")
    bench.add_argument("--capacity-reservations", type=_ints, default=(4, 8, 16, 32),
                       help="capacity: KV budgets, as numbers of max_model_len reservations")
    bench.add_argument("--decode-dtypes", type=_names, default=("float32", "bfloat16"), help="decode: dtypes")
    bench.add_argument("--decode-batch-sizes", type=_ints, default=(16, 64, 256), help="decode: batch sizes")
    bench.add_argument("--decode-contexts", type=_ints, default=(128, 512, 2048), help="decode: context lengths")
    bench.add_argument("--decode-max-kv-gib", type=float, default=None,
                       help="decode: skip steps whose KV cache is larger (default: a quarter of the RAM)")
    bench.add_argument("--decode-clock", choices=("wall", "cpu"), default="wall",
                       help="decode: wall time, or process CPU time (with --threads 1 on a shared machine)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("-v", "--verbose", action="store_true", help="log the engines' set-up")


def _bench(args) -> int:
    import torch

    from pagedlab.bench import run_benchmark

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report = run_benchmark(
        args.workload, model=args.model, dtype=args.dtype, device=args.device, out_dir=args.out,
        progress=not args.no_progress, compare=args.compare, num_requests=args.num_requests, repeats=args.repeats,
        hf_repeats=args.hf_repeats, batch_sizes=args.hf_batch_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, scale=args.scale,
        request_rates=args.request_rate, sweep_max_num_seqs=args.sweep_max_num_seqs,
        overhead_sizes=args.overhead_sizes, overhead_real_sizes=args.overhead_sizes[:1],
        capacity_reservations=args.capacity_reservations, decode_dtypes=args.decode_dtypes,
        decode_batch_sizes=args.decode_batch_sizes, decode_contexts=args.decode_contexts,
        decode_max_kv_gib=args.decode_max_kv_gib, decode_clock=args.decode_clock, seed=args.seed,
    )  # fmt: skip
    print(report.text())
    print(f"[results written to {args.out}/]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    from pagedlab import LLM, SamplingParams

    if not args.verbose:
        hf_logging.disable_progress_bar()  # a command line tool: no loading bars on stderr
    if args.command == "bench":
        if not args.verbose:
            hf_logging.set_verbosity_error()  # generate()'s notes on generation flags would drown the table
        try:
            return _bench(args)
        except ValueError as error:
            print(f"pagedlab: error: {error}", file=sys.stderr)
            return 2

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens,
        )  # fmt: skip
        llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size)
        start = time.perf_counter()
        tokenizer = llm.get_tokenizer()
        if args.raw or not getattr(tokenizer, "chat_template", None):
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
        else:
            conversations = [[{"role": "user", "content": p}] for p in args.prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    except (ValueError, TypeError) as error:
        print(f"pagedlab: error: {error}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompts, outputs):
        if len(outputs) > 1:
            print(f"--- {prompt}")
        print(output.outputs[0].text)
    stats = llm.stats()
    print(
        f"[{stats.num_generated_tokens} tokens in {stats.num_steps} steps, {elapsed:.2f} s; "
        f"KV blocks: peak {stats.peak_used_blocks} of {stats.num_kv_blocks} used, "
        f"{stats.block_size} tokens each]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
