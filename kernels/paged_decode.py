"""Paged decode attention: one new query token per sequence attends to its whole cached context.

    out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b,   K_b, V_b read slot by slot through block_tables[b]

Reference: `pagedlab.kernels.reference.paged_decode_reference` (and `decode_attention` in
pagedlab/worker/attention.py, which the engine runs without Triton). Two versions:
  v1 `paged_decode_kernel`: one program per (sequence, KV head) walks the whole context in tiles.
  v2 split-K ("flash-decoding"): `paged_decode_split_kernel` runs one program per (sequence, KV head,
     partition of PARTITION_SIZE tokens), each writing a partial (max, sum, output); then
     `paged_decode_reduce_kernel` merges the partitions of each (sequence, query head). `use_split_k` says
     when the wrapper picks v2.

Online softmax (one pass over the keys, no [num_keys] score buffer). Softmax of scores s_1..s_n:
out = sum_j e^{s_j} v_j / sum_j e^{s_j}. Read the keys tile by tile and keep, over the keys seen so far,

    m = max_j s_j,     l = sum_j e^{s_j - m},     o = sum_j e^{s_j - m} v_j   (unnormalised output)

A new tile S raises the max to m' = max(m, max_{j in S} s_j); multiplying the old sums by alpha = e^{m - m'}
re-bases them on m', so

    l' = alpha * l + sum_{j in S} e^{s_j - m'},     o' = alpha * o + sum_{j in S} e^{s_j - m'} v_j

and at the end out = o / l. Every exponent is <= 0, so nothing overflows. The kernels fold log2(e) into the
scale and use exp2 (e^x = 2^(x log2 e)), which the GPU computes natively; m is then in log2 units.
Split-K merges partitions p with partial (m_p, l_p, out_p = o_p / l_p) the same way:

    M = max_p m_p,     out = sum_p l_p 2^(m_p - M) out_p / sum_p l_p 2^(m_p - M)

Grouped-query attention: a program owns one KV head and all GROUP = q_heads // kv_heads query heads that read
it (HF's `repeat_kv`: query head h reads KV head h // GROUP). It loads each K/V tile ONCE for the whole group
and computes the scores as one [BLOCK_G, head_dim] x [head_dim, BLOCK_N] dot, where BLOCK_G is GROUP padded to
a power of two and the padding rows are masked (9:3 -> 3 heads in 4 rows; 5:1 -> 5 in 8). Decode is
bandwidth-bound, so reading K/V once per group rather than once per query head is the point of GQA; the
masked rows cost a few idle multiplies. Head dims that are not powers of two (80, 96) are masked the same way
in a BLOCK_D padded to a power of two. Keys are gathered token by token (block_tables[pos // BLOCK_SIZE]), so
a tile of BLOCK_N keys may span several blocks and any block size 1..256 works. Only slots at valid positions
are loaded: unused slots may hold anything (the tests fill them with NaN).

Contract: every context_len >= 1 (a sequence with no key has no softmax: its output is NaN).

# Explained in chapters/03_paged_attention.ipynb
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per tile (fewer for rows of 512 bytes or more: see decode_constants)
PARTITION_SIZE = 512  # keys per split-K partition (a multiple of BLOCK_N)


@triton.jit
def load_kv_tile(
    key_cache_ptr, value_cache_ptr, block_table_ptr, tile_start, first_pos, end_pos, kv_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, KV_FP8: tl.constexpr,
):
    """The keys and values at positions tile_start .. tile_start + BLOCK_N of one sequence and KV head, read slot
    by slot through its block table: returns (positions, valid, key, value), key and value [BLOCK_N, BLOCK_D].
    Positions outside [first_pos, end_pos) and dims past HEAD_DIM are not read (their K/V load as 0). A float8
    cache (KV_FP8) is dequantised here, tile by tile: float32 values x k_scale / v_scale. Shared by the decode and
    prefill kernels (paged_prefill.py)."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    valid = (positions >= first_pos) & (positions < end_pos)
    dims = tl.arange(0, BLOCK_D)
    block_ids = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot_offsets = block_ids * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot
    kv_offsets = kv_head * stride_cache_head + slot_offsets[:, None] + dims[None, :]  # [BLOCK_N, BLOCK_D]
    kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
    key = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    value = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if KV_FP8:
        key, value = key.to(tl.float32) * k_scale, value.to(tl.float32) * v_scale
    if DOT_FP32:
        key, value = key.to(tl.float32), value.to(tl.float32)
    return positions, valid, key, value


