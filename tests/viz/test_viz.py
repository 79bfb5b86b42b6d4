"""pagedlab.viz: what each picture draws for a hand-built trace, the player's wiring, and a real engine's trace."""

from __future__ import annotations

import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.text import Text

from pagedlab.core.sched_output import SamplingRequest, ScheduledRequest
from pagedlab.core.trace import BlockTableSnapshot, StepRecord, Trace
from pagedlab.sampling_params import SamplingParams
from pagedlab.viz import (
    animate,
    describe_step,
    draw_block_pool,
    draw_block_tables,
    draw_kv_usage,
    draw_latency,
    draw_queues,
    draw_step_tokens,
    draw_timeline,
    render,
    request_times,
    seq_color,
    static_strip,
)
from pagedlab.viz._common import STORED_DPI, to_png
from pagedlab.viz.palette import FREE_COLOR, OKABE_ITO, color_map
from pagedlab.viz.strip import strip_indices
from pagedlab.viz.tables import shown_columns
from pagedlab.viz.timeline import states
from pagedlab.viz.usage import kv_usage

T = BlockTableSnapshot


def work(request_id, num_computed_tokens, num_new_tokens, samples=True) -> ScheduledRequest:
    """A sequence's share of a step; `samples`: the step reaches its newest token and draws one."""
    sampling = (SamplingRequest(request_id, SamplingParams()),) if samples else ()
    return ScheduledRequest(request_id, num_computed_tokens, num_new_tokens, request_id, sampling=sampling)


def record(step, *, tables=(), waiting=(), running=(), scheduled=(), free, **events) -> StepRecord:
    base = dict(allocated=(), freed=(), preempted=(), appended=(), finished=())
    base.update(events)
    return StepRecord(step=step, scheduled=tuple(scheduled), block_tables=tuple(tables), waiting=tuple(waiting),
                      running=tuple(running), num_free_blocks=free, **base)


def hand_trace() -> Trace:
    """8 blocks of 4 slots. Step 1: a (6 tokens) and b (3) prefill, c waits. Step 2: b forks b:1, a decodes.
    Step 3: b:1 writes into the shared block (copy-on-write 0 -> 4), c is still waiting, a is preempted.

        step 2:  a [5, 2] 7 tokens   b [0] 3 tokens   b:1 [0] 3 tokens (block 0 shared, x2)
    """
    s = work
    return Trace(8, 4, steps=[
        record(1, tables=[T("a", (5, 2), 6), T("b", (0,), 3)], waiting=["c"], running=["a", "b"],
               scheduled=[s("a", 0, 6, True), s("b", 0, 3, True)], allocated=(("a", (5, 2)), ("b", (0,))),
               appended=(("a", 11), ("b", 12)), free=5),
        record(2, tables=[T("a", (5, 2), 7), T("b", (0,), 3), T("b:1", (0,), 3)], waiting=["c"],
               running=["a", "b", "b:1"], scheduled=[s("a", 6, 1, True)], appended=(("a", 13),),
               forked=(("b", "b:1"),), cached_blocks=(5,), free=5),
        record(3, tables=[T("b", (0,), 4), T("b:1", (4,), 4)], waiting=["a", "c"], running=["b", "b:1"],
               scheduled=[s("b", 3, 1, True), s("b:1", 3, 1, True)], allocated=(("b:1", (4,)),),
               copied=(("b:1", 0, 4),), preempted=("a",), freed=(2, 5), appended=(("b", 14), ("b:1", 15)),
               cached_blocks=(5,), free=6),
    ])


def gid(ax, name):
    [artist] = [c for c in ax.collections if c.get_gid() == name]
    return artist


def texts(ax, name):
    return [t.get_text() for t in ax.texts if t.get_gid() == name]


def hexes(collection):
    return [to_hex(c) for c in collection.get_facecolors()]


# -- colours ---------------------------------------------------------------------------------------------


