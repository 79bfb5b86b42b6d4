"""How long one player frame takes to draw and encode as PNG: the number behind "a frame must draw fast".

    python scripts/viz_frame_bench.py [--repeats 20]

Prints, for pools of 64 and 1,000 blocks, the median and range of the CPU time of `to_png(render(trace, 0))`
over the repeats, after one warm-up frame (font caches). tests/viz checks what makes it fast (one collection per
kind of cell), not the time, which depends on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedlab.bench.report import cpu_model
from pagedlab.core.trace import BlockTableSnapshot, StepRecord, Trace
from pagedlab.viz import render
from pagedlab.viz._common import to_png


def trace_of(num_blocks: int, num_requests: int, blocks_each: int, block_size: int) -> Trace:
    tables = [BlockTableSnapshot(f"r{i}", tuple(range(i * blocks_each, (i + 1) * blocks_each)),
                                 blocks_each * block_size - 1) for i in range(num_requests)]
    record = StepRecord(step=1, scheduled=(), allocated=(), freed=(), preempted=(), appended=(), finished=(),
                        block_tables=tuple(tables), waiting=(), running=tuple(t.request_id for t in tables),
                        num_free_blocks=num_blocks - num_requests * blocks_each)
    return Trace(num_blocks, block_size, steps=[record])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; {args.repeats} frames each, CPU seconds")
    print(f"{'blocks':>7} {'median':>8} {'min':>8} {'max':>8}")
    for num_blocks, num_requests, blocks_each, block_size in [(64, 6, 7, 4), (1000, 20, 40, 16)]:
        trace = trace_of(num_blocks, num_requests, blocks_each, block_size)
        to_png(render(trace, 0))  # warm the font caches
        times = []
        for _ in range(args.repeats):
            start = time.process_time()
            to_png(render(trace, 0))
            times.append(time.process_time() - start)
        print(f"{num_blocks:>7} {statistics.median(times):>8.3f} {min(times):>8.3f} {max(times):>8.3f}")


if __name__ == "__main__":
    main()
