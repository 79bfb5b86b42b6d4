"""Greedy agreement with Hugging Face `generate()` in bfloat16: SmolLM2 and the tiny test models.

    python scripts/bf16_agreement.py [--num-prompts 48] [--max-tokens 32]

In float32 the tokens are identical; in bfloat16 pagedlab's paged attention adds the same numbers in another
order than Hugging Face's SDPA over a contiguous cache, so where the top two logits are within a rounding error
the argmax can flip. This prints how often, how late (tokens generated before the first divergence), and the
logit margin of the two tokens at each divergence as the same weights score them in float32 (a near tie is a few
hundredths of a logit). The README quotes its output; tests/engine/test_equivalence.py asserts the same on tiny models.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedlab import LLM
from pagedlab.bench.agreement import (
    Agreement,
    chat_prompts,
    divergence_margins,
    hf_greedy,
    pagedlab_greedy,
)
from pagedlab.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model, tokenizer = load_model(None, None, "bfloat16", "cpu")
    prompts = chat_prompts(tokenizer, args.num_prompts)
    reference = hf_greedy(model, prompts, args.max_tokens)
    llm = LLM(model, tokenizer, block_size=16, num_kv_blocks=1024)
    candidate = pagedlab_greedy(llm, prompts, args.max_tokens)
    print(f"SmolLM2-135M-Instruct, bfloat16, {len(prompts)} chat prompts, up to {args.max_tokens} tokens:")
    print(f"  {Agreement.measure(reference, candidate)}")
    margins = divergence_margins(model.float(), prompts, reference, candidate)
    if margins:
        print(f"  float32 logit margins at the divergences: {', '.join(f'{m:+.3f}' for m in margins)}")


if __name__ == "__main__":
    main()
