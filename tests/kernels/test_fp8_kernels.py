"""The Triton kernels on an FP8 KV cache, in Triton's interpreter (CPU): store_kv quantises exactly as the torch
path does, and decode (v1 and split-K) and prefill-with-context dequantise tile by tile to what the torch
reference computes over the same float8 blocks; the engine on the Triton backend gives the torch backend's tokens.

Triton 3.9's interpreter reads float8 correctly but rounds float32 -> float8 wrongly at binade edges, so store_kv
quantises in torch and the kernel stores bytes. The float8 variants are not in the sm_80/89/90 compile grid
(kernels/aot_grid.py) and have not run on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedlab.kernels.paged_decode import paged_decode
from pagedlab.kernels.paged_prefill import paged_prefill
from pagedlab.kernels.store_kv import store_kv
from pagedlab.worker.attention import (
    AttentionMetadata,
    PrefillChunk,
    decode_attention,
    prefill_attention,
    write_to_cache,
)
from tests.helpers import random_prompts, tiny_model

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [16, 256])  # 256: the smallest tiles (16 keys, kv_tile_bytes)
def test_kernels_equal_the_torch_path_on_fp8_blocks(dtype, qdtype, head_dim):
    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads = 10, 4, 2
    key = (torch.randn(12, kv_heads, head_dim, generator=generator) * 3).to(qdtype)
    value = torch.randn(12, kv_heads, head_dim, generator=generator).to(qdtype)
    key[0, 0, 0] = 1e6  # saturates
    scales = torch.tensor([0.02, 0.5])
    slots = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, -1])  # the last token skipped
    by_kernel = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    by_torch = by_kernel.clone()
    store_kv(key, value, by_kernel[0], by_kernel[1], slots, scales)
    write_to_cache(key[:11], value[:11], by_torch[0], by_torch[1], slots[:11], scales[0], scales[1])
    assert torch.equal(by_kernel.view(torch.uint8), by_torch.view(torch.uint8))
    key_cache, value_cache = by_kernel

    scale = head_dim**-0.5  # as a model's
    query = torch.randn(2, 4, head_dim, generator=generator).to(qdtype)
    tables, lens = torch.tensor([[1, 2, 3], [2, 3, 0]]), torch.tensor([11, 6])
    metadata = AttentionMetadata(torch.zeros(0, dtype=torch.long), 2, tables, lens, [])
    expected = decode_attention(query, key_cache, value_cache, metadata, scale, None, scales[0], scales[1])
    for split_k in (False, True):
        got = paged_decode(query, key_cache, value_cache, tables, lens, scale, None, split_k=split_k, kv_scales=scales)
        torch.testing.assert_close(got, expected, **TOL[qdtype])

    query = torch.randn(3, 4, head_dim, generator=generator).to(qdtype)  # tokens 8..10 after 8 cached
    chunk = PrefillChunk(0, 3, 8, torch.tensor([1, 2, 3]))
    expected = prefill_attention(query, key[8:11], value[8:11], key_cache, value_cache, chunk, scale, None,
                                 scales[0], scales[1])
    got = paged_prefill(query, key_cache, value_cache, torch.tensor([0, 3]), torch.tensor([8]), tables[:1], scale,
                        kv_scales=scales)
    torch.testing.assert_close(got, expected, **TOL[qdtype])


def test_a_float8_cache_without_scales_is_refused():
    cache = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs kv_scales"):
        paged_decode(torch.randn(1, 4, 16), cache, cache, torch.tensor([[1]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="needs kv_scales"):
        store_kv(torch.randn(1, 2, 16), torch.randn(1, 2, 16), cache, cache, torch.tensor([0]))


@pytest.mark.slow  # the interpreter runs every layer's kernels program by program
def test_the_triton_engine_gives_the_torch_tokens_on_fp8():
    from pagedlab import LLM
    from pagedlab.bench.agreement import pagedlab_greedy

    model = tiny_model("llama")
    prompts = random_prompts([5, 11])
    config = dict(block_size=4, num_kv_blocks=64, kv_cache_dtype="fp8", calculate_kv_scales=True)
    expected = pagedlab_greedy(LLM(model, attention_backend="torch", **config), prompts, 4)
    assert pagedlab_greedy(LLM(model, attention_backend="triton", **config), prompts, 4) == expected
