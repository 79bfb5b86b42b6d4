"""Greedy agreement between two runs of the same prompts: tokens generated before the first divergence.

In float32 pagedlab's greedy tokens equal Hugging Face `generate()` exactly. In 16-bit formats (and with an FP8
KV cache) they need not: pagedlab computes attention over a paged cache in a different order of operations, and
where the two most likely tokens are within a rounding error of each other the argmax can flip; from there the
two continuations differ. `Agreement` says how often that happens and how late.

# Explained in chapters/03_paged_attention.ipynb
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Questions a small chat model answers with varied text: the prompts of the agreement measurements.
QUESTIONS = (
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
    "What is 17 times 23?", "Name three planets of the solar system.", "How do I boil an egg?",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?", "Give me a tip for learning to code.",
    "What does a CPU do?", "Describe a cat to someone who has never seen one.", "List the days of the week.",
    "What is the boiling point of water?", "Tell me a fun fact about octopuses.", "What is machine learning?",
    "Suggest a name for a bakery.", "How many legs does a spider have?", "What rhymes with 'light'?",
    "Explain what a block table is in one sentence.", "Who wrote Romeo and Juliet?",
    "What is the difference between weather and climate?", "Write a short thank-you note.",
    "How does a rainbow form?", "What is the square root of 144?",
)


def chat_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """`num_prompts` of QUESTIONS (cycled) through the tokenizer's chat template."""
    prompts = []
    for i in range(num_prompts):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(list(encoded if isinstance(encoded, list) else encoded["input_ids"]))
    return prompts


def tokens_before_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


@dataclass(frozen=True)
class Agreement:
    num_identical: int  # prompts whose whole output agrees
    prefix_lengths: tuple[int, ...]  # per prompt: tokens before the first divergence
    lengths: tuple[int, ...]  # per prompt: tokens of the reference output

    @classmethod
    def measure(cls, reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> Agreement:
        prefixes = tuple(tokens_before_divergence(a, b) for a, b in zip(reference, candidate))
        identical = sum(list(a) == list(b) for a, b in zip(reference, candidate))
        return cls(identical, prefixes, tuple(len(r) for r in reference))

    def divergences(self) -> list[tuple[int, int]]:
        """(prompt index, position of the first differing token) for every prompt whose outputs differ."""
        return [(i, p) for i, (p, n) in enumerate(zip(self.prefix_lengths, self.lengths)) if p < n]

    @property
    def num_prompts(self) -> int:
        return len(self.lengths)

    @property
    def fraction(self) -> float:
        """The share of the reference's tokens generated before each prompt's first divergence."""
        return sum(self.prefix_lengths) / max(1, sum(self.lengths))

    def __str__(self) -> str:
        diverged = [p for p, n in zip(self.prefix_lengths, self.lengths) if p < n]
        first = f"; the earliest divergence at token {min(diverged)}" if diverged else ""
        return (
            f"{self.num_identical}/{self.num_prompts} outputs identical; {100 * self.fraction:.1f}% of the "
            f"{sum(self.lengths)} tokens generated before the first divergence{first}"
        )


def hf_greedy(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face `generate(do_sample=False)`, one prompt at a time (no padding), cut after the first EOS."""
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([list(prompt)], device=next(model.parameters()).device)
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False
            )
        tokens = out[0, len(prompt) :].tolist()
        ends = [i for i, t in enumerate(tokens) if t in eos]
        outputs.append(tokens[: ends[0] + 1] if ends else tokens)
    return outputs


def pagedlab_greedy(llm, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    from pagedlab import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def divergence_margins(model, prompts, reference, candidate) -> list[float]:
    """At each first divergence, how far apart `model` scores the two tokens chosen there: the logit of the
    reference's token minus the candidate's, after the prefix both share. Run on a float32 copy of a 16-bit
    model it says whether a divergence was a near tie (a margin of a few hundredths of a logit) or a real error."""
    agreement = Agreement.measure(reference, candidate)
    device = next(model.parameters()).device
    margins = []
    for i, position in agreement.divergences():
        context = list(prompts[i]) + list(reference[i][:position])
        with torch.inference_mode():
            logits = model(torch.tensor([context], device=device)).logits[0, -1].float()
        margins.append(float(logits[reference[i][position]] - logits[candidate[i][position]]))
    return margins
