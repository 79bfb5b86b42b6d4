"""The command line: `pagedlab generate "prompt"` (also `python -m pagedlab generate ...`)."""

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    from pagedlab import LLM, SamplingParams

    if not args.verbose:
        hf_logging.disable_progress_bar()  # a command line tool: no loading bars on stderr

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
