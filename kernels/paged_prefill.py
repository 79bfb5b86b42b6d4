"""Paged prefill attention: a ragged batch of query chunks, each attending causally to its cached context and
to itself, all read through the block tables (the chunks' own K/V are already in the cache).

    rows of query:  [ chunk 0 (n0 rows) | chunk 1 (n1 rows) | ... ]      query_start_loc = [s0, s1, s2, ...]
    chunk c, row i: position num_context[c] + i; sees keys 0 .. num_context[c] + i of sequence c
                    (and only the last `sliding_window` of them: q - k < window)

Reference: `pagedlab.kernels.reference.paged_prefill_reference` (and `prefill_attention` in
pagedlab/worker/attention.py). Version v1: one program per (query tile, sequence, KV head).

A program's tile packs BLOCK_Q consecutive query tokens times the GROUP query heads that share its KV head
(padded to BLOCK_G, a power of two) into BLOCK_M = BLOCK_Q * BLOCK_G rows, row r = token r // BLOCK_G, head
r % BLOCK_G, as vLLM's unified Triton attention does: each K/V tile is loaded once for the whole group, and
the scores are one [BLOCK_M, head_dim] x [head_dim, BLOCK_N] dot. It walks its keys with the online softmax
derived in `paged_decode.py`; here a row may find no visible key in a tile (causal or window mask), so the
running max can still be -inf and is replaced by 0 in the exponents (alpha = 2^(-inf) = 0 then, as wanted).
Only keys up to the tile's last query position are read. Dim 0 of the grid covers the longest chunk, so the
tiles of shorter chunks that fall past their end do nothing.

# Explained in chapters/03_paged_attention.ipynb
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .paged_decode import (
    FP8_DTYPES,
    as_index,
    check_cache,
    check_devices,
    check_int,
    dot_in_fp32,
    kv_tile_bytes,
    load_kv_scales,
    load_kv_tile,
)


def tile_sizes(dtype: torch.dtype, block_d: int, kv_fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M query rows, BLOCK_N keys, warps) per tile: smaller for float32, whose exact ("ieee") dot runs
    on FMA units, not tensor cores, and with 64 x 64 tiles needs 115 KB of shared memory (and 10 s to compile).
    Compiled for sm_80/89/90 (tests/kernels/test_kernels_compile.py) with 4 warps and 64 keys, tiles whose head
    rows are 256 bytes or more (16-bit BLOCK_D 128, float32 64) spilled registers in some variants, and float32 at
    head dim 256 fits an L4's 99 KB of shared memory only with 16 keys per tile. A float8 cache's K/V rows count
    5 bytes a value (`kv_tile_bytes`: the loaded byte and its float32 dequantisation), and its query tile is
    halved: with 64 16-bit rows its head dim 256 variants spilled up to 3 KB a thread on sm_89 and sm_90.

    16-bit head dims 80-128 (64 x 128 tiles) take 32 keys and 4 warps (issue 31), by the register budget. With 8
    warps (256 threads) two programs fit an SM's 65,536 registers at 128 a thread, and this tile needs more: the
    float32 accumulator and the query alone are 64 * 128 * (4 + 2) / 4 / 256 = 48 registers, the scores and
    probabilities 24, K and V 32, then the addresses. ptxas either took 145-214 registers (one program an SM) or
    squeezed into 128 by storing registers before the key loop and reloading them after (8-24 bytes of local
    memory: 12 of 32 sampled float16 variants on sm_80, the int32 tables the engine passes among them); 32 keys
    still needed 128 with spills. With 4 warps a thread may use 255 registers with two programs an SM, and this
    tile takes 165-251 on sm_80 and sm_89, 116-190 on sm_90. Of 504 float16 and bfloat16 variants compiled, 3
    still store 8 bytes, to stay at 168 (three programs an SM): on sm_80, with a window and int64 tables (the
    engine's prefill passes int32), group 8 at head dim 128 and block size 16 (both dtypes), group 16 at head
    dim 96 and block size 64 (float16). It is not slower in principle: the same 64 query rows per tile (so the same
    K/V reads), each warp owns 16 whole rows (the row maxima and sums need no exchange between warps; on sm_90 a
    warpgroup of 4 is one 64-row wgmma), and 8 or 12 warps an SM where the 8-warp tile had 8 (16 where it
    spilled); the price is an online-softmax rescale of the accumulator every 32 keys, not 64.

    Issue 31's sweep of every tile at block size 256 with a window (docs/kernels/tile_sweep.md) moved three more:
    tiles take 32 keys, not 64, where rows are under 256 bytes (with 64, ptxas stored 8-16 bytes a thread on sm_89
    at head dim 32, float32 and 16-bit alike; with 32 they take 72-80 registers and store none); float32 rows of
    256 bytes (head dims 33-64) 32 keys with 8 warps (with 64 keys every group spilled on sm_80, with 4 warps every
    one of 24 sampled variants on all three targets); float32 rows of 512 bytes (head dims 65-128) 16 keys (with 32,
    8-24 bytes on sm_80 and sm_89; with 4 warps 72). Float32 attention on a GPU is the learning case, not the
    fast one."""
    block_m = (64 if dtype.itemsize == 2 else 32) // (2 if kv_fp8 else 1)
    row_bytes = block_d * kv_tile_bytes(dtype, kv_fp8)
    if block_m == 64 and block_d == 128:  # 16-bit, head dims 80-128: see above
        return block_m, 32, 4
    if dtype == torch.float32 and block_d == 128:
        return block_m, 16, 8
    block_n = 32 if row_bytes <= 512 else 16
    return block_m, block_n, 8 if row_bytes >= 256 else 4


