"""The decode step against the memory: how much of the machine's read bandwidth decode attention reaches.

For each dtype, batch and context length, one decode step of the real model over a paged KV cache filled
with `context` tokens per sequence (blocks scattered over the pool, as after churn) is timed three ways,
interleaved, `repeats` times each:

    step          the model with pagedlab's attention, as the model runner calls it (KV write + decode)
    no attention  the same forward with attention replaced by a no-op: linear layers, norms, RoPE, logits
    (torch path)  the step with the C++ kernel turned off: gather + SDPA (`bucketed_decode_attention`)

attention = step - no attention; it must read every cached K and V once (`kv_read_bytes`), so its speed is
kv_read_bytes / attention, against the machine's read bandwidth (a 1 GiB float32 tensor summed, measured
between the same rounds): `fraction_of_read`. The decode kernel's goal is >= 0.5 at batch 64, context 512.
`clock="cpu"` times everything by the process's CPU time instead of the wall clock: with one thread on a
machine that other jobs share, that is the time the work took while it ran, which the wall clock is not.

# Explained in chapters/03_paged_attention.ipynb
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from pagedlab.bench import run_metrics
from pagedlab.worker import cpu_attention
from pagedlab.worker.attention import ATTENTION_NAME, AttentionMetadata, PagedAttentionContext
from pagedlab.worker.kv_cache import KVCacheSpec

NO_ATTENTION = "pagedlab-no-attention"


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention that does nothing: the query comes back as the output ([1, tokens, q_heads, head_dim])."""
    return query.transpose(1, 2), None


AttentionInterface.register(NO_ATTENTION, no_attention)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str):
    """The model with attention `name` for the duration of a call (as the model runner selects pagedlab's)."""
    config = model.config
    previous = config._attn_implementation_internal
    config._attn_implementation_internal = name
    try:
        yield
    finally:
        config._attn_implementation_internal = previous


@contextlib.contextmanager
def cpu_kernel_off():
    """The torch path (gather + SDPA) instead of the C++ kernel, for one call."""
    previous = os.environ.get("PAGEDLAB_CPU_KERNEL")
    os.environ["PAGEDLAB_CPU_KERNEL"] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PAGEDLAB_CPU_KERNEL"]
        else:
            os.environ["PAGEDLAB_CPU_KERNEL"] = previous


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def read_bandwidth(tensor: torch.Tensor, clock=time.perf_counter) -> float:
    """Bytes per second read by one sum over `tensor` (a large float32 tensor, pages already touched)."""
    start = clock()
    tensor.sum()
    return tensor.numel() * tensor.element_size() / (clock() - start)