def test_colours_follow_first_appearance_and_children_shade_their_parent():
    trace = hand_trace()
    colors = color_map(trace)
    assert list(colors) == ["a", "b", "c", "b:1"]  # c waits in step 1; b:1 is forked in step 2
    assert colors["a"] == OKABE_ITO[0].lower() and colors["b"] == OKABE_ITO[1].lower()
    assert colors["c"] == OKABE_ITO[2].lower()  # the fork does not use up a palette colour
    assert colors["b:1"] not in [c.lower() for c in OKABE_ITO]
    assert seq_color(trace, "a") == colors["a"]
    # stable: a longer trace does not recolour the sequences already seen
    longer = Trace(8, 4, steps=[*trace.steps, record(4, running=["z"], free=8)])
    assert {k: color_map(longer)[k] for k in colors} == colors


def test_more_roots_than_colours_stay_distinct():
    trace = Trace(4, 4, steps=[record(1, waiting=[f"r{i}" for i in range(20)], free=4)])
    assert len(set(color_map(trace).values())) == 20


# -- the pool --------------------------------------------------------------------------------------------


def test_block_pool_cells_colours_fill_refcounts_and_cache_marks():
    trace = hand_trace()
    fig = draw_block_pool(trace, 1)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    cells = gid(ax, "pool")
    assert len(cells.get_paths()) == 8
    a, b = seq_color(trace, "a"), seq_color(trace, "b")
    assert hexes(cells) == [b, FREE_COLOR.lower(), a, FREE_COLOR.lower(), FREE_COLOR.lower(), a, FREE_COLOR.lower(),
                            FREE_COLOR.lower()]
    assert texts(ax, "pool-id") == [str(i) for i in range(8)]
    assert texts(ax, "pool-refcount") == ["x2"]  # block 0, held by b and b:1
    # partly filled: block 2 (a's 7th token, 3/4) and block 0 (3/4); block 5 is full
    assert len(gid(ax, "pool-empty").get_paths()) == 2
    assert len(gid(ax, "pool-cached").get_offsets()) == 1
    assert "step 2: 3/8 blocks in use" in ax.get_title()


def test_block_pool_marks_new_blocks_and_the_copy():
    ax = draw_block_pool(hand_trace(), 2).axes[0]
    edges = [to_hex(c) for c in gid(ax, "pool").get_edgecolors()]
    assert [i for i, e in enumerate(edges) if e == "#000000"] == [4]


def test_compact_pool_of_1000_blocks_has_no_labels_and_one_collection():
    tables = [T(f"r{i}", tuple(range(i * 50, i * 50 + 40)), 40 * 16 - 3) for i in range(20)]
    trace = Trace(1000, 16, steps=[record(1, tables=tables, running=[t.request_id for t in tables], free=200)])
    ax = draw_block_pool(trace, 0).axes[0]
    assert len(gid(ax, "pool").get_paths()) == 1000
    assert texts(ax, "pool-id") == []


def drawn(fig):
    """The figure's artists other than text: what a frame costs to draw, beside its labels."""
    return sorted(type(a).__name__ for ax in fig.axes for a in ax.get_children() if not isinstance(a, Text))


def test_a_frame_draws_its_blocks_as_collections_so_its_cost_does_not_grow_with_the_pool():
    # Speed is measured by scripts/viz_frame_bench.py; here, what makes a frame fast: one artist per kind
    # of cell (a PatchCollection), not one per block, so 64 blocks draw the same artists as 8.
    def frame(num_blocks, blocks_each):
        tables = [T(f"r{i}", tuple(range(i * blocks_each, (i + 1) * blocks_each)), 4 * blocks_each - 1)
                  for i in range(6)]
        return render(Trace(num_blocks, 4, steps=[
            record(1, tables=tables, running=[t.request_id for t in tables], free=num_blocks - 6 * blocks_each)]), 0)

    few, many = frame(8, 1), frame(64, 10)
    assert drawn(few) == drawn(many)
    assert len(drawn(many)) < 64


