"""A draft model: a smaller causal LM with the target's vocabulary, run greedily by the engine's own machinery.

It has its own paged KV cache: its own `ModelRunner` (the same flat ragged pass and paged attention as the
target's) over its own KV tensor, and its own block pool and tables (`pagedlab.core.draft_tables.DraftTables`),
brought in step with the target's sequences before every proposal. A proposal is a few forward passes over all
drafting sequences together: the first computes what the draft has not seen yet (the tokens the target accepted
last step, or a whole prompt) and draws draft 1; each later pass feeds back the previous draft and draws the next.

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedlab.core.block_table import cdiv
from pagedlab.core.draft_tables import DraftTables
from pagedlab.core.speculation import DraftRequest
from pagedlab.worker.kv_cache import KVCacheSpec
from pagedlab.worker.model_runner import ModelRunner


def check_draft_model(draft: torch.nn.Module, target: torch.nn.Module) -> None:
    """A draft must share the target's vocabulary, dtype and device."""
    draft_vocab, target_vocab = draft.config.vocab_size, target.config.vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(
            f"the draft model's vocabulary has {draft_vocab} tokens and the target's {target_vocab}: a draft model "
            "must use the target's tokenizer"
        )
    draft_param, target_param = next(draft.parameters()), next(target.parameters())
    if (draft_param.dtype, draft_param.device) != (target_param.dtype, target_param.device):
        raise ValueError(
            f"the draft model is {draft_param.dtype} on {draft_param.device} but the target is {target_param.dtype} "
            f"on {target_param.device}: convert the draft with .to(...) first"
        )


class DraftModelProposer:
    def __init__(
        self, model: torch.nn.Module, num_speculative_tokens: int, num_blocks: int, block_size: int,
        max_num_batched_tokens: int, enable_prefix_caching: bool = False, seed: int = 0,
        attention_backend: str = "torch",
    ) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tables = DraftTables(num_blocks, block_size, enable_prefix_caching)
        spec = KVCacheSpec.from_model_config(model.config, next(model.parameters()).dtype)
        self.runner = ModelRunner(model, spec, num_blocks, block_size, seed, attention_backend)
        self.num_passes = 0  # forward passes of the draft model, over the engine's life
        self.num_tokens = 0  # tokens they computed

    @staticmethod
    def num_blocks_for(target_num_blocks: int, max_num_seqs: int, num_speculative_tokens: int, block_size: int) -> int:
        """Its pool: the target's, plus room for every sequence's drafts beyond its committed tokens."""
        return target_num_blocks + max_num_seqs * (cdiv(num_speculative_tokens, block_size) + 1)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """Up to `max_num_draft_tokens` greedy drafts for each of `requests` (a sequence the draft pool has no room
        for gets fewer, or none)."""
        self.tables.sync(requests)
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        by_id = {r.request_id: r for r in requests}
        while True:
            batch, new_blocks = self.tables.next_pass(requests, drafts, self.max_num_batched_tokens)
            if not batch:
                break
            self.runner.zero_blocks(new_blocks)
            sampled = {rid: tokens[-1] for rid, tokens in self.runner.execute(batch).sampled_token_ids.items()}
            self.tables.advance(batch, sampled, drafts, by_id)
            self.num_passes += 1
            self.num_tokens += sum(w.num_new_tokens for w in batch)
        return {rid: tuple(d) for rid, d in drafts.items() if d}
