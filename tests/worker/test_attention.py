"""The torch attention path: the bucketed decode attention the engine runs equals the padded reference
(`decode_attention`, what chapter 03 teaches) for any order of rows, block size, sliding window and GQA ratio."""

from __future__ import annotations

import pytest
import torch

from pagedlab.worker.attention import AttentionMetadata, bucketed_decode_attention, decode_attention, decode_buckets


@pytest.mark.parametrize("sliding_window", [None, 8, 100])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(4, 4, 16), (9, 3, 64), (5, 1, 80)])
@pytest.mark.parametrize("order", ["longest-first", "shuffled"])
def test_bucketed_decode_equals_reference(sliding_window, block_size, q_heads, kv_heads, head_dim, order):
    generator = torch.Generator().manual_seed(block_size * 31 + q_heads)
    lens = [1, 2, 15, 16, 17, 40, 300, 301, 700, 64, 5, 128]
    if order == "longest-first":
        lens.sort(reverse=True)
    else:
        lens = [lens[i] for i in torch.randperm(len(lens), generator=generator).tolist()]
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=generator)
    value_cache = torch.randn(cache_shape, generator=generator)
    pool = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0 is the padding block
    tables, used = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(pool[used : used + count].tolist())
        used += count
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    context_lens = torch.tensor(lens)
    metadata = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), len(lens), padded, context_lens, [])
    query = torch.randn(len(lens), q_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    expected = decode_attention(query, key_cache, value_cache, metadata, scale, sliding_window)
    buckets = decode_buckets(padded, lens, block_size, sliding_window, query.device)
    assert [b.start for b in buckets] == [0] + [b.end for b in buckets[:-1]] and buckets[-1].end == len(lens)
    got = bucketed_decode_attention(query, key_cache, value_cache, buckets, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
