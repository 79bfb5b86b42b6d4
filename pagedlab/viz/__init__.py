"""Pictures of the paged KV cache, drawn from an engine's `Trace` (never from live engine objects).

    from pagedlab.viz import animate, draw_timeline
    animate(engine.trace, engine.tokenizer)      # a Play/slider player over every step
    draw_timeline(engine.trace)                  # who waited, ran, was swapped or preempted, step by step
    playground()                                 # what if: the simulator's panel, paged against contiguous

Every function is pure: the same trace and index always draw the same figure. Colours come from
`seq_color` (Okabe-Ito, stable per sequence across every picture of a trace).

# Explained in chapters/02_paged_blocks.ipynb
"""

from pagedlab.viz.events import describe_step
from pagedlab.viz.palette import seq_color
from pagedlab.viz.player import animate, render, static_strip
from pagedlab.viz.playground import playground
from pagedlab.viz.pool import draw_block_pool
from pagedlab.viz.queues import draw_queues
from pagedlab.viz.tables import draw_block_tables
from pagedlab.viz.timeline import draw_timeline

__all__ = [
    "animate",
    "describe_step",
    "draw_block_pool",
    "draw_block_tables",
    "draw_queues",
    "draw_timeline",
    "playground",
    "render",
    "seq_color",
    "static_strip",
]
