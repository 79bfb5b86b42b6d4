"""What a quantised KV cache costs in accuracy: teacher-forced next-token distributions through the engine's own
model runner and paged cache, for perplexity and the KL divergence from a full-precision cache.

`teacher_forced(llm, token_ids, chunk)` runs a text through `llm`'s runner in prefill chunks over its paged KV
cache (what chunked prefill does: every query reads the stored, possibly quantised, K and V of all tokens before
it), and yields each chunk's next-token log-probabilities. `compare(reference, candidate, token_ids)` runs two
engines over the same text in step and returns perplexities, the mean KL(reference || candidate) per token and
the share of positions whose argmax agrees.

# Explained in chapters/10_quantised_kv.ipynb
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from pagedlab.core.block_table import cdiv
from pagedlab.core.sched_output import ScheduledRequest


def teacher_forced(llm, token_ids: Sequence[int], chunk: int = 256) -> Iterator[torch.Tensor]:
    """Next-token log-probabilities [chunk rows, vocab] (float32) after each position of `token_ids`, chunk by
    chunk. Uses blocks 1.. of the engine's cache directly: call it on an engine that runs nothing else."""
    runner = llm.llm_engine.worker.model_runner
    block_size = runner.block_size
    num_blocks = cdiv(len(token_ids), block_size)
    if num_blocks + 1 > runner.kv_cache.shape[2]:
        raise ValueError(
            f"{len(token_ids)} tokens need {num_blocks + 1} KV blocks; the engine has {runner.kv_cache.shape[2]}"
        )
    block_ids = tuple(range(1, 1 + num_blocks))
    runner.zero_blocks(list(block_ids))
    for start in range(0, len(token_ids), chunk):
        new = tuple(token_ids[start : start + chunk])
        scheduled = ScheduledRequest("teacher-forced", start, len(new), "teacher-forced", new, block_ids)
        yield torch.log_softmax(runner.logits([scheduled]).float(), dim=-1)


@dataclass(frozen=True)
class TextComparison:
    num_tokens: int  # positions scored (each predicts the next token of the text)
    reference_perplexity: float
    candidate_perplexity: float
    mean_kl: float  # KL(reference || candidate) per position, in nats
    max_kl: float
    argmax_agreement: float  # share of positions where both predict the same most likely token


def compare(reference, candidate, token_ids: Sequence[int], chunk: int = 256) -> TextComparison:
    """Two engines over the same text, in step (so only one chunk of each distribution is held at once);
    `reference` may also be its `teacher_forced` chunks, computed once for several candidates."""
    if not isinstance(reference, (list, tuple)):
        reference = teacher_forced(reference, token_ids, chunk)
    targets = torch.tensor(list(token_ids[1:]))
    nll_ref = nll_cand = kl_sum = 0.0
    kl_max, agree, seen = 0.0, 0, 0
    for ref, cand in zip(reference, teacher_forced(candidate, token_ids, chunk)):
        rows = min(len(ref), len(targets) - seen)  # the text's last position predicts nothing
        ref, cand, target = ref[:rows], cand[:rows], targets[seen : seen + rows]
        nll_ref -= ref.gather(1, target[:, None]).sum().item()
        nll_cand -= cand.gather(1, target[:, None]).sum().item()
        kl = (ref.exp() * (ref - cand)).sum(dim=-1)
        kl_sum += kl.sum().item()
        kl_max = max(kl_max, kl.max().item())
        agree += (ref.argmax(-1) == cand.argmax(-1)).sum().item()
        seen += rows
    n = max(seen, 1)
    return TextComparison(seen, float(torch.tensor(nll_ref / n).exp()), float(torch.tensor(nll_cand / n).exp()),
                          kl_sum / n, kl_max, agree / n)


def english_text() -> str:
    """English prose that ships with Python itself (no download): the language reference's help topics
    (`pydoc_data.topics`, the text of `help("assert")` and the like), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))
