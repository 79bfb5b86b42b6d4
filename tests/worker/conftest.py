"""Fixtures of the worker's tests: the C++ CPU kernels' build, and the two paths of the oneDNN linear backend."""

from __future__ import annotations

import pytest

from pagedlab.worker import cpu_attention, cpu_linear


@pytest.fixture(scope="session")
def kernel():
    """The C++ CPU kernels' module (decode, prefill, fused ops); the test is skipped where they cannot be built."""
    module = cpu_attention.load().module
    if module is None:
        pytest.skip(f"the C++ kernel could not be built here: {cpu_attention.load().error}")
    return module


@pytest.fixture(params=["every product packed", "a few rows to MKL"])
def linear_path(request, monkeypatch):
    """Run a test once with every product on the packed weights and once with the rule an Intel CPU ships with (up
    to 3 rows through MKL: `cpu_linear.unpacked_wins`), whatever this machine's CPU."""
    rows = -1 if request.param == "every product packed" else cpu_linear.MKL_ROWS
    monkeypatch.setattr(cpu_linear, "UNPACKED_ROWS", rows)
    return request.param
