"""The CPU side of swapping: a second KV tensor in host memory, the batched block copies, and the start-up
measurements behind "auto" preemption (copy bandwidth and prefill speed on the actual device).

The CPU cache has the device cache's layout, so moving a block is one indexed copy of the whole tensor:

    cpu_cache[layer, k|v, cpu_block] <- kv_cache[layer, k|v, device_block]     for every swapped block

All blocks a step swaps out go in one gather + one copy, and all it swaps in the same way. On CUDA the CPU
cache is pinned, so the copies are DMA transfers.

# Explained in chapters/06_preemption.ipynb
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pagedlab.core.block_table import cdiv
from pagedlab.core.preemption import PreemptionCostModel
from pagedlab.core.sched_output import ScheduledRequest
from pagedlab.worker.kv_cache import KVCacheSpec


class CPUKVCache:
    """Host memory for `num_blocks` swapped-out blocks: `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device) -> None:
        shape = (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.device = device
        self.cache = torch.empty(shape, dtype=spec.dtype, device="cpu", pin_memory=device.type == "cuda")

    def swap_out(self, kv_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: pairs of (device block, cpu block)."""
        if pairs:
            device_ids, cpu_ids = (list(ids) for ids in zip(*pairs))
            index = torch.tensor(device_ids, device=kv_cache.device)
            self.cache[:, :, cpu_ids] = kv_cache[:, :, index].to("cpu")

    def swap_in(self, kv_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks: pairs of (cpu block, device block)."""
        if pairs:
            cpu_ids, device_ids = (list(ids) for ids in zip(*pairs))
            index = torch.tensor(device_ids, device=kv_cache.device)
            kv_cache[:, :, index] = self.cache[:, :, cpu_ids].to(kv_cache.device, non_blocking=True)


def _best_time(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls, after one warm-up call (first touches, lazy initialisation)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_cost_model(
    runner, cpu_cache: CPUKVCache, spec: KVCacheSpec, block_size: int, num_tokens: int = 128
) -> PreemptionCostModel:
    """Time a batched swap-out of up to 16 blocks, and a prefill of up to `num_tokens` tokens through the
    runner's own paged forward pass (what a recomputation runs), on blocks no request holds yet."""
    kv_cache = runner.kv_cache
    num_device_blocks = kv_cache.shape[2]
    num_blocks = max(1, min(16, num_device_blocks - 1, cpu_cache.cache.shape[2]))
    pairs = [(1 + i % (num_device_blocks - 1) if num_device_blocks > 1 else 0, i) for i in range(num_blocks)]
    saved = cpu_cache.cache[:, :, :num_blocks].clone()
    seconds = _best_time(lambda: cpu_cache.swap_out(kv_cache, pairs))
    cpu_cache.cache[:, :, :num_blocks] = saved
    bytes_moved = num_blocks * spec.bytes_per_block(block_size)

    num_tokens = max(1, min(num_tokens, (num_device_blocks - 1) * block_size))
    vocab = runner.model.get_input_embeddings().num_embeddings
    token_ids = torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    block_ids = tuple(range(1, 1 + cdiv(num_tokens, block_size))) if num_device_blocks > 1 else (0,)
    prefill = ScheduledRequest("cost-model", 0, num_tokens, "cost-model", tuple(token_ids), block_ids)
    prefill_seconds = _best_time(lambda: runner.execute([prefill]), repeats=2)
    return PreemptionCostModel(
        bytes_per_block=spec.bytes_per_block(block_size),
        block_size=block_size,
        copy_bytes_per_s=bytes_moved / max(seconds, 1e-9),
        prefill_tokens_per_s=num_tokens / max(prefill_seconds, 1e-9),
    )
