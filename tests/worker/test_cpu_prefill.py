"""The C++ CPU prefill kernel (`cpu_attention.paged_prefill_cpu`) equals the torch reference (`prefill_attention`,
chunk by chunk) over a grid of shapes: dtypes, GQA ratios (tiles of 48 query vectors: 16 rows of 3 heads, 6 rows
of 7 or 8), the compiled head_dims, block sizes that do and do not divide the chunks, sliding windows; chunks with
and without cached context, of one token (a decode-like chunk) to several tiles, after decode rows in the batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedlab.worker import cpu_attention
from pagedlab.worker.attention import PrefillChunk, PrefillTensors, prefill_attention

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

# (cached tokens, new tokens) per chunk
CHUNKS = [(0, 1), (37, 70), (0, 131), (400, 20), (16, 16), (3, 1), (130, 129)]
NUM_DECODE_ROWS = 3  # rows before the first chunk, as in the flat batch: the kernel must leave them alone


def _case(block_size, q_heads, kv_heads, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in CHUNKS) + 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    pool = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    chunks, used, row = [], 0, NUM_DECODE_ROWS
    for context, new in CHUNKS:
        count = -(-(context + new) // block_size)
        chunks.append(PrefillChunk(row, row + new, context, torch.tensor(pool[used:used + count])))
        used, row = used + count, row + new
    # [heads, tokens, head_dim] transposed, as the attention interface hands the query over
    query = torch.randn(q_heads, row, head_dim, generator=generator).to(dtype).transpose(0, 1)
    return query, key_cache, value_cache, chunks


def _own_kv(cache, chunk):
    """The chunk's new tokens' rows of the cache (written there before attention runs)."""
    positions = torch.arange(chunk.num_context, chunk.num_context + chunk.num_new)
    block_size = cache.shape[1]
    slots = chunk.block_ids[positions // block_size] * block_size + positions % block_size
    return cache.view(-1, *cache.shape[2:])[slots]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 7, 100])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(9, 3, 64), (5, 1, 80), (8, 2, 128), (14, 2, 64),
                                                         (8, 1, 64), (4, 4, 64)])
def test_kernel_equals_reference(kernel, dtype, sliding_window, block_size, q_heads, kv_heads, head_dim):
    query, key_cache, value_cache, chunks = _case(block_size, q_heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = torch.full(query.shape, 7.0, dtype=dtype)
    inputs = PrefillTensors.build(chunks)
    cpu_attention.paged_prefill_cpu(query, key_cache, value_cache, inputs, scale, sliding_window, out, kernel)
    assert (out[:NUM_DECODE_ROWS] == 7.0).all()
    for chunk in chunks:
        rows = slice(chunk.start, chunk.end)
        k, v = _own_kv(key_cache.float(), chunk), _own_kv(value_cache.float(), chunk)
        expected = prefill_attention(query[rows].float(), k, v, key_cache.float(), value_cache.float(), chunk, scale,
                                     sliding_window)
        torch.testing.assert_close(out[rows].float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_what_it_does_not_take_goes_to_the_torch_path():
    cache = torch.zeros(4, 16, 2, 64)
    assert cpu_attention.supports_prefill(torch.zeros(5, 4, 64), cache)
    assert not cpu_attention.supports_prefill(torch.zeros(5, 4, 48), torch.zeros(4, 16, 2, 48))  # head_dim
    assert not cpu_attention.supports_prefill(torch.zeros(5, 98, 64), cache)  # 49 query heads a KV head
    assert not cpu_attention.supports_prefill(torch.zeros(5, 4, 64), cache.to(torch.bfloat16))  # dtypes differ


def test_bad_shapes_are_refused(kernel):
    query, key_cache, value_cache, chunks = _case(16, 9, 3, 64, torch.float32)
    inputs = PrefillTensors.build(chunks)
    with pytest.raises(RuntimeError, match="head shapes"):
        cpu_attention.paged_prefill_cpu(query[:, :8], key_cache, value_cache, inputs, 0.1, None,
                                        torch.empty(query[:, :8].shape), kernel)
    with pytest.raises(RuntimeError, match="int64"):
        bad = dataclasses.replace(inputs, block_tables=inputs.block_tables.int())
        cpu_attention.paged_prefill_cpu(query, key_cache, value_cache, bad, 0.1, None, torch.empty(query.shape),
                                        kernel)
    with pytest.raises(RuntimeError, match="one entry per chunk"):
        bad = dataclasses.replace(inputs, query_start_loc=inputs.query_start_loc[:-1])
        cpu_attention.paged_prefill_cpu(query, key_cache, value_cache, bad, 0.1, None, torch.empty(query.shape),
                                        kernel)


def test_prefill_tensors_need_chunks_back_to_back():
    chunks = [PrefillChunk(0, 3, 0, torch.tensor([1])), PrefillChunk(4, 6, 0, torch.tensor([2]))]
    with pytest.raises(ValueError, match="back to back"):
        PrefillTensors.build(chunks)
    tensors = PrefillTensors.build([chunks[0], PrefillChunk(3, 5, 16, torch.tensor([2, 3]))])
    assert tensors.query_start_loc.tolist() == [0, 3, 5] and tensors.num_context.tolist() == [0, 16]
    assert tensors.block_tables.tolist() == [[1, 0], [2, 3]] and tensors.max_num_new == 3