def test_swapped_sequences_appear_in_a_cpu_pool_only_once_the_trace_swapped():
    trace = hand_trace()
    trace.num_cpu_blocks = 1 << 20  # a 4 GiB swap space of tiny blocks: never drawn whole
    assert texts(draw_block_pool(trace, 2).axes[0], "cpu-pool-title") == []
    swapped = record(4, tables=[T("b", (0,), 5)], cpu_block_tables=[T("b:1", (0, 1), 5)], running=["b"],
                     waiting=["a", "c"], swapped=["b:1"], preempted=("b:1",), free=7,
                     swapped_out=(("b:1", ((4, 0), (1, 1))),))
    trace.steps.append(swapped)
    ax = draw_block_pool(trace, 3).axes[0]
    assert texts(ax, "cpu-pool-title") == [f"CPU swap pool, first 4 of {1 << 20}"]
    assert hexes(gid(ax, "cpu-pool"))[:3] == [seq_color(trace, "b:1")] * 2 + [FREE_COLOR.lower()]
    assert "seq b:1 preempted (swap: 2 blocks GPU -> CPU)" in describe_step(trace, 3)
    assert texts(draw_block_tables(trace, 3).axes[0], "tables-seq") == ["b", "b:1 (CPU)"]


# -- block tables and queues -----------------------------------------------------------------------------


def test_block_tables_show_logical_to_physical_and_fill():
    trace = hand_trace()
    ax = draw_block_tables(trace, 1).axes[0]
    assert texts(ax, "tables-seq") == ["a", "b", "b:1"]
    assert texts(ax, "tables-block") == ["5", "2", "0", "0"]
    assert texts(ax, "tables-logical") == ["0", "1"]
    assert texts(ax, "tables-tokens") == ["7 tok, last 3/4", "3 tok, last 3/4", "3 tok, last 3/4"]
    assert hexes(gid(ax, "tables")) == [seq_color(trace, r) for r in ("a", "a", "b", "b:1")]


def test_queues_lanes_in_queue_order_with_the_preempted_dashed():
    trace = hand_trace()
    ax = draw_queues(trace, 2).axes[0]
    assert texts(ax, "queues-lane") == ["waiting (2)", "running (2)", "swapped (0)"]
    assert texts(ax, "queue-waiting-label") == ["a", "c"]
    assert texts(ax, "queue-running-label") == ["b", "b:1"]
    waiting = [p for p in ax.patches if p.get_gid() == "queue-waiting"]
    assert [to_hex(p.get_facecolor()) for p in waiting] == [seq_color(trace, "a"), seq_color(trace, "c")]
    assert [p.get_linestyle() for p in waiting] == ["--", "-"]


# -- the timeline ----------------------------------------------------------------------------------------


def test_timeline_states_and_marks():
    trace = hand_trace()
    assert states(trace) == {
        "a": ["running", "running", "waiting"],
        "b": ["running", "running", "running"],
        "b:1": [None, "running", "running"],
        "c": ["waiting", "waiting", "waiting"],
    }
    ax = draw_timeline(trace).axes[0]
    assert len(gid(ax, "timeline-running").get_paths()) == 3  # a (steps 1-2), b (1-3), b:1 (2-3)
    assert len(gid(ax, "timeline-waiting").get_paths()) == 2  # a (3), c (1-3)
    assert hexes(gid(ax, "timeline-running")) == [seq_color(trace, r) for r in ("a", "b", "b:1")]
    assert gid(ax, "timeline-preempted").get_offsets().tolist() == [[3, 0]]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "b:1", "c"]  # a request's forks under it


def test_a_timeline_of_many_sequences_names_each_request_with_its_forks_under_it():
    """Over 40 rows the rows are too thin to name one by one: each request is named, its samples right under it,
    a thin line between requests, so that a reader can follow one request."""
    requests = [f"r{i}" for i in range(24)]
    forks = [f"{r}:1" for r in requests]
    trace = Trace(64, 4, steps=[
        record(1, running=requests, free=40),
        record(2, running=requests + forks, forked=tuple(zip(requests, forks)), free=16),
    ])
    ax = draw_timeline(trace).axes[0]
    assert list(states(trace))[:4] == ["r0", "r0:1", "r1", "r1:1"]
    assert [t.get_text() for t in ax.get_yticklabels()] == requests
    assert list(ax.get_yticks()) == list(range(0, 48, 2))
    assert len(gid(ax, "timeline-groups").get_segments()) == 23


