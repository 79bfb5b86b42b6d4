"""Triton kernels for paged attention and the KV store, installed as `pagedlab.kernels`.

Each kernel sits beside the torch reference it must agree with (`pagedlab.worker.attention`). Triton is
optional: without it (no Linux wheel, e.g. on macOS) pagedlab runs on its torch backend.

# Explained in chapters/03_paged_attention.ipynb
"""

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None
