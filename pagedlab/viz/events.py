"""A step's events in words: what each sequence computed and where its KV went, forks, copies, preemptions,
swaps, finishes, frees and evictions.

    step 7: seq 2 wrote 1 token into block 12 (slot 3/4), sampled 'Paris'; seq 5 copy-on-write 3 -> 17; ...

Token text appears only when a tokenizer is given (else the token id). Reads only the trace.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

from pagedlab.core.sched_output import ScheduledRequest
from pagedlab.core.trace import StepRecord, Trace
from pagedlab.viz._common import step


def _blocks_during(trace: Trace, index: int, request_id: str) -> tuple[int, ...]:
    """The request's block table while the step ran: after the step, or, if it finished (its table is gone),
    the previous step's table (its CPU table, if it was swapped in this step) with this step's copies and new
    blocks."""
    record = trace.steps[index]
    for table in record.block_tables:
        if table.request_id == request_id:
            return table.block_ids
    blocks: list[int] = []
    if index % len(trace.steps) > 0:
        previous = trace.steps[index % len(trace.steps) - 1]
        blocks = next((list(t.block_ids) for t in previous.block_tables if t.request_id == request_id), [])
        if not blocks:  # swapped in this step: its CPU table, mapped to the device blocks it came back to
            cpu = next((list(t.block_ids) for t in previous.cpu_block_tables if t.request_id == request_id), [])
            to_device = {c: d for _, pairs in record.swapped_in for c, d in pairs}
            blocks = [to_device.get(b, b) for b in cpu]
    for rid, source, copy in record.copied:
        if rid == request_id:
            blocks = [copy if b == source else b for b in blocks]
    for rid, new in record.allocated:
        if rid == request_id:
            blocks += [b for b in new if b not in blocks]
    return tuple(blocks)


def _token(token_id: int, tokenizer) -> str:
    if tokenizer is None:
        return f"token {token_id}"
    return repr(tokenizer.decode([token_id]))


def _work(trace: Trace, index: int, work: ScheduledRequest, fresh: bool, recompute: bool) -> str:
    """fresh: the request was not running before this step (admitted now); recompute: it was preempted before."""
    size = trace.block_size
    record = trace.steps[index]
    blocks = _blocks_during(trace, index, work.request_id)
    start, end = work.num_computed_tokens, work.num_computed_tokens + work.num_new_tokens
    new = {b for rid, bs in record.allocated if rid == work.request_id for b in bs}
    copies = {copy: source for rid, source, copy in record.copied if rid == work.request_id}
    touched = blocks[start // size : (end - 1) // size + 1]
    slot = f"slot {(end - 1) % size + 1}/{size}"
    if work.num_new_tokens == 1 and not fresh:
        block = touched[0] if touched else "?"
        if block in copies:
            where = f"block {block} (its copy of {copies[block]})"
        else:
            where = f"new block {block}" if block in new else f"block {block}"
        return f"seq {work.request_id} wrote 1 token into {where} ({slot})"
    text = f"seq {work.request_id} "
    if fresh and start > 0:
        text += f"reused {start} cached tokens (blocks {list(blocks[: start // size])}) and "
    what = "recomputed" if recompute and fresh else "prefilled" if fresh or work.is_sampling else "computed"
    chunk = "" if work.is_sampling and (fresh or start == 0) else f" (chunk, tokens {start}-{end - 1})"
    tokens = "1 token" if work.num_new_tokens == 1 else f"{work.num_new_tokens} tokens"
    return f"{text}{what} {tokens}{chunk} into blocks {list(touched)} (last block {(end - 1) % size + 1}/{size} full)"


def step_events(trace: Trace, index: int, tokenizer=None) -> list[str]:
    """The events of step `index` of `trace`, one string each, in the order they happened."""
    record: StepRecord = step(trace, index)
    position = index % len(trace.steps)
    previous = trace.steps[position - 1] if position > 0 else None
    was_running = set(previous.running) if previous is not None else set()
    was_preempted = {rid for r in trace.steps[:position] for rid in r.preempted}
    swapped_in = {rid for rid, _ in record.swapped_in}
    sampled = dict(record.appended)
    emitted: dict[str, list[int]] = {}
    for rid, token in record.appended:
        emitted.setdefault(rid, []).append(token)
    verified = {rid: (k, accepted) for rid, k, accepted in record.verified}
    rolled_back = dict(record.rolled_back)
    events = []
    swapped_out = dict(record.swapped_out)
    truncated = list(record.truncated)
    for rid in record.preempted:
        if truncated and truncated[0][0] == rid:  # partial preemptions are listed in order in both
            kept = truncated.pop(0)[1]
            events.append(f"seq {rid} partially preempted (keeps its first {kept} tokens' KV, recomputes the rest)")
        elif rid in swapped_out:
            events.append(f"seq {rid} preempted (swap: {len(swapped_out[rid])} blocks GPU -> CPU)")
        else:
            events.append(f"seq {rid} preempted (recompute)")
    for rid, pairs in record.swapped_in:
        events.append(f"seq {rid} swapped in ({len(pairs)} blocks CPU -> GPU)")
    for rid, source, copy in record.copied:
        events.append(f"seq {rid} copy-on-write {source} -> {copy}")
    for work in record.scheduled:
        rid = work.request_id
        fresh = rid not in was_running and rid not in swapped_in
        text = _work(trace, index, work, fresh, rid in was_preempted)
        if rid in verified:  # speculative decoding: a decode and its drafts, verified in one chunk
            k, accepted = verified[rid]
            slots = list(rolled_back.get(rid, ()))
            first, last = work.num_computed_tokens, work.num_computed_tokens + work.num_new_tokens - 1
            # positions: where tokens sit in the sequence; slots: physical (block id x block size + offset)
            where = f"position {last}" if len(slots) == 1 else f"positions {last - len(slots) + 1}-{last}"
            text = (f"seq {rid} verified {k} draft token{'s' if k > 1 else ''} with its newest token (positions "
                    f"{first}-{last}): accepted {accepted}"
                    + (f", rolled back {where} (physical slots {slots})" if slots else "")
                    + f", emitted {', '.join(_token(t, tokenizer) for t in emitted.get(rid, ()))}")
            events.append(text)
            continue
        if rid in sampled:
            text += f", sampled {_token(sampled[rid], tokenizer)}"
        events.append(text)
    for parent, child in record.forked:
        shared = next((len(t.block_ids) for t in record.block_tables if t.request_id == child), 0)
        events.append(f"seq {child} forked from {parent} (shares its {shared} blocks), sampled "
                      f"{_token(sampled[child], tokenizer) if child in sampled else 'nothing yet'}")
    for rid, reason in record.finished:
        if reason == "pruned":
            events.append(f"seq {rid} pruned (no beam continues it)")
        else:
            events.append(f"seq {rid} finished ({reason})")
    for group, root in record.restarted:
        events.append(f"beam search {group} starts again from its prompt as seq {root} (its beams were recomputed)")
    if record.freed:
        events.append(f"freed blocks {list(record.freed)}")
    if record.evicted:
        events.append(f"evicted cached blocks {list(record.evicted)}")
    events.append(f"{record.num_free_blocks}/{trace.num_blocks} blocks free")
    return events


def describe_step(trace: Trace, index: int, tokenizer=None) -> str:
    """Step `index` of `trace` in one line: "step 7: seq 2 wrote 1 token into block 12 (slot 3/4), ...; ..."."""
    return f"step {step(trace, index).step}: " + "; ".join(step_events(trace, index, tokenizer))
