"""The benchmark workloads: seeded lists of (prompt token ids, output length), the same on every run.

A workload knows nothing about engines: it is token ids in and lengths out. Output lengths are fixed per
request (EOS is ignored), so every system does exactly the same useful work. Without a tokenizer (a tiny
test model) prompts are random token ids of the same lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Words for the chat generator's made-up questions; any fixed list does, what matters is that it is seeded.
_WORDS = (
    "memory block cache token request batch model layer attention query key value page table schedule "
    "queue step prefill decode kernel tensor shape thread latency throughput budget prefix sample beam "
    "copy write share free allocate evict swap preempt recompute arrive finish serve user system answer "
    "question explain why how what when where compare describe summarise list example river mountain city "
    "history music science garden recipe travel weather planet ocean forest language number story"
).split()

_QUESTIONS = (
    "Explain in simple words", "Write a short story about", "Compare the following ideas:", "Summarise this:",
    "What would happen if", "Give three examples of", "Describe step by step", "Why do people say",
)


@dataclass(frozen=True)
class RequestSpec:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # generated exactly (ignore_eos)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[RequestSpec, ...]
    description: str

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_len(self) -> int:
        """The longest request, prompt plus output."""
        return max(r.num_prompt_tokens + r.max_tokens for r in self.requests)


def _chat_wrapper(tokenizer) -> tuple[list[int], list[int]]:
    """The token ids the chat template puts before and after a user message (raw text without a template)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return [], []
    marker = "\u2063MARK\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = text.split(marker)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False) if s else []  # noqa: E731
    return encode(before), encode(after)


def text_prompts(lengths: list[int], tokenizer, vocab_size: int, seed: int) -> list[tuple[int, ...]]:
    """Chat-templated made-up questions of exactly `lengths` tokens (template included), or random ids
    when there is no tokenizer."""
    rng = random.Random(seed)
    if tokenizer is None:
        return [tuple(rng.randrange(vocab_size) for _ in range(n)) for n in lengths]
    before, after = _chat_wrapper(tokenizer)
    prompts = []
    for n in lengths:
        words = [rng.choice(_QUESTIONS)] + [rng.choice(_WORDS) for _ in range(n)]
        content = tokenizer.encode(" ".join(words), add_special_tokens=False)
        room = max(n - len(before) - len(after), 1)
        prompts.append(tuple(before + content[:room] + after))
    return prompts


def output_lengths(num: int, mean: float, low: int, high: int, seed: int) -> list[int]:
    """Exponentially distributed lengths with the given mean, clipped to [low, high]."""
    rng = random.Random(seed)
    return [min(max(round(rng.expovariate(1 / mean)), low), high) for _ in range(num)]


def chat(tokenizer, vocab_size: int, num_requests: int = 128, seed: int = 0, prompt_len=(20, 400),
         output_mean: float = 128, output_len=(16, 512)) -> Workload:
    """Chat-templated prompts of 20-400 tokens; outputs exponential with mean 128, clipped to [16, 512]."""
    rng = random.Random(seed)
    lengths = [rng.randint(*prompt_len) for _ in range(num_requests)]
    prompts = text_prompts(lengths, tokenizer, vocab_size, seed + 1)
    outputs = output_lengths(num_requests, output_mean, *output_len, seed=seed + 2)
    return Workload(
        "chat", tuple(RequestSpec(p, o) for p, o in zip(prompts, outputs)),
        f"{num_requests} chat prompts of {prompt_len[0]}-{prompt_len[1]} tokens, outputs exp(mean {output_mean}) "
        f"clipped to [{output_len[0]}, {output_len[1]}]",
    )


def nano_vllm(vocab_size: int, num_requests: int | None = None, scale: float = 1.0, seed: int = 0) -> Workload:
    """nano-vllm's bench.py workload: 256 requests, random-token prompts of 100-1024 tokens, 100-1024 output
    tokens. `scale` shrinks the lengths and, unless num_requests is given, the request count."""
    rng = random.Random(seed)
    num = num_requests if num_requests is not None else max(1, round(256 * scale))
    low, high = max(1, round(100 * scale)), max(1, round(1024 * scale))
    token_range = min(10000, vocab_size)
    requests = tuple(
        RequestSpec(tuple(rng.randrange(token_range) for _ in range(rng.randint(low, high))), rng.randint(low, high))
        for _ in range(num)
    )
    return Workload("nano-vllm", requests, f"{num} random-token prompts of {low}-{high} tokens, {low}-{high} out")


def shared_prefix(tokenizer, vocab_size: int, num_requests: int = 64, prefix_len: int = 400,
                  question_len=(10, 40), max_tokens: int = 32, seed: int = 0) -> Workload:
    """One system prompt of ~prefix_len tokens shared by every request, each with its own short question."""
    rng = random.Random(seed)
    if tokenizer is None:
        prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
        prompts = [tuple(prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(*question_len))])
                   for _ in range(num_requests)]
    else:
        system = " ".join(rng.choice(_WORDS) for _ in range(prefix_len))
        system = tokenizer.decode(tokenizer.encode(system, add_special_tokens=False)[:prefix_len])
        prompts = []
        for _ in range(num_requests):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(*question_len))]
            question = " ".join([rng.choice(_QUESTIONS), *words])
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            if getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                prompts.append(tuple(tokenizer.encode(ids, add_special_tokens=False)))
            else:
                prompts.append(tuple(tokenizer.encode(system + "\n" + question)))
    return Workload(
        "prefix", tuple(RequestSpec(p, max_tokens) for p in prompts),
        f"{num_requests} questions behind one shared ~{prefix_len}-token system prompt, {max_tokens} tokens out",
    )


def random_prompts(vocab_size: int, num_requests: int, prompt_len: int, max_tokens: int, seed: int = 0) -> Workload:
    """Random-token prompts of one length (the sharing and overhead workloads)."""
    rng = random.Random(seed)
    requests = tuple(
        RequestSpec(tuple(rng.randrange(vocab_size) for _ in range(prompt_len)), max_tokens)
        for _ in range(num_requests)
    )
    return Workload("random", requests, f"{num_requests} random prompts of {prompt_len} tokens, {max_tokens} out")