def test_timeline_marks_arrivals_before_the_engine_saw_them():
    """Requests a client held back (static batching) never wait in the engine: `arrivals` draws when each arrived,
    and a line from there to its first step in the trace."""
    trace = hand_trace()  # a and b first appear in step 1, c waits from step 1
    ax = draw_timeline(trace, arrivals={"a": -2, "b": 1, "c": 0}).axes[0]
    assert gid(ax, "timeline-arrived").get_offsets().tolist() == [[-2, 0], [1, 1], [0, 3]]  # c under b and b:1
    held = gid(ax, "timeline-held-back")
    assert [p.vertices.tolist() for p in held.get_paths()] == [[[-2, 0], [0.5, 0]], [[0, 3], [0.5, 3]]]
    assert ax.get_xlim()[0] <= -2.5  # the earliest arrival is in view
    assert "arrived (held back until the line ends)" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match="'z' is not in the trace"):
        draw_timeline(trace, arrivals={"z": 1})


# -- events ----------------------------------------------------------------------------------------------


class FakeTokenizer:
    def decode(self, token_ids):
        return {11: " Four", 12: " score", 13: " and", 14: " seven", 15: " years"}[token_ids[0]]


def test_describe_step_in_words():
    trace = hand_trace()
    assert describe_step(trace, 0) == (
        "step 1: seq a prefilled 6 tokens into blocks [5, 2] (last block 2/4 full), sampled token 11; "
        "seq b prefilled 3 tokens into blocks [0] (last block 3/4 full), sampled token 12; 5/8 blocks free"
    )
    assert describe_step(trace, 1, FakeTokenizer()) == (
        "step 2: seq a wrote 1 token into block 2 (slot 3/4), sampled ' and'; "
        "seq b:1 forked from b (shares its 1 blocks), sampled nothing yet; 5/8 blocks free"
    )
    assert describe_step(trace, -1, FakeTokenizer()) == (
        "step 3: seq a preempted (recompute); seq b:1 copy-on-write 0 -> 4; "
        "seq b wrote 1 token into block 0 (slot 4/4), sampled ' seven'; "
        "seq b:1 wrote 1 token into block 4 (its copy of 0) (slot 4/4), sampled ' years'; "
        "freed blocks [2, 5]; 6/8 blocks free"
    )


def test_partial_preemption_in_words():
    s = work
    before = record(1, tables=[T("a", (5,), 3), T("b", (0, 1, 2), 12)], running=["a", "b"],
                    scheduled=[s("a", 0, 3, True), s("b", 0, 12, True)], free=5)
    after = record(2, tables=[T("a", (5, 2), 5), T("b", (0, 1), 8)], running=["a", "b"], preempted=("b",),
                   truncated=(("b", 8),), scheduled=[s("a", 3, 2, True)], freed=(2,), free=5)
    assert describe_step(Trace(6, 4, steps=[before, after]), 1).startswith(
        "step 2: seq b partially preempted (keeps its first 8 tokens' KV, recomputes the rest); "
    )


def test_empty_trace_is_refused():
    with pytest.raises(ValueError, match="no steps"):
        render(Trace(4, 4), 0)
    with pytest.raises(ValueError, match="no steps"):
        animate(Trace(4, 4))


# -- render, strip, player -------------------------------------------------------------------------------


def test_render_and_its_legend_of_the_marks_present():
    trace = hand_trace()
    fig = render(trace, 1)
    assert [ax.get_title() for ax in fig.axes] == [
        "step 2: 3/8 blocks in use, 4 slots each", "queues after step 2", "block tables: logical -> physical"]
    # step 2: free blocks, a shared block (x2), a cached block, partly filled blocks; nothing new this step
    assert legend_labels(fig.axes[0]) == ["free", "pale: empty slots", "shared by N block tables", "cached (hashed)"]
    # step 1: new blocks, no sharing, no cache
    assert legend_labels(render(trace, 0).axes[0]) == ["free", "new this step", "pale: empty slots"]
    # step 3: b and b:1 hold full blocks of their own (0 and its copy 4)
    assert legend_labels(draw_block_pool(trace, 2).axes[0]) == ["free", "new this step", "cached (hashed)"]


def legend_labels(ax):
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def strip_texts(fig, name):
    return [t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == name]


