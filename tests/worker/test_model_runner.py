"""The model runner's block moves on the KV tensor: a newly allocated block is cleared in every layer, K and V,
and nothing else is touched."""

from __future__ import annotations

import torch

from pagedlab.worker.kv_cache import KVCacheSpec
from pagedlab.worker.model_runner import ModelRunner
from tests.helpers import tiny_model


def test_zero_blocks_clears_exactly_the_given_blocks_in_every_layer():
    model = tiny_model("llama")
    spec = KVCacheSpec.from_model_config(model.config, torch.float32)
    runner = ModelRunner(model, spec, num_blocks=12, block_size=4, seed=0)
    runner.kv_cache.copy_(torch.randn_like(runner.kv_cache).abs() + 1)  # every slot nonzero
    runner.zero_blocks([7, 2, 9])
    assert runner.kv_cache[:, :, [2, 7, 9]].eq(0).all()
    kept = [b for b in range(12) if b not in (2, 7, 9)]
    assert runner.kv_cache[:, :, kept].ne(0).all()
    runner.zero_blocks([])  # a step that allocated nothing
