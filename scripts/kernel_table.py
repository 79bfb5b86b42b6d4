"""Compile every Triton kernel for sm_80, sm_89 and sm_90 on this machine (no GPU needed) and print the
README's kernel table: per kernel and target, the most shared memory and registers over the variants the
wrappers can pick, the warps, spills, and the 16-bit dots' tensor-core instructions.

    python scripts/kernel_table.py [--write-readme] [--jobs N]

--write-readme replaces the table between `<!-- kernel-table -->` and `<!-- /kernel-table -->` in README.md,
which tests/kernels/test_kernels_compile.py compares with what the same grid compiles to (with the same Triton).
About 2 minutes on 2 cores with an empty Triton cache; seconds once cached.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from pagedlab.kernels.aot_grid import compile_grid, grid_cases, markdown_table

README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-readme", action="store_true", help="put the table into README.md")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="compile processes")
    args = parser.parse_args()
    cases = grid_cases()
    start = time.perf_counter()
    results = compile_grid(cases, jobs=args.jobs)
    print(f"compiled {len(results)} variants in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    table = markdown_table(results)
    print(table)
    unfit = [r for r in results if r["problems"]]
    for r in unfit:
        print(f"sm_{r['arch']} {r['kernel']} {r['case']}: {'; '.join(r['problems'])}", file=sys.stderr)
    if args.write_readme:
        text = README.read_text()
        block = re.compile(r"(<!-- kernel-table -->\n).*?(<!-- /kernel-table -->)", re.S)
        if not block.search(text):
            print("README.md has no <!-- kernel-table --> ... <!-- /kernel-table --> block", file=sys.stderr)
            return 2
        README.write_text(block.sub(lambda m: m.group(1) + table + m.group(2), text))
        print(f"table written to {README}", file=sys.stderr)
    return 1 if unfit else 0


if __name__ == "__main__":
    sys.exit(main())