def test_static_strip_shows_each_step_with_its_block_tables_and_events():
    trace = hand_trace()
    assert strip_indices(trace) == [0, 1, 2]  # few steps: every one
    strip = static_strip(trace)
    assert strip_texts(strip, "strip-title") == [
        "step 1: 3/8 blocks in use", "step 2: 3/8 blocks in use", "step 3: 2/8 blocks in use"]
    assert strip_texts(strip, "strip-tables-1-seq") == ["a", "b", "b:1"]
    assert strip_texts(strip, "strip-tables-1-block") == ["5", "2", "0", "0"]
    assert strip_texts(strip, "strip-tables-2-tokens") == ["4 tok", "4 tok"]
    assert strip_texts(strip, "strip-pool-0-id") == [str(b) for b in range(8)]
    notes = strip_texts(strip, "strip-note")
    assert "a prefilled 6 tokens" in notes and "b:1 forked from b" in notes
    assert "a preempted (recompute)" in notes and "b:1 copy-on-write 0 → 4" in notes and "freed 2, 5" in notes
    # one legend for the strip: the marks some frame shows
    assert legend_labels(strip.axes[0]) == [
        "free", "new this step", "pale: empty slots", "shared by N block tables", "cached (hashed)"]
    only_first = static_strip(trace, [0])
    assert strip_texts(only_first, "strip-title") == ["step 1: 3/8 blocks in use"]
    assert legend_labels(only_first.axes[0]) == ["free", "new this step", "pale: empty slots"]
    with pytest.raises(ValueError, match="at least one"):
        static_strip(trace, [])


def test_static_strip_wraps_onto_rows_that_fit_a_notebook_with_readable_text():
    # 10 steps of a 32-block pool, three sequences with 11-block tables: too wide for one row.
    s = work
    steps = []
    for k in range(10):
        tables = [T(f"0:b{i}", tuple(range(i * 10, i * 10 + 10)) + (30 + i % 2,), 41 + k % 4) for i in range(3)]
        steps.append(record(k + 1, tables=tables, running=[t.request_id for t in tables],
                            scheduled=[s(t.request_id, 40 + k % 4, 1, True) for t in tables], free=1))
    trace = Trace(32, 4, steps=steps)
    assert strip_indices(trace) == list(range(10))
    strip = static_strip(trace)
    width, height = (strip.get_size_inches() * STORED_DPI).round()
    assert width <= 900 and height > width  # wrapped onto rows, each within a notebook's width
    titles = [t for ax in strip.axes for t in ax.texts if t.get_gid() == "strip-title"]
    assert len({t.get_position()[1] for t in titles}) == 5  # 10 frames, 2 a row
    pixels = [(t.get_gid() or "", t.get_fontsize() * STORED_DPI / 72) for ax in strip.axes for t in ax.texts]
    assert min(px for _, px in pixels) >= 10 and min(px for g, px in pixels if "refcount" not in g) >= 11
    # a table longer than the strip's columns keeps its head and its tail
    assert strip_texts(strip, "strip-tables-0-logical") == ["0", "1", "…", "6", "7", "8", "9", "10"]
    assert strip_texts(strip, "strip-tables-0-cut") == ["+4"] * 3
    assert strip_texts(strip, "strip-tables-0-block")[:9] == ["0", "1", "6", "7", "8", "9", "30", "10", "11"]


def test_long_traces_show_even_and_eventful_steps():
    steps = [record(k + 1, running=["a"], free=4) for k in range(40)]
    steps[17] = record(18, running=["a", "a:1"], forked=(("a", "a:1"),), free=4)
    trace = Trace(4, 4, steps=steps)
    indices = strip_indices(trace)
    assert indices[0] == 0 and indices[-1] == 39 and 17 in indices and len(indices) <= 12


def test_table_columns_keep_head_and_tail():
    assert shown_columns(5, 8) == [0, 1, 2, 3, 4]
    assert shown_columns(13, 8) == [0, 1, None, 8, 9, 10, 11, 12]
    assert shown_columns(40, 16) == [0, 1, 2, 3, 4, None, *range(30, 40)]