@dataclass
class DecodeStep:
    """One decode step's inputs over a filled paged cache: `batch` sequences of `context` tokens each."""

    model: torch.nn.Module
    batch: int
    context: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    kv_cache: torch.Tensor
    kv_read_bytes: int  # K and V of every context token in every layer, read once per step

    @classmethod
    def build(cls, model, batch: int, context: int, block_size: int, seed: int = 0) -> DecodeStep:
        param = next(model.parameters())
        spec = KVCacheSpec.from_model_config(model.config, param.dtype)
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq + 1  # block 0: the padding block
        kv_cache = spec.allocate(num_blocks, block_size, param.device)
        generator = torch.Generator().manual_seed(seed)
        # Every block gets the same random contents (filling gigabytes with randn would take longer than the
        # benchmark); what is timed reads each block from its own place in memory all the same.
        shape = (spec.num_layers, 2, 1, block_size, spec.num_kv_heads, spec.head_dim)
        pattern = torch.randn(shape, generator=generator)
        kv_cache[:, :, 1:] = pattern.to(kv_cache.dtype)
        tables = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(batch, blocks_per_seq)
        positions = torch.full((batch,), context - 1, dtype=torch.long)
        last = tables[:, (context - 1) // block_size]
        metadata = AttentionMetadata(
            slot_mapping=last * block_size + (context - 1) % block_size,
            num_decodes=batch,
            decode_block_tables=tables.contiguous(),
            decode_context_lens=torch.full((batch,), context, dtype=torch.long),
            prefills=[],
        )
        vocab = model.get_input_embeddings().num_embeddings
        input_ids = torch.randint(vocab, (batch,), generator=generator)
        kv_bytes = batch * context * spec.bytes_per_token
        return cls(model, batch, context, input_ids, positions, metadata, kv_cache, kv_bytes)

    def run(self, attention: str = ATTENTION_NAME, clock=time.perf_counter) -> float:
        """Seconds for one forward over the step (logits for every row), with the given attention."""
        self.metadata.clear_caches()  # a real step builds them afresh
        context = PagedAttentionContext(self.metadata, self.kv_cache, "torch")
        start = clock()
        with attention_implementation(self.model, attention):
            self.model(input_ids=self.input_ids[None], position_ids=self.positions[None], use_cache=False,
                       pagedlab_context=context)
        return clock() - start


@dataclass
class DecodeResult:
    dtype: str
    batch: int
    context: int
    kv_read_bytes: int
    times: dict[str, list[float]] = field(default_factory=dict)  # variant -> seconds per round
    read_bandwidth: list[float] = field(default_factory=list)  # bytes/s, one per round

    def median(self, variant: str) -> float:
        return run_metrics.median(self.times.get(variant, []))

    def attention_s(self, variant: str = "step") -> float:
        return self.median(variant) - self.median("no attention")

    def fraction(self, variant: str = "step") -> float:
        attention = self.attention_s(variant)
        if not attention > 0:
            return float("nan")
        return self.kv_read_bytes / attention / run_metrics.median(self.read_bandwidth)


def model_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model in `dtype` (itself if it already is; otherwise a converted copy)."""
    if next(model.parameters()).dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype)


def measure(model, dtypes, batches, contexts, block_size: int, repeats: int, max_kv_bytes: int,
            torch_path: bool = True, clock: str = "wall", probe_bytes: int = 1 << 30,
            bar=None) -> tuple[list[DecodeResult], list[str]]:
    """Every (dtype, batch, context) whose cache fits in `max_kv_bytes`; returns the results and the skipped."""
    results, skipped = [], []
    tick = CLOCKS[clock]
    probe = torch.ones(probe_bytes // 4, dtype=torch.float32)  # 1 GiB by default, touched once here
    use_kernel = cpu_attention.kernel() is not None and next(model.parameters()).device.type == "cpu"
    variants = ["step", "no attention"] + (["torch path"] if torch_path and use_kernel else [])
    with torch.inference_mode():
        for dtype in dtypes:
            m = model_in(model, dtype)
            spec = KVCacheSpec.from_model_config(m.config, dtype)
            for batch in batches:
                for context in contexts:
                    if batch * context * spec.bytes_per_token > max_kv_bytes:
                        skipped.append(f"{str(dtype).removeprefix('torch.')} batch {batch} context {context}")
                        continue
                    step = DecodeStep.build(m, batch, context, block_size)
                    result = DecodeResult(str(dtype).removeprefix("torch."), batch, context, step.kv_read_bytes)
                    runs = {"step": lambda step=step: step.run(clock=tick),
                            "no attention": lambda step=step: step.run(NO_ATTENTION, tick),
                            "torch path": lambda step=step: _without_kernel(step, tick)}
                    for variant in variants:  # warm-up: first calls allocate and build
                        runs[variant]()
                    for _ in range(repeats):
                        for variant in variants:
                            result.times.setdefault(variant, []).append(runs[variant]())
                        result.read_bandwidth.append(read_bandwidth(probe, tick))
                    results.append(result)
                    del step
                    if bar is not None:
                        bar.update(1)
    return results, skipped


def _without_kernel(step: DecodeStep, clock) -> float:
    with cpu_kernel_off():
        return step.run(clock=clock)
