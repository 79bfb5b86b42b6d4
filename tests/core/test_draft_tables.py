"""The draft model's block tables (`pagedlab.core.draft_tables`): kept in step with the target's sequences, rolled
back over rejected drafts, and never rolled back into a block their prefix cache has published."""

from __future__ import annotations

from pagedlab.core.draft_tables import DraftTables
from pagedlab.core.speculation import DraftRequest


def draft(tables: DraftTables, request: DraftRequest, num_drafts: int) -> list[int]:
    """One proposal for `request` alone: sync, then passes until it has `num_drafts` drafts (each a made-up 9)."""
    tables.sync([request])
    drafts = {request.request_id: []}
    while True:
        batch, _ = tables.next_pass([request], drafts, budget=8)
        if not batch:
            return drafts[request.request_id]
        tables.advance(batch, {request.request_id: 9}, drafts, {request.request_id: request})
        tables.check_invariants()


def test_a_decode_left_out_of_a_step_is_drafted_for_again():
    """A sequence whose length is a multiple of block_size is drafted for, then left out of the target's step
    (its tokens unchanged), then drafted for again: the sync recomputes its newest token, so the block holding
    that token must not have been cached (issue 31: 'rolled back into a cached block')."""
    tables = DraftTables(num_blocks=16, block_size=2, enable_prefix_caching=True)
    request = DraftRequest("a", (1, 2, 3, 4), max_num_draft_tokens=2)
    assert draft(tables, request, 2) == [9, 9]
    assert draft(tables, request, 2) == [9, 9]  # left out of the step: the same tokens again
    tables.check_invariants()
    grown = DraftRequest("a", (1, 2, 3, 4, 9, 5), max_num_draft_tokens=2)  # one draft accepted, then a 5
    assert draft(tables, grown, 2) == [9, 9]
    pool, table = tables.kv_cache_manager.pool, tables.kv_cache_manager.block_tables["a"]
    assert [pool.block_hash[b] is not None for b in table.block_ids] == [True, True, False, False], (
        "the blocks before the newest token are cached, the one holding it and the drafts' are not"
    )
