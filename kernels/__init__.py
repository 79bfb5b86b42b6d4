"""Triton kernels for paged attention and the KV store, installed as `pagedlab.kernels`.

Each kernel sits beside the torch reference it must agree with (`reference.py`, and the engine's own torch
path in `pagedlab.worker.attention`). Triton is optional: without it (no Linux wheel, e.g. on macOS) pagedlab
runs on its torch backend; this file never imports triton. Files and versions (llm.c's dev/cuda habit):

    reference.py      torch references that read only valid context tokens (the ground truth of the tests)
    store_kv.py       store_kv:      v1 one program per token; a negative slot means "skip"
    paged_decode.py   paged_decode:  v1 one program per (sequence, KV head) over the whole context
                                     v2 split-K / flash-decoding: partitions + a reduce kernel (`use_split_k`)
    paged_prefill.py  paged_prefill: v1 one program per (query tile, sequence, KV head), ragged chunks
    backend.py        triton_attention: the body of `paged_attention_forward`, on these kernels
    aot.py            compile_for_target: one kernel compiled for sm_80/89/90 without a GPU, and its resources
    aot_grid.py       the variants the wrappers can pick, all compiled (tests/kernels/test_kernels_compile.py)

Checked by tests/kernels/test_kernels.py (on a CPU in Triton's interpreter), tests/kernels/test_kernels_compile.py
(compiled for real GPU targets, on a CPU) and scripts/gpu_check.py (GPU grid and decode benchmark; not run yet).

# Explained in chapters/03_paged_attention.ipynb
"""

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None