def test_a_pruned_beam_reads_as_pruned_everywhere():
    trace = hand_trace()
    pruned = record(4, tables=[T("b", (0,), 5)], running=["b"], waiting=["a", "c"], free=7,
                    finished=(("b:1", "pruned"),), freed=(4,), scheduled=[work("b", 4, 1)],
                    appended=(("b", 11),))
    trace.steps.append(pruned)
    text = describe_step(trace, 3)
    assert "seq b:1 pruned (no beam continues it)" in text and "finished" not in text
    assert texts(draw_queues(trace, 3).axes[0], "queue-running-label") == ["b", "b:1\npruned"]
    assert "b:1 pruned" in strip_texts(static_strip(trace, [3]), "strip-note")
    ax = draw_timeline(trace).axes[0]
    assert gid(ax, "timeline-pruned").get_offsets().tolist() == [[4, 2]]  # b:1, the row under b
    assert "pruned (beam)" in legend_labels(ax) and "finished" not in legend_labels(ax)


def test_player_dom_contract_and_static_fallback():
    trace = hand_trace()
    player = animate(trace, FakeTokenizer())
    assert "pagedlab-player" in player.widget._dom_classes
    assert "pagedlab-frame" in player.image._dom_classes and player.image.format == "png"
    assert "pagedlab-events" in player.events._dom_classes
    assert player.slider.max == player.play.max == 2
    assert player.image.value == to_png(render(trace, 0))
    player.slider.value = 2  # what the browser does when Play ticks (jslink'ed to the slider)
    assert player.image.value == to_png(render(trace, 2))
    assert "copy-on-write 0 -&gt; 4" in player.events.value and "' seven'" in player.events.value
    bundle = player._repr_mimebundle_()
    assert {"application/vnd.jupyter.widget-view+json", "image/png", "text/plain"} <= set(bundle)
    assert bundle["text/plain"].startswith("pagedlab player: 3 frames (steps 1-3) over 8 blocks of 4 slots")
    assert animate(trace, indices=[0, 2]).slider.max == 1


# -- a real engine's trace -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_trace():
    from pagedlab import LLMEngine, SamplingParams
    from pagedlab.config import EngineConfig
    from tests.helpers import random_prompts, tiny_model

    config = EngineConfig(block_size=4, num_kv_blocks=16, preemption_mode="swap", num_cpu_blocks=16)
    engine = LLMEngine(tiny_model("llama"), None, config)
    for i, prompt in enumerate(random_prompts([9, 13, 6])):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=12, n=2 if i == 1 else 1)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.trace