@triton.jit
def load_kv_scales(kv_scales_ptr, KV_FP8: tl.constexpr):
    """The layer's K and V scales ([2] float32 at kv_scales_ptr) for a float8 cache; unread (1.0) otherwise."""
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(kv_scales_ptr)
        v_scale = tl.load(kv_scales_ptr + 1)
    return k_scale, v_scale


@triton.jit
def _attend_keys(
    query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr,  # this sequence's table, this query head group
    first_pos, end_pos,  # attend to keys at positions [first_pos, end_pos)
    scale_log2e, stride_query_head, stride_cache_block, stride_cache_slot, stride_cache_head, kv_head, kv_scales_ptr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax of the group's query heads over keys [first_pos, end_pos): returns (m, l, o)."""
    tl.static_assert(BLOCK_G >= GROUP, "the query head group must fit in BLOCK_G")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "the head dim must fit in BLOCK_D")
    heads = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    query = tl.load(  # [BLOCK_G, BLOCK_D]
        query_ptr + heads[:, None] * stride_query_head + dims[None, :],
        mask=(heads[:, None] < GROUP) & dim_mask[None, :], other=0.0,
    )
    if DOT_FP32:
        query = query.to(tl.float32)
    k_scale, v_scale = load_kv_scales(kv_scales_ptr, KV_FP8)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    o = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(first_pos - first_pos % BLOCK_N, end_pos, BLOCK_N):
        positions, valid, key, value = load_kv_tile(
            key_cache_ptr, value_cache_ptr, block_table_ptr, tile_start, first_pos, end_pos, kv_head,
            stride_cache_block, stride_cache_slot, stride_cache_head, k_scale, v_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, DOT_FP32, KV_FP8,
        )
        key, value = key.to(query.dtype), value.to(query.dtype)  # a no-op but for a float8 cache
        scores = tl.dot(query, tl.trans(key), input_precision="ieee") * scale_log2e  # [BLOCK_G, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: each tile holds a valid key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        o = o * alpha[:, None] + tl.dot(p.to(value.dtype), value, input_precision="ieee")
        m = m_new
    return m, l, o


