"""Torch references for the kernels: slow, per-sequence, and reading ONLY the valid tokens of each context.

Each function gathers a sequence's keys and values slot by slot (slot = block_id * block_size + offset) for
the positions it may attend to, and nothing else, so a test may fill every other slot with NaN: a kernel that
reads past a sequence's end, outside its sliding window or into another sequence's block shows as NaN.
Softmax is computed in float64 and the result cast back to the query's dtype.

Conventions shared with `pagedlab.worker.attention` and Hugging Face:
  * grouped-query attention: query head h reads KV head h // (q_heads // kv_heads) (`repeat_kv`);
  * sliding window: a query at position q sees the keys at positions k with q - k < window.

# Explained in chapters/03_paged_attention.ipynb
"""

from __future__ import annotations

import torch


def _context(cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The cache rows at logical `positions` of one sequence: [len(positions), kv_heads, head_dim]."""
    block_size = cache.shape[1]
    slots = block_table.long()[positions // block_size] * block_size + positions % block_size
    return cache.reshape(-1, *cache.shape[2:])[slots]


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float):
    """query [n, q_heads, D], keys/values [k, kv_heads, D], visible [n, k] bool -> [n, q_heads, D] float64."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [k, q_heads, D]: q head h reads KV head h // group
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", query.double(), k) * scale  # [q_heads, n, k]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(dim=-1), v)


def paged_decode_reference(
    query: torch.Tensor,  # [B, q_heads, D]: the newest token of each sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B] tokens in the cache, the query's own included
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Each query token attends to its sequence's whole context (or its last `sliding_window` keys)."""
    out = torch.empty_like(query)
    for b, length in enumerate(context_lens.tolist()):
        first = 0 if sliding_window is None else max(0, length - sliding_window)
        positions = torch.arange(first, length, device=query.device)
        keys = _context(key_cache, block_tables[b], positions)
        values = _context(value_cache, block_tables[b], positions)
        visible = torch.ones(1, len(positions), dtype=torch.bool, device=query.device)
        out[b] = _attend(query[b : b + 1], keys, values, visible, scale)[0].to(query.dtype)
    return out


def paged_prefill_reference(
    query: torch.Tensor,  # [num_tokens, q_heads, D]: flat rows of all chunks
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D], new tokens already stored
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1]: chunk s is rows [query_start_loc[s], query_start_loc[s+1])
    num_context: torch.Tensor,  # [num_seqs]: tokens cached before each chunk
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Chunk rows attend causally to their context and to their own chunk. Rows outside every chunk are 0."""
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for s, num_cached in enumerate(num_context.tolist()):
        start, end = starts[s], starts[s + 1]
        q_pos = torch.arange(num_cached, num_cached + end - start, device=query.device)
        first = 0 if sliding_window is None else max(0, num_cached - sliding_window + 1)
        k_pos = torch.arange(first, num_cached + end - start, device=query.device)
        keys = _context(key_cache, block_tables[s], k_pos)
        values = _context(value_cache, block_tables[s], k_pos)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
        out[start:end] = _attend(query[start:end], keys, values, visible, scale).to(query.dtype)
    return out


def store_kv_reference(
    key: torch.Tensor,  # [num_tokens, kv_heads, D]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D], written in place
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; a negative slot means "skip this token" (padding)
) -> None:
    """Write each token's K and V at its flat slot, skipping the tokens whose slot is negative."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep]
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep]
