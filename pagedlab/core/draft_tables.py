"""The draft model's own KV bookkeeping: its block pool and block tables, kept in step with the target's sequences.

A draft model runs on its own paged KV cache: a second `KVCacheManager` (its own pool, its own tables), which
knows, for every sequence it drafts for, which tokens its KV holds. Before each proposal the tables are brought
in step with the target's sequences (`sync`): tables of sequences that no longer decode (finished, preempted,
swapped out) are freed, and every other table is rolled back to the longest prefix of the sequence's tokens it
still holds, which drops the drafts the target rejected:

    draft holds:   The cat sat | on the          (context + its own drafts "on", "the")
    target kept:   The cat sat | on a            ("on" accepted, "a" drawn instead of "the")
    roll back to:  The cat sat | on              then compute "a" and draft on from there

Then each pass computes every sequence's tokens the draft has not seen (a catch-up chunk after a prefill, one
draft token later) and draws the next draft greedily from its last row (`next_pass`, `advance`): the catch-up and
the drafting are the same rule. Only committed tokens before the newest are hashed for prefix caching (the
newest is computed again at every sync, also when its sequence was left out of the target's step), so a rollback
never cuts into a cached block. Pure Python: the proposer in `pagedlab.spec_decode.draft_model` runs the passes.

# Explained in chapters/11_speculative_decoding.ipynb
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedlab.core.kv_cache_manager import KVCacheManager, Rollback
from pagedlab.core.sched_output import SamplingRequest, ScheduledRequest
from pagedlab.core.speculation import DraftRequest
from pagedlab.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=None)


class DraftTables:
    """The draft's `KVCacheManager` and, per sequence, the tokens its KV holds (a prefix of the sequence's tokens
    and then its own drafts).

    Invariants:
      - a sequence has a table exactly when it has held tokens, and the table holds exactly those tokens;
      - the manager's own invariants hold.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.held: dict[str, list[int]] = {}  # request_id -> the tokens whose KV the draft holds
        self.num_committed: dict[str, int] = {}  # request_id -> how many of them are the sequence's own tokens

    def sync(self, requests: Sequence[DraftRequest]) -> tuple[list[int], list[Rollback]]:
        """Bring the tables in step with `requests` (this step's decodes): free the others, roll each back to what
        its sequence still agrees with, keeping at least its newest token to compute. Returns the blocks freed by
        dropped tables and the rollbacks."""
        wanted = {r.request_id for r in requests}
        freed = [b for request_id in [r for r in self.held if r not in wanted] for b in self._drop(request_id)]
        rollbacks = []
        for request in requests:
            held = self.held.get(request.request_id)
            if held is None:
                self._start(request)
                continue
            tokens, n = request.token_ids, self.num_committed[request.request_id]
            while n < len(held) and n < len(tokens) and held[n] == tokens[n]:
                n += 1
            n = min(n, len(tokens) - 1)  # the newest token is computed again: its row gives the first draft
            rollbacks.append(self.kv_cache_manager.rollback(request.request_id, n))
            del held[n:]
            self.num_committed[request.request_id] = n
        return freed, rollbacks

    def next_pass(
        self, requests: Sequence[DraftRequest], drafts: Mapping[str, list[int]], budget: int
    ) -> tuple[list[ScheduledRequest], list[int]]:
        """The next draft forward pass: for each sequence that wants more drafts, its tokens the draft has not
        computed (the sequence's, then its drafts so far), at most `budget` in all; a chunk that reaches the end
        draws the next draft. Allocates their slots; a sequence whose slots do not fit is dropped (it gets the
        drafts it has). Returns the pass and its newly allocated blocks (to be cleared)."""
        batch, new_blocks = [], []
        for request in requests:
            rid = request.request_id
            if budget <= 0 or rid not in self.held or len(drafts[rid]) >= request.max_num_draft_tokens:
                continue
            tokens = [*request.token_ids, *drafts[rid]]
            start = len(self.held[rid])
            num_new = min(len(tokens) - start, budget)
            allocation = self.kv_cache_manager.allocate_slots(rid, start + num_new)
            if allocation is None:
                self._drop(rid)
                continue
            new_blocks += allocation.new_block_ids
            budget -= num_new
            reaches_end = start + num_new == len(tokens)
            batch.append(ScheduledRequest(
                rid, start, num_new, rid, tuple(tokens[start : start + num_new]),
                tuple(self.kv_cache_manager.block_tables[rid].block_ids),
                (SamplingRequest(rid, GREEDY),) if reaches_end else (),
            ))
        return batch, new_blocks

    def advance(self, batch: Sequence[ScheduledRequest], sampled: Mapping[str, int], drafts: dict[str, list[int]],
                requests: Mapping[str, DraftRequest]) -> None:
        """A pass has run: its tokens' KV is held; each chunk that reached the end adds its draft."""
        for work in batch:
            rid = work.request_id
            self.held[rid] += work.token_ids
            request = requests[rid]
            tokens = request.token_ids
            self.num_committed[rid] = min(len(self.held[rid]), len(tokens))
            # The newest token is computed again at the next sync (its row gives the first draft), so its block
            # stays unpublished: only the full blocks before it are cached.
            num_cacheable = min(len(self.held[rid]), len(tokens) - 1)
            self.kv_cache_manager.cache_full_blocks(
                rid, num_cacheable, lambda a, b, t=tokens: list(t[a:b]), request.cache_salt
            )
            if work.sampling:
                drafts[rid].append(sampled[rid])

    def _start(self, request: DraftRequest) -> None:
        """A table for a sequence new to the draft, starting from its cached prefix (with prefix caching)."""
        hits = self.kv_cache_manager.get_computed_blocks(request.token_ids, request.cache_salt)
        if self.kv_cache_manager.allocate_slots(
            request.request_id, len(hits) * self.kv_cache_manager.block_size, hits
        ) is None:
            hits = []  # taking cached free blocks needs free room: start empty instead
            self.kv_cache_manager.allocate_slots(request.request_id, 0)
        self.held[request.request_id] = list(request.token_ids[: len(hits) * self.kv_cache_manager.block_size])
        self.num_committed[request.request_id] = len(self.held[request.request_id])

    def _drop(self, request_id: str) -> list[int]:
        self.held.pop(request_id, None)
        self.num_committed.pop(request_id, None)
        return self.kv_cache_manager.free(request_id)

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants()
        assert set(self.held) == set(self.kv_cache_manager.block_tables), (
            "a draft table without held tokens, or the reverse"
        )
        for request_id, held in self.held.items():
            assert self.kv_cache_manager.block_tables[request_id].num_tokens == len(held), (
                f"{request_id}: table and tokens differ"
            )
            assert self.num_committed[request_id] <= len(held)
