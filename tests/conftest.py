"""Fixtures and hooks: the embedded SmolLM2, loaded once, the slow marker on the tests that use it, and the order and
grouping of tests across pytest-xdist's workers (`make test` runs `-n`). The helpers the tests share are in
tests/helpers.py."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU; set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# Under pytest-xdist each worker takes its share of the cores, and so do the processes it starts (tensor-parallel
# ranks, Jupyter kernels, compile workers): OpenMP pools as wide as the machine in every worker would fight over it.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# Files whose tests share nothing costly (no module fixture), so that xdist may spread them over its workers: each
# chapter is minutes of work, and so is the Triton interpreter's grid. Every other file runs whole on one worker.
SPREAD = ("tests/browser/test_chapters_in_browser.py::test_chapter_runs", "tests/kernels/test_kernels.py::")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (float32) and its tokenizer, loaded once."""
    from pagedlab.models import load_model

    return load_model(None, None, torch.float32, torch.device("cpu"))


def unit(nodeid: str) -> str:
    """The share of work one xdist worker takes whole: a test of SPREAD, else its file."""
    return nodeid if nodeid.startswith(SPREAD) else nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)  # xdist's hook: pytest without xdist (-p no:xdist) ignores it
def pytest_xdist_make_scheduler(config, log):
    """Under `make test` (pytest-xdist's -n): each worker takes whole units (`unit`) in the order collected here,
    so a file's module fixtures (servers, models, the compiled kernel grid) are set up once. (xdist's own
    `--dist loadgroup` marks do not reach its scheduler with this pytest, and `--dist loadscope` reorders the units
    by their number of tests, which would put the chapters last.)"""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(nodeid)

    config.option.loadscopereorder = False
    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Tests that load the embedded SmolLM2 are slow (`make test-fast` leaves them out). For the workers: units that
    run a chapter (in the browser or nbval) go first, then units with a slow test, so that no worker is left with a
    long unit at the end while the other idles. A stable sort: each unit keeps its own order."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    chapter, slow = set(), set()
    for item in items:
        if _runs_a_chapter(item):
            chapter.add(unit(item.nodeid))
        if item.get_closest_marker("slow") is not None:
            slow.add(unit(item.nodeid))
    items.sort(key=lambda item: (unit(item.nodeid) not in chapter, unit(item.nodeid) not in slow))


def _runs_a_chapter(item) -> bool:
    return item.get_closest_marker("browser") is not None or item.path.suffix == ".ipynb"  # the browser or nbval