@triton.jit
def paged_decode_kernel(
    out_ptr, query_ptr,  # [B, q_heads, head_dim], unit dim stride
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim], unit dim stride
    kv_scales_ptr,  # [2] float32: K and V scale of a float8 cache (read only when KV_FP8)
    block_tables_ptr, context_lens_ptr,  # [B, max_blocks], [B]
    scale_log2e, sliding_window,
    stride_out_seq, stride_out_head, stride_query_seq, stride_query_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """v1: grid (B, kv_heads)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    first_pos = tl.maximum(context_len - sliding_window, 0) if HAS_WINDOW else 0
    query_group_ptr = query_ptr + seq * stride_query_seq + kv_head * GROUP * stride_query_head
    m, l, o = _attend_keys(
        query_group_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr + seq * stride_table_seq,
        first_pos, context_len, scale_log2e, stride_query_head,
        stride_cache_block, stride_cache_slot, stride_cache_head, kv_head, kv_scales_ptr,
        GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N, DOT_FP32, KV_FP8,
    )
    heads = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    out_group_ptr = out_ptr + seq * stride_out_seq + (kv_head * GROUP + heads[:, None]) * stride_out_head
    mask = (heads[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    tl.store(out_group_ptr + dims[None, :], (o / l[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def paged_decode_split_kernel(
    partial_max_ptr, partial_sum_ptr,  # [B, q_heads, num_partitions] float32
    partial_out_ptr,  # [B, q_heads, num_partitions, head_dim] float32, contiguous
    query_ptr, key_cache_ptr, value_cache_ptr, kv_scales_ptr, block_tables_ptr, context_lens_ptr,
    scale_log2e, sliding_window,
    stride_query_seq, stride_query_head,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_table_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr, KV_FP8: tl.constexpr,
):
    """v2, pass 1: grid (B, kv_heads, num_partitions). Partitions holding no visible key write nothing."""
    tl.static_assert(PARTITION_SIZE % BLOCK_N == 0, "a key tile must not straddle two partitions")
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    num_partitions = tl.num_programs(2)
    context_len = tl.load(context_lens_ptr + seq)
    window_first = tl.maximum(context_len - sliding_window, 0) if HAS_WINDOW else 0
    first_pos = tl.maximum(partition * PARTITION_SIZE, window_first)
    end_pos = tl.minimum((partition + 1) * PARTITION_SIZE, context_len)
    query_group_ptr = query_ptr + seq * stride_query_seq + kv_head * GROUP * stride_query_head
    m, l, o = _attend_keys(
        query_group_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr + seq * stride_table_seq,
        first_pos, end_pos, scale_log2e, stride_query_head,
        stride_cache_block, stride_cache_slot, stride_cache_head, kv_head, kv_scales_ptr,
        GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N, DOT_FP32, KV_FP8,
    )
    heads = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    head_rows = (seq * tl.num_programs(1) * GROUP + kv_head * GROUP + heads) * num_partitions + partition
    if first_pos < end_pos:
        head_mask = heads < GROUP
        tl.store(partial_max_ptr + head_rows, m, mask=head_mask)
        tl.store(partial_sum_ptr + head_rows, l, mask=head_mask)
        out_mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
        tl.store(partial_out_ptr + head_rows[:, None] * HEAD_DIM + dims[None, :], o / l[:, None], mask=out_mask)


@triton.jit
def paged_decode_reduce_kernel(
    out_ptr, partial_max_ptr, partial_sum_ptr, partial_out_ptr, context_lens_ptr,
    sliding_window, num_partitions, stride_out_seq, stride_out_head,
    HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION_SIZE: tl.constexpr,
):
    """v2, pass 2: grid (B, q_heads). Merges the partitions that hold a visible key (see the module doc)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    window_first = tl.maximum(context_len - sliding_window, 0) if HAS_WINDOW else 0
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    row = (seq * tl.num_programs(1) + head) * num_partitions  # (sequence, query head) in the partial buffers
    m_total = float("-inf")
    l_total = 0.0
    o_total = tl.zeros([BLOCK_D], tl.float32)
    for partition in range(window_first // PARTITION_SIZE, tl.cdiv(context_len, PARTITION_SIZE)):
        m_p = tl.load(partial_max_ptr + row + partition)
        l_p = tl.load(partial_sum_ptr + row + partition)
        o_p = tl.load(partial_out_ptr + (row + partition) * HEAD_DIM + dims, mask=dim_mask, other=0.0)
        m_new = tl.maximum(m_total, m_p)
        alpha = tl.exp2(m_total - m_new)  # 0 on the first partition
        weight = l_p * tl.exp2(m_p - m_new)
        l_total = l_total * alpha + weight
        o_total = o_total * alpha + weight * o_p
        m_total = m_new
    out_row_ptr = out_ptr + seq * stride_out_seq + head * stride_out_head
    tl.store(out_row_ptr + dims, (o_total / l_total).to(out_ptr.dtype.element_ty), mask=dim_mask)


def use_split_k(
    batch_size: int, max_context_len: int, num_kv_heads: int = 1, num_sms: int = 132,
    partition_size: int = PARTITION_SIZE,
) -> bool:
    """Whether the wrapper runs split-K (v2) rather than one program per (sequence, KV head) (v1).

    v1 launches batch_size * num_kv_heads programs and each walks its whole context serially. When that is
    fewer programs than the GPU has SMs (132 on an H100/H200), SMs sit idle for the whole launch: few
    sequences with long contexts. v2 multiplies the programs by the number of partitions, at the price of
    writing a partial (max, sum, out) per partition and a second, small launch; that pays only if the longest
    context spans at least two partitions. So: split iff batch_size * num_kv_heads < num_sms and
    max_context_len >= 2 * partition_size.
    """
    return batch_size * num_kv_heads < num_sms and max_context_len >= 2 * partition_size


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels cast their `tl.dot` operands to float32 first: only for bfloat16 under the
    interpreter (TRITON_INTERPRET=1), whose `dot` (triton 3.9) multiplies bfloat16 bit patterns as integers.
    On a GPU, bfloat16 and float16 operands go to the tensor cores as they are, accumulating in float32."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kv_tile_bytes(dtype: torch.dtype, kv_fp8: bool) -> int:
    """Bytes a K/V tile holds per value in registers: the dtype's, or for a float8 cache the loaded byte plus the
    float32 it is dequantised into."""
    return 1 + 4 if kv_fp8 else dtype.itemsize


def decode_constants(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, has_window: bool, split_k: bool = False,
    kv_fp8: bool = False,
) -> dict:
    """The constexprs (and warps) the wrapper picks for `paged_decode_kernel` (with split_k, the split kernel):
    the query head group padded to a power of two (BLOCK_G), the head dim padded to a power of two of at least
    16 (BLOCK_D: a GPU's `tl.dot` needs K >= 16), BLOCK_N keys per tile. Compiled for sm_80/89/90
    (tests/kernels/test_kernels_compile.py, `pagedlab.kernels.aot_grid` calls this function) with 4 warps, float32
    tiles whose key rows are 512 bytes (BLOCK_D 128) spilled registers in some variants, and 64 float32 keys
    of 256 dims needed 152 KB of shared memory, more than an L4's 99 KB: so 8 warps from 512 bytes a row, and
    32 keys from there. A float8 cache's tiles are dequantised into float32 beside the float8 ones loaded (5 bytes
    a value, `kv_tile_bytes`): at head dim 256 they spilled or overflowed an L4's shared memory until cut to 16
    keys, with 4 warps (8 capped the registers at 128 and spilled).

    Rows of 512 bytes (float32 head dims 80-128, 16-bit 256) take 32 keys, not 64 (issue 31). The register
    budget: 8 warps are 256 threads, and an SM's 65,536 registers hold three such programs at 80 registers a
    thread or fewer, two at 128. 64 keys of 512-byte K and V rows are 2 * 64 * 512 / 4 / 256 = 64 registers a
    thread, and with the query, the accumulator and the addresses ptxas needed a few more than 80: it stored a
    register before the key loop and reloaded it after (8-16 bytes of local memory; 13 of 224 float32 variants
    of head dims 96 and 128 on sm_80) to stay at 80. That bought nothing: such a program's 65-78 KB of shared
    memory let only two run on an A100 anyway. With 32 keys K and V are 32 registers (39-80 in all) and 33-43 KB,
    so twice as many programs fit an SM: as many K/V bytes in flight, every key still read once (decode reads
    its context once whatever the tile), in twice as many loop steps, each cheap. No spill in the 624 float32
    and 168 16-bit variants of these rows compiled (decode and split-K, the three targets)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    row_bytes = block_d * kv_tile_bytes(dtype, kv_fp8)
    block_n = BLOCK_N if row_bytes < 512 else BLOCK_N // 2 if row_bytes <= 1024 else BLOCK_N // 4
    constants = dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, HAS_WINDOW=has_window,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_FP32=dot_in_fp32(dtype), KV_FP8=kv_fp8, num_warps=8 if 512 <= row_bytes <= 1024 else 4,
    )
    return {**constants, "PARTITION_SIZE": PARTITION_SIZE} if split_k else constants


def reduce_constants(head_dim: int, has_window: bool) -> dict:
    """The constexprs of split-K's reduce kernel."""
    return dict(HEAD_DIM=head_dim, HAS_WINDOW=has_window, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                PARTITION_SIZE=PARTITION_SIZE)


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, query: torch.Tensor, kv_scales=None) -> None:
    """Shapes, dtypes and layout shared by the decode and prefill wrappers; raises ValueError. A float8 cache
    needs `kv_scales`, its [2] float32 K and V scales on the query's device."""
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query must be float32, float16 or bfloat16, got {query.dtype}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_q_heads, head_dim = query.shape[-2:]
    num_kv_heads, cache_head_dim = key_cache.shape[2:]
    if head_dim != cache_head_dim:
        raise ValueError(f"query has head_dim {head_dim} but the cache has head_dim {cache_head_dim}")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported (one head row must fit in registers)")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    if key_cache.dtype in FP8_DTYPES and value_cache.dtype == key_cache.dtype:
        if (kv_scales is None or kv_scales.shape != (2,) or kv_scales.dtype != torch.float32
                or not kv_scales.is_contiguous()):
            raise ValueError("a float8 cache needs kv_scales: a contiguous [2] float32 tensor (K and V scale)")
        if kv_scales.device != query.device:
            raise ValueError(f"kv_scales must be on {query.device}, got {kv_scales.device}")
    elif key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"query is {query.dtype} but the caches are {key_cache.dtype} and {value_cache.dtype}")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != 1:
        raise ValueError("key_cache and value_cache must have the same strides and a unit head_dim stride")


