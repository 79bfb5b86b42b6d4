"""Pictures of the paged KV cache, drawn from an engine's `Trace` (never from live engine objects).

    from pagedlab.viz import animate, draw_kv_usage, draw_step_tokens, draw_timeline
    animate(engine.trace, engine.tokenizer)      # a Play/slider player over every step
    draw_timeline(engine.trace)                  # who waited, ran, was swapped or preempted, step by step
    draw_step_tokens(engine.trace, budget=2048)  # each step's prefill and decode tokens against the budget
    draw_kv_usage(engine.trace)                  # blocks in use, cached and swapped, over the steps
    animate_speculation(engine.trace, "r0")      # one request's drafts: accepted, rolled back, step by step
    playground()                                 # what if: the simulator's panel, paged against contiguous

Every function is pure: the same trace and index always draw the same figure. Colours come from
`seq_color` (Okabe-Ito, stable per sequence across every picture of a trace).

# Explained in chapters/02_paged_blocks.ipynb
"""

from pagedlab.viz.budget import draw_step_tokens
from pagedlab.viz.events import describe_step
from pagedlab.viz.latency import draw_latency, request_times
from pagedlab.viz.palette import seq_color
from pagedlab.viz.player import animate, render
from pagedlab.viz.playground import playground
from pagedlab.viz.pool import draw_block_pool
from pagedlab.viz.queues import draw_queues
from pagedlab.viz.speculation import animate_speculation
from pagedlab.viz.strip import is_eventful, static_strip, strip_indices
from pagedlab.viz.tables import draw_block_tables
from pagedlab.viz.timeline import draw_timeline
from pagedlab.viz.usage import draw_kv_usage

__all__ = [
    "animate",
    "animate_speculation",
    "describe_step",
    "draw_block_pool",
    "draw_block_tables",
    "draw_kv_usage",
    "draw_latency",
    "draw_queues",
    "draw_step_tokens",
    "draw_timeline",
    "is_eventful",
    "playground",
    "render",
    "request_times",
    "seq_color",
    "static_strip",
    "strip_indices",
]