def test_every_step_of_an_engine_trace_draws_what_its_tables_hold(engine_trace):
    trace = engine_trace
    assert any(r.forked for r in trace) and any(r.copied for r in trace) and any(r.preempted for r in trace)
    for index, step in enumerate(trace):
        cells = hexes(gid(draw_block_pool(trace, index).axes[0], "pool"))
        expected = [FREE_COLOR.lower()] * trace.num_blocks
        for table in reversed(step.block_tables):  # the first holder of a shared block gives its colour
            for block_id in table.block_ids:
                expected[block_id] = seq_color(trace, table.request_id)
        assert cells == expected
        assert cells.count(FREE_COLOR.lower()) == step.num_free_blocks
        text = describe_step(trace, index)
        assert text.startswith(f"step {step.step}: ")
        for rid in step.preempted:
            assert f"seq {rid} preempted (swap" in text
        for rid, source, copy in step.copied:
            assert f"seq {rid} copy-on-write {source} -> {copy}" in text
    assert isinstance(draw_timeline(trace), Figure)
    assert isinstance(render(trace, len(trace) // 2), Figure)
    swapped = next(i for i, r in enumerate(trace) if r.swapped)
    assert texts(draw_block_pool(trace, swapped).axes[0], "cpu-pool-title")
    strip = static_strip(trace)
    assert strip.get_size_inches()[0] * STORED_DPI <= 900
    assert any(t.startswith("CPU swap pool") for t in strip_texts(strip, f"cpu-strip-pool-{swapped}-title"))


# -- per-step tokens, KV usage and latency (chapters 05-09) ---------------------------------------------


def timed_trace() -> Trace:
    """Four steps of a hand-made trace with durations: a prefill, a mixed step, a decode step, a swap."""
    s = ScheduledRequest
    return Trace(8, 4, num_cpu_blocks=4, steps=[
        record(1, tables=[T("a", (0, 1), 6)], waiting=["b"], running=["a"], scheduled=[s("a", 0, 6)],
               appended=(("a", 1),), cached_blocks=(0,), free=6, num_free_cpu_blocks=4, duration_s=0.5),
        record(2, tables=[T("a", (0, 1), 7), T("b", (2, 3), 5)], running=["a", "b"],
               scheduled=[s("a", 6, 1), s("b", 0, 5)], appended=(("a", 2), ("b", 3)), cached_blocks=(0, 2),
               free=4, num_free_cpu_blocks=4, duration_s=0.25),
        record(3, tables=[T("b", (2, 3), 6)], running=["b"], scheduled=[s("b", 5, 1)], appended=(("b", 4),),
               finished=(("a", "length"),), freed=(1, 0), cached_blocks=(0, 2), free=6, num_free_cpu_blocks=4,
               duration_s=0.125),
        record(4, tables=[], swapped=["b"], cpu_block_tables=[T("b", (0, 1), 6)], preempted=("b",),
               swapped_out=(("b", ((2, 0), (3, 1))),), scheduled=[], free=8, num_free_cpu_blocks=2,
               duration_s=0.0625),
    ])


def test_step_tokens_split_prefill_and_decode_against_the_budget():
    trace = timed_trace()
    ax = draw_step_tokens(trace, budget=8, show_duration=True).axes[0]
    decode = [p.get_height() for p in ax.patches if p.get_gid() == "tokens-decode"]
    prefill = [p.get_height() for p in ax.patches if p.get_gid() == "tokens-prefill"]
    assert decode == [0, 1, 1, 0] and prefill == [6, 5, 0, 0]
    [budget] = [line for line in ax.lines if line.get_gid() == "tokens-budget"]
    assert list(budget.get_ydata()) == [8, 8]
    [duration] = [line for ax_ in ax.figure.axes for line in ax_.lines if line.get_gid() == "tokens-duration"]
    assert list(duration.get_ydata()) == [500, 250, 125, 62.5]
    assert "budget (8 tokens)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_kv_usage_counts_used_cached_and_cpu_blocks():
    trace = timed_trace()
    assert kv_usage(trace) == {"used": [2, 4, 2, 0], "cached_free": [0, 0, 1, 0], "cpu_used": [0, 0, 0, 2]}
    ax = draw_kv_usage(trace).axes[0]
    assert [c.get_gid() for c in ax.collections] == ["usage-cached", "usage-preempted"]
    assert gid(ax, "usage-preempted").get_offsets().tolist() == [[4, 0]]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["device blocks in use", "free but cached (prefix cache)", "CPU swap blocks in use",
                      "device pool (8 blocks)", "preemption"]


def test_request_times_and_latency_curves():
    times = request_times(timed_trace())
    assert times["a"].arrival_s == 0 and times["a"].token_s == (0.5, 0.75)
    assert times["b"].arrival_s == 0 and times["b"].token_s == (0.75, 0.875)  # waiting in step 1
    assert times["b"].ttft_s == 0.75 and times["b"].itl_s == [0.125]
    fig = draw_latency({"first token": [t.ttft_s for t in times.values()], "empty": []}, title="t", unit="s")
    [curve] = [line for line in fig.axes[0].lines if line.get_gid() == "latency-0"]
    assert list(curve.get_xdata()) == [0.5, 0.75]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["first token: p50 0.625, p99 0.748 s"]


def test_is_eventful_and_strip_indices_are_exported():
    import pagedlab.viz as viz

    trace = timed_trace()
    assert [viz.is_eventful(trace, i) for i in range(4)] == [False, False, False, True]
    assert viz.strip_indices(trace, num_even=2) == [0, 1, 2, 3]  # a short trace: every step


def test_a_sequence_swapped_in_and_finished_in_one_step_names_its_block():
    s = ScheduledRequest
    out = record(1, tables=[], cpu_block_tables=[T("a", (0, 1), 7)], swapped=["a"], preempted=("a",),
                 swapped_out=(("a", ((3, 0), (5, 1))),), free=8)
    back = record(2, tables=[], scheduled=[s("a", 7, 1)], swapped_in=(("a", ((0, 6), (1, 2))),),
                  appended=(("a", 11),), finished=(("a", "length"),), freed=(2, 6), free=8)
    text = describe_step(Trace(8, 4, num_cpu_blocks=2, steps=[out, back]), 1)
    assert "seq a wrote 1 token into block 2 (slot 4/4), sampled token 11" in text


# -- speculation -------------------------------------------------------------------------------------------


def speculation_trace() -> Trace:
    """Blocks of 4. Step 1: r0 prefills 6 tokens. Step 2: its newest token and 3 drafts (positions 6-9), 1
    accepted: positions 8-9 rolled back (slots 8, 9 of block 2, freed)."""
    prefill = ScheduledRequest("r0", 0, 6, "r0", tuple(range(10, 16)), (0, 1),
                               sampling=(SamplingRequest("r0", SamplingParams()),))
    verify = ScheduledRequest("r0", 6, 4, "r0", (16, 17, 18, 19), (0, 1, 2), num_spec_tokens=3,
                              sampling=(SamplingRequest("r0", SamplingParams()),))
    return Trace(8, 4, steps=[
        record(1, tables=[T("r0", (0, 1), 6)], running=["r0"], scheduled=[prefill], appended=(("r0", 16),),
               allocated=(("r0", (0, 1)),), free=6),
        record(2, tables=[T("r0", (0, 1), 8)], running=["r0"], scheduled=[verify], appended=(("r0", 17), ("r0", 30)),
               verified=(("r0", 3, 1),), rolled_back=(("r0", (8, 9)),), freed=(2,), free=6),
    ])


def test_speculation_frame_draws_accepted_and_rejected_drafts_and_the_freed_block():
    from pagedlab.viz.speculation import speculation_frame

    ax = speculation_frame(speculation_trace(), 1, "r0").axes[0]
    cells = [p.get_gid() for p in ax.patches if p.get_gid()]
    written, after = cells[:12], cells[12:]  # 3 blocks written this step, 2 kept after the rollback
    assert written == ["slot-computed"] * 6 + ["slot-newest", "slot-accepted", "slot-rejected", "slot-rejected",
                                               "slot-empty", "slot-empty"]
    assert after == ["slot-computed"] * 6 + ["slot-newest", "slot-accepted"]
    assert [t.get_text() for t in ax.texts if t.get_gid() == "block-freed"] == ["block 2 freed"]
    with pytest.raises(ValueError, match="did not schedule 'r9'"):
        speculation_frame(speculation_trace(), 1, "r9")


def test_speculation_player_shows_the_steps_of_its_request_and_stores_the_rollbacks():
    from pagedlab.viz import animate_speculation

    player = animate_speculation(speculation_trace(), "r0")
    assert player.indices == [0, 1]
    player.slider.value = 1
    assert "rolled back positions 8-9 (physical slots [8, 9])" in player.events.value
    bundle = player._repr_mimebundle_()
    assert bundle["text/plain"] == "speculation player: 2 steps of seq r0" and bundle["image/png"]
    with pytest.raises(ValueError, match="no step of the trace scheduled 'r9'"):
        animate_speculation(speculation_trace(), "r9")


def test_speculation_player_stores_steps_that_gave_slots_back_not_those_that_accepted_every_draft(monkeypatch):
    import dataclasses

    from pagedlab.viz import animate_speculation, speculation

    trace = speculation_trace()
    verify = trace.steps[1]
    all_accepted = dataclasses.replace(verify, verified=(("r0", 3, 3),), rolled_back=(("r0", ()),), freed=())
    trace.steps[1:1] = [all_accepted]  # a step whose drafts were all accepted records an empty rollback
    stored = []
    real_strip = speculation.speculation_strip
    monkeypatch.setattr(speculation, "speculation_strip",
                        lambda t, indices, rid: stored.append(indices) or real_strip(t, indices, rid))
    animate_speculation(trace, "r0")._repr_mimebundle_()
    assert stored == [[2]]