def check_int(tensor: torch.Tensor, name: str, shape: tuple) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if tensor.dim() != len(shape) or any(want is not None and got != want for got, want in zip(tensor.shape, shape)):
        wanted = ", ".join("*" if want is None else str(want) for want in shape)
        raise ValueError(f"{name} must have shape [{wanted}], got {tuple(tensor.shape)}")


def as_index(tensor: torch.Tensor) -> torch.Tensor:
    """An index tensor (block ids, lengths, row offsets) as the kernels read it: int32 and contiguous, as vLLM's
    kernels take their block tables. Every value fits: a block id is below the pool's size, a length below
    max_model_len. One kernel variant per tile, not two: int64 tables made some tiles spill registers on sm_80
    and sm_89 (issue 31, docs/kernels/tile_sweep.md), and the engine's CUDA graphs pass int32 anyway."""
    return tensor.to(torch.int32).contiguous()  # no copy when it already is


def check_devices(**tensors: torch.Tensor) -> None:
    devices = {name: tensor.device for name, tensor in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def scratch(workspace: dict | None, name: str, shape: tuple, device, dtype=torch.float32) -> torch.Tensor:
    """An uninitialised buffer, kept in `workspace` (when given) for the next call that asks the same."""
    buffer = workspace.get(name) if workspace is not None else None
    if buffer is None or buffer.shape != shape or buffer.dtype != dtype or buffer.device != torch.device(device):
        buffer = torch.empty(shape, dtype=dtype, device=device)
        if workspace is not None:
            workspace[name] = buffer
    return buffer


def paged_decode(
    query: torch.Tensor,  # [B, q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int (read as int32: `as_index`)
    context_lens: torch.Tensor,  # [B] int, 1 <= context_lens[b] <= max_blocks * block_size
    scale: float | None = None,
    sliding_window: int | None = None,
    *,
    split_k: bool | None = None,  # None: decided by `use_split_k`
    out: torch.Tensor | None = None,  # [B, q_heads, head_dim], written in place
    workspace: dict | None = None,  # split-K's partial results live here, reused by every call of a step
    kv_scales: torch.Tensor | None = None,  # [2] float32 K and V scales, for a float8 cache only
) -> torch.Tensor:
    """Decode attention through the block tables; returns `out` ([B, q_heads, head_dim], query's dtype).

    The longest context is bounded by max_blocks * block_size (no device-to-host sync to find it).
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [batch, q_heads, head_dim], got {tuple(query.shape)}")
    check_cache(key_cache, value_cache, query, kv_scales)
    kv_fp8 = key_cache.dtype in FP8_DTYPES
    kv_scales = kv_scales if kv_fp8 else query  # any pointer: unread
    batch_size, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    check_int(block_tables, "block_tables", (batch_size, None))
    check_int(context_lens, "context_lens", (batch_size,))
    check_devices(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                  context_lens=context_lens)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be a {query.dtype} tensor of shape {tuple(query.shape)} with unit last stride")
    if batch_size == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    block_tables, context_lens = as_index(block_tables), as_index(context_lens)

    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    max_context_len = block_tables.shape[1] * block_size
    if split_k is None:
        split_k = use_split_k(batch_size, max_context_len, num_kv_heads, _num_sms(query.device))
    has_window = sliding_window is not None
    constants = decode_constants(query.dtype, group, head_dim, block_size, has_window, kv_fp8=kv_fp8)
    cache_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0))
    scale_log2e = scale * math.log2(math.e)
    window = sliding_window or 0  # ignored unless HAS_WINDOW
    if not split_k:
        paged_decode_kernel[(batch_size, num_kv_heads)](
            out, query, key_cache, value_cache, kv_scales, block_tables, context_lens, scale_log2e, window,
            out.stride(0), out.stride(1), query.stride(0), query.stride(1), *cache_strides, **constants,
        )
        return out

    num_partitions = triton.cdiv(max_context_len, PARTITION_SIZE)
    shape = (batch_size, num_q_heads, num_partitions)
    partial_max = scratch(workspace, "split_k_max", shape, query.device)
    partial_sum = scratch(workspace, "split_k_sum", shape, query.device)
    partial_out = scratch(workspace, "split_k_out", (*shape, head_dim), query.device)
    paged_decode_split_kernel[(batch_size, num_kv_heads, num_partitions)](
        partial_max, partial_sum, partial_out, query, key_cache, value_cache, kv_scales, block_tables, context_lens,
        scale_log2e, window, query.stride(0), query.stride(1), *cache_strides,
        **decode_constants(query.dtype, group, head_dim, block_size, has_window, split_k=True, kv_fp8=kv_fp8),
    )
    paged_decode_reduce_kernel[(batch_size, num_q_heads)](
        out, partial_max, partial_sum, partial_out, context_lens, window, num_partitions,
        out.stride(0), out.stride(1), **reduce_constants(head_dim, has_window),
    )
    return out
