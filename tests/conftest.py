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
# chapter is minutes of work, and so is the Triton interpreter's grid. Every other file runs on one worker, its
# module fixtures (servers, models, the compiled kernel grid) set up once.
SPREAD = ("tests/browser/test_chapters_in_browser.py::test_chapter_runs", "tests/kernels/test_kernels.py::")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (float32) and its tokenizer, loaded once."""
    from pagedlab.models import load_model

    return load_model(None, None, torch.float32, torch.device("cpu"))


def pytest_collection_modifyitems(config, items):
    """Tests that load the embedded SmolLM2 are slow (`make test-fast` leaves them out). For `--dist loadgroup`:
    each file is one group but for SPREAD; the chapters go first (in the browser or nbval), then the slow tests,
    so that no worker is left with a long test at the end while the others idle. A stable sort: files keep their
    own order."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if not item.nodeid.startswith(SPREAD):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=lambda item: (not _runs_a_chapter(item), item.get_closest_marker("slow") is None))


def _runs_a_chapter(item) -> bool:
    return item.get_closest_marker("browser") is not None or item.path.suffix == ".ipynb"  # the browser or nbval
