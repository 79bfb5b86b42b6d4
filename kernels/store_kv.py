"""Store the new tokens' K and V in the paged cache: one program per token, one row of every KV head.

`slot_mapping[t]` is the flat slot (block_id * block_size + offset) of token t. A NEGATIVE slot means "skip
this token" (a padded row, e.g. of a CUDA-graph batch padded to a fixed size): it is the one place pagedlab
uses a negative value as a marker, because a kernel needs one dense int tensor, not a list of optionals.

Reference: `pagedlab.kernels.reference.store_kv_reference`. Same as nano-vllm's `store_kvcache_kernel`, plus
the skip and strided inputs (Hugging Face hands K and V over as transposed views).

# Explained in chapters/03_paged_attention.ipynb
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_decode import FP8_DTYPES


@triton.jit
def store_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, kv_heads, head_dim], any token and head strides, unit dim stride
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    slot_mapping_ptr,  # [num_tokens]
    key_stride_token, key_stride_head, value_stride_token, value_stride_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tl.static_assert(BLOCK_H >= NUM_KV_HEADS and BLOCK_D >= HEAD_DIM)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
        value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=mask)
        slot_row = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims  # contiguous cache
        tl.store(key_cache_ptr + slot_row, key, mask=mask)
        tl.store(value_cache_ptr + slot_row, value, mask=mask)


def store_kv_constants(num_kv_heads: int, head_dim: int) -> dict:
    """The kernel's constexprs for a cache of num_kv_heads x head_dim: the wrapper's only choice (also what
    `pagedlab.kernels.aot_grid` compiles for GPU targets)."""
    return dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def store_kv(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """key/value [num_tokens, kv_heads, head_dim] -> their slots of key_cache/value_cache (in place). A float8
    cache gets K / kv_scales[0] and V / kv_scales[1], saturated, quantised by torch (Triton 3.9's interpreter
    rounds float32 -> float8 wrongly at binade edges: 120 -> 64) and stored by the kernel as bytes."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, kv_heads, head_dim], got {key.shape}, {value.shape}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"caches must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the key and value caches must be contiguous")
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype.is_floating_point:
        raise ValueError(f"slot_mapping must be an int tensor of shape [{num_tokens}], got {slot_mapping.shape}")
    if key_cache.dtype in FP8_DTYPES and value_cache.dtype == key_cache.dtype:
        if kv_scales is None or kv_scales.shape != (2,) or kv_scales.dtype != torch.float32:
            raise ValueError("a float8 cache needs kv_scales: a [2] float32 tensor (K and V scale)")
        limit = torch.finfo(key_cache.dtype).max
        key = (key.float() / kv_scales[0]).clamp_(-limit, limit).to(key_cache.dtype).view(torch.uint8)
        value = (value.float() / kv_scales[1]).clamp_(-limit, limit).to(value_cache.dtype).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        raise ValueError(f"key/value are {key.dtype}/{value.dtype} but the caches hold {key_cache.dtype}")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if num_tokens == 0:
        return
    store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), **store_kv_constants(num_kv_heads, head_dim),
    )
