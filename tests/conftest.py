"""Fixtures and hooks: the embedded SmolLM2, loaded once, and the slow marker on the tests that use it. The helpers
the tests share are in tests/helpers.py."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU; set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (float32) and its tokenizer, loaded once."""
    from pagedlab.models import load_model

    return load_model(None, None, torch.float32, torch.device("cpu"))


def pytest_collection_modifyitems(config, items):
    """Tests that load the embedded SmolLM2 are slow (`make test-fast` leaves them out)."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
