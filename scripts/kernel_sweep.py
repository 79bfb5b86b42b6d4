"""Compile every tile the kernel wrappers can pick, for sm_80, sm_89 and sm_90, each at its hardest (no GPU needed),
and write docs/kernels/tile_sweep.md: per kernel and target, the tiles, the most registers and shared memory, and
every variant that spills, does not fit or misses the tensor cores.

    python scripts/kernel_sweep.py [--jobs N]

CI's compile grid (tests/kernels/test_kernels_compile.py) is a sample of about 200 variants; this sweep is the
claim's proof over the wrappers' choices: about 1,500 compilations (`tile_cases` in pagedlab/kernels/aot_grid.py),
some 25 minutes or more on 2 cores with an empty Triton cache. The file records a digest of the cases it compiled
(`cases_digest`), so that a reader can tell whether it is this tree's; tests/kernels/test_kernels_compile.py checks
that the sweep takes every tile of every kernel once per target.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pagedlab.kernels.aot_grid import cases_digest, compile_grid, results_table, tile_cases

OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "kernels" / "tile_sweep.md"


def report(cases, results, seconds: float) -> str:
    import triton

    lines = [
        "# Every tile the kernel wrappers can pick, compiled for each target",
        "",
        f"Written by `python scripts/kernel_sweep.py` with triton {triton.__version__}: {len(results)} variants in "
        f"{seconds:.0f} s (a warm Triton cache skips what it holds). Cases digest: `{cases_digest(cases)}`.",
        "Each tile (dtypes, BLOCK_* sizes, warps) at its hardest case: window on, int32 indices (the wrappers'),",
        "a head dim and a group that fill it only in part where any do, then the largest head dim, group and block",
        "size.",
        "",
        results_table(results).rstrip("\n"),
    ]
    unfit = [r for r in results if r["problems"]]
    lines += ["", f"Unfit variants: {len(unfit)}."]
    lines += [f"- sm_{r['arch']} `{r['kernel']}` {r['case']} -> {r['constants']}: {'; '.join(r['problems'])}"
              for r in unfit]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="compile processes")
    args = parser.parse_args()
    cases = tile_cases()
    start = time.perf_counter()
    results = compile_grid(cases, jobs=args.jobs)
    text = report(cases, results, time.perf_counter() - start)
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(text)
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
