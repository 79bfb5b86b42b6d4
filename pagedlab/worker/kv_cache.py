"""The physical KV cache: its shape for a given model, and how many blocks fit in a memory budget.

One tensor holds every layer's keys and values:

    kv_cache[layer, 0 = key | 1 = value, block, slot, kv_head, head_dim]

so `kv_cache[layer][0]` is that layer's key cache `[num_blocks, block_size, num_kv_heads, head_dim]`, and a
block is the same index in every layer (copying or swapping a block is one indexed copy of the whole tensor).

# Explained in chapters/00_model_and_kv_cache.ipynb
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pagedlab.core.block_table import cdiv

logger = logging.getLogger("pagedlab")

GiB = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype) -> KVCacheSpec:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
        """Uninitialised memory (pages are only touched as blocks fill), except block 0, the padding block.

        The torch reference reads masked-out slots too, so every block must hold finite numbers: the model
        runner zeroes each block when it is allocated (`zero_blocks`), and block 0 here.
        """
        shape = (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        kv_cache = torch.empty(shape, dtype=self.dtype, device=device)
        kv_cache[:, :, 0] = 0
        return kv_cache


def default_cpu_budget() -> int:
    """On CPU: a quarter of physical memory, at most 4 GiB (the pages are only touched as blocks fill)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 * GiB
    return min(4 * GiB, physical // 4)


def num_blocks_for_budget(
    spec: KVCacheSpec,
    block_size: int,
    device: torch.device,
    *,
    num_kv_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    max_useful_tokens: int,
) -> int:
    """How many KV blocks the engine gets, from the first of: an explicit count, a byte budget, the device.

    Without an explicit figure, no more blocks are made than `max_useful_tokens` (max_num_seqs full-length
    sequences) can ever fill.
    """
    per_block = spec.bytes_per_block(block_size)
    if num_kv_blocks is not None:
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        return num_kv_blocks
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif device.type == "cuda":
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_utilization)
    else:
        budget = default_cpu_budget()
    num_blocks = min(budget // per_block, cdiv(max_useful_tokens, block_size))
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds no block of {block_size} tokens ({per_block} bytes)"
        )
    return num_blocks
