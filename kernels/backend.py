"""The Triton attention backend: the body of `paged_attention_forward` (pagedlab/worker/attention.py), kernels
instead of torch, with exactly the same contract.

    triton_attention(q, k, v, key_cache, value_cache, metadata, scale, sliding_window) -> out

stores the step's new K/V at `metadata.slot_mapping` (store_kv), runs the decode kernel on the first
`metadata.num_decodes` rows and the prefill kernel on the `metadata.prefills` chunks, whose rows follow the
decodes back to back (the flat batch drawn at the top of attention.py).

# Explained in chapters/03_paged_attention.ipynb
"""

from __future__ import annotations

import torch

from .paged_decode import as_index, paged_decode, scratch
from .paged_prefill import paged_prefill
from .store_kv import store_kv


def triton_attention(
    q: torch.Tensor,  # [num_tokens, q_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], written in place
    value_cache: torch.Tensor,
    metadata,  # pagedlab.worker.attention.AttentionMetadata
    scale: float | None,
    sliding_window: int | None,
    kv_scales: torch.Tensor | None = None,  # [2] float32 K and V scales of a float8 cache
) -> torch.Tensor:
    """Returns out [num_tokens, q_heads, head_dim], like the torch path (rows outside every chunk and past the
    decodes are left uninitialised, as there)."""
    store_kv(k, v, key_cache, value_cache, metadata.slot_mapping, kv_scales)
    # One output buffer for every layer of the step: layer l's output is read (by its o_proj) before layer
    # l + 1 writes, in stream order. Likewise split-K's partials. Nothing is allocated per layer.
    workspace = metadata.kernel_inputs
    out = scratch(workspace, "out", tuple(q.shape), q.device, q.dtype)
    num_decodes = metadata.num_decodes
    if num_decodes:
        decode = workspace.get("decode")  # the eager step's int64 tables as int32, once per step, not per layer
        if decode is None:
            decode = workspace["decode"] = (as_index(metadata.decode_block_tables),
                                            as_index(metadata.decode_context_lens))
        paged_decode(
            q[:num_decodes], key_cache, value_cache, *decode, scale, sliding_window, out=out[:num_decodes],
            workspace=workspace, kv_scales=kv_scales,
        )
    if metadata.prefills:
        inputs = workspace.get("prefill")  # the step's dense chunk tensors as int32, once per step, not per layer
        if inputs is None:
            tensors = metadata.prefill_tensors(q.device)
            inputs = workspace["prefill"] = (as_index(tensors.query_start_loc), as_index(tensors.num_context),
                                             as_index(tensors.block_tables), tensors.max_num_new)
        query_start_loc, num_context, block_tables, max_num_new = inputs
        paged_prefill(
            q, key_cache, value_cache, query_start_loc, num_context, block_tables, scale, sliding_window,
            max_num_new=max_num_new, out=out, kv_scales=kv_scales,
        )
    return out