def prefill_constants(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, has_window: bool, kv_fp8: bool = False
) -> dict:
    """The constexprs (and warps) the wrapper picks for `paged_prefill_kernel`: BLOCK_G and BLOCK_D padded as in
    decode, the tile from `tile_sizes`, BLOCK_Q = query tokens per tile (BLOCK_M // BLOCK_G, at least 1). Also what
    `pagedlab.kernels.aot_grid` compiles for GPU targets."""
    block_g = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps = tile_sizes(dtype, block_d, kv_fp8)
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, HAS_WINDOW=has_window, BLOCK_G=block_g,
                BLOCK_Q=max(1, block_m // block_g), BLOCK_D=block_d, BLOCK_N=block_n, DOT_FP32=dot_in_fp32(dtype),
                KV_FP8=kv_fp8, num_warps=num_warps)


@triton.jit
def paged_prefill_kernel(
    out_ptr, query_ptr,  # [num_tokens, q_heads, head_dim], unit dim stride
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim], unit dim stride
    kv_scales_ptr,  # [2] float32: K and V scale of a float8 cache (read only when KV_FP8)
    block_tables_ptr, query_start_loc_ptr, num_context_ptr,  # [num_seqs, max_blocks], [num_seqs + 1], [num_seqs]
    scale_log2e, sliding_window,
    stride_out_token, stride_out_head, stride_query_token, stride_query_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid (cdiv(longest chunk, BLOCK_Q), num_seqs, kv_heads)."""
    tl.static_assert(BLOCK_G >= GROUP, "the query head group must fit in BLOCK_G")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "the head dim must fit in BLOCK_D")
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    first_row = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - first_row
    num_cached = tl.load(num_context_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * BLOCK_G)  # BLOCK_M rows
    tokens = tile * BLOCK_Q + rows // BLOCK_G  # index in the chunk
    heads = kv_head * GROUP + rows % BLOCK_G  # query head
    row_mask = (tokens < num_new) & (rows % BLOCK_G < GROUP)
    query_pos = num_cached + tokens  # [BLOCK_M] position in the sequence
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    query_rows = (first_row + tokens)[:, None] * stride_query_token + heads[:, None] * stride_query_head
    query = tl.load(query_ptr + query_rows + dims[None, :], mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_FP32:
        query = query.to(tl.float32)

    # keys [first_pos, end_pos): up to the tile's last query, from its first query's window start
    first_token = tile * BLOCK_Q
    end_pos = tl.where(first_token < num_new, num_cached + tl.minimum(first_token + BLOCK_Q, num_new), 0)
    first_pos = tl.maximum(num_cached + first_token - sliding_window + 1, 0) if HAS_WINDOW else 0
    block_table_ptr = block_tables_ptr + seq * stride_table_seq
    k_scale, v_scale = load_kv_scales(kv_scales_ptr, KV_FP8)
    m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    o = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(first_pos - first_pos % BLOCK_N, end_pos, BLOCK_N):
        key_pos, valid, key, value = load_kv_tile(
            key_cache_ptr, value_cache_ptr, block_table_ptr, tile_start, first_pos, end_pos, kv_head,
            stride_cache_block, stride_cache_slot, stride_cache_head, k_scale, v_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, DOT_FP32, KV_FP8,
        )
        key, value = key.to(query.dtype), value.to(query.dtype)  # a no-op but for a float8 cache
        visible = valid[None, :] & (key_pos[None, :] <= query_pos[:, None])  # [BLOCK_M, BLOCK_N]
        if HAS_WINDOW:
            visible = visible & (query_pos[:, None] - key_pos[None, :] < sliding_window)
        scores = tl.dot(query, tl.trans(key), input_precision="ieee") * scale_log2e
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        o = o * alpha[:, None] + tl.dot(p.to(value.dtype), value, input_precision="ieee")
        m = m_new

    out_rows = (first_row + tokens)[:, None] * stride_out_token + heads[:, None] * stride_out_head
    out = o / tl.where(l > 0, l, 1.0)[:, None]  # l == 0 only in rows past the chunk's end, not stored
    tl.store(out_ptr + out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], the chunks' K/V already stored
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int, non-decreasing: chunk s is rows [loc[s], loc[s+1])
    num_context: torch.Tensor,  # [num_seqs] int: tokens cached before each chunk
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int, covering num_context + chunk length tokens
    scale: float | None = None,
    sliding_window: int | None = None,
    *,
    max_num_new: int | None = None,  # the longest chunk; computed (a device sync) when None
    out: torch.Tensor | None = None,  # [num_tokens, q_heads, head_dim]; rows outside every chunk untouched
    kv_scales: torch.Tensor | None = None,  # [2] float32 K and V scales, for a float8 cache only
) -> torch.Tensor:
    """Causal attention of each chunk over its context and itself; returns `out`."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, q_heads, head_dim], got {tuple(query.shape)}")
    check_cache(key_cache, value_cache, query, kv_scales)
    kv_fp8 = key_cache.dtype in FP8_DTYPES
    kv_scales = kv_scales if kv_fp8 else query  # any pointer: unread
    num_seqs = num_context.shape[0] if num_context.dim() == 1 else -1
    check_int(num_context, "num_context", (None,))
    check_int(query_start_loc, "query_start_loc", (num_seqs + 1,))
    check_int(block_tables, "block_tables", (num_seqs, None))
    check_devices(query=query, key_cache=key_cache, value_cache=value_cache, query_start_loc=query_start_loc,
                  num_context=num_context, block_tables=block_tables)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be a {query.dtype} tensor of shape {tuple(query.shape)} with unit last stride")
    if max_num_new is None:
        max_num_new = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if num_seqs == 0 or max_num_new == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    block_tables, query_start_loc, num_context = map(as_index, (block_tables, query_start_loc, num_context))

    num_q_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    constants = prefill_constants(query.dtype, num_q_heads // num_kv_heads, head_dim, block_size,
                                  sliding_window is not None, kv_fp8)
    scale = head_dim**-0.5 if scale is None else scale
    grid = (triton.cdiv(max_num_new, constants["BLOCK_Q"]), num_seqs, num_kv_heads)
    paged_prefill_kernel[grid](
        out, query, key_cache, value_cache, kv_scales, block_tables, query_start_loc, num_context,
        scale * math.log2(math.e), sliding_window or 0,  # the window is ignored unless HAS_WINDOW
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0), **constants,
    )
    return out
