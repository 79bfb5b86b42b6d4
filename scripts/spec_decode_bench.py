"""Speculative decoding on SmolLM2: output tokens per second with and without it, acceptance, and the batch size
where it stops paying. Prints a markdown table (the README's).

    .venv/bin/python scripts/spec_decode_bench.py                       # all configs, batches 1, 4, 16
    .venv/bin/python scripts/spec_decode_bench.py --batches 1 --rounds 1 --configs off ngram-k4

Two workloads, greedy, the same prompts for every config: "copy" asks the model to repeat a paragraph with its
typos fixed (the output copies the prompt: n-gram lookup should find it), "chat" asks short questions (nothing
to copy). Each (workload, batch) runs every config in turn, `--rounds` times interleaved, and reports the median
time: on a shared CPU the spread between rounds is printed too, and a speed-up inside it is noise. Every config
must give the tokens the run without speculation gives (`same_tokens`).

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to five "
    "books at a time, and each loan lasts three weeks. Late returns cost ten cents a day.",
    "Our team met on Tuesday to plan the spring release. We agreed to fix the login bug first, then improve the "
    "search page, and finally update the documentation before the end of the month.",
    "To make the soup, chop two onions and three carrots, fry them in olive oil for five minutes, add a litre of "
    "water and a cup of lentils, and let it simmer for half an hour.",
    "The train to the coast leaves every hour from platform four. The journey takes about ninety minutes, and "
    "tickets are cheaper if you buy them online the day before.",
]
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a KV cache is in one sentence.",
    "List three prime numbers.", "How many legs does a spider have?", "Translate 'good morning' into Spanish.",
    "What is 12 times 12?", "Give me a synonym for 'happy'.",
]


def typos(text: str, rng: random.Random, rate: float = 0.08) -> str:
    """Swap two letters inside some words."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 3 and rng.random() < rate:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


def workload(tokenizer, name: str, num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        if name == "copy":
            text = f"Repeat this paragraph with the typos fixed:\n\n{typos(PARAGRAPHS[i % len(PARAGRAPHS)], rng)}"
        else:
            text = QUESTIONS[i % len(QUESTIONS)]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


def configs(model, names: list[str]) -> dict[str, dict | None]:
    from pagedlab.spec_decode.self_draft import self_draft

    out = {}
    for name in names:
        if name == "off":
            out[name] = None
        elif name.startswith("ngram-k"):
            k = int(name.removeprefix("ngram-k"))
            out[name] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        elif name.startswith("self"):  # self<L>-k<k>: the first L layers as the draft
            layers, k = name.removeprefix("self").split("-k")
            draft = self_draft(model, int(layers))
            out[name] = {"method": "draft_model", "model": draft, "num_speculative_tokens": int(k)}
        else:
            raise ValueError(f"unknown config {name!r}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["copy", "chat"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--configs", nargs="+", default=["off", "ngram-k2", "ngram-k4", "ngram-k8", "self8-k3"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from pagedlab import LLM, SamplingParams
    from pagedlab.models import load_model

    model, tokenizer = load_model(None, None, torch.float32, torch.device("cpu"))
    specs = configs(model, args.configs)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"SmolLM2-135M-Instruct float32, {torch.get_num_threads()} torch thread(s), greedy, max_tokens "
          f"{args.max_tokens}, median of {args.rounds} interleaved rounds\n")
    print("| workload | batch | config | output tok/s | range | speed-up | acceptance | mean accepted length | steps "
          "| same_tokens |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in args.workloads:
        for batch in args.batches:
            prompts = workload(tokenizer, name, max(batch, 4))
            times = {c: [] for c in specs}
            results = {}
            for _ in range(args.rounds):
                for config, spec in specs.items():
                    llm = LLM(model, tokenizer, max_num_seqs=batch, speculative_config=spec, num_kv_blocks=512)
                    start = time.perf_counter()
                    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                    times[config].append(time.perf_counter() - start)
                    tokens = [o.outputs[0].token_ids for o in outputs]
                    results[config] = (tokens, llm.stats(), len(llm.llm_engine.trace))
            base = statistics.median(times["off"]) if "off" in times else None
            for config in specs:
                tokens, stats, steps = results[config]
                num_tokens = sum(len(t) for t in tokens)
                rates = [num_tokens / t for t in times[config]]
                median = statistics.median(times[config])
                same = tokens == results["off"][0] if "off" in results else "n/a"
                accept = f"{100 * stats.spec_acceptance_rate:.0f}%" if stats.spec_num_drafts else "-"
                length = f"{stats.spec_mean_acceptance_length:.2f}" if stats.spec_num_drafts else "-"
                speedup = f"{base / median:.2f}x" if base else "-"
                rate = f"{num_tokens / median:.1f} | {min(rates):.0f}-{max(rates):.0f}"
                print(f"| {name} | {batch} | {config} | {rate} | "
                      f"{speedup} | {accept} | {length} | {steps} | {same} |", flush=True)


if __name__ == "__main__":
    main()
