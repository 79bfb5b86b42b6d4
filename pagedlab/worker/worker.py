"""The device side of the engine: the KV cache's size and tensors, the attention backend, CUDA graphs, the CPU
swap cache and the preemption cost model, and running each step's `SchedulerOutput`.

A step runs in two parts: the block moves the scheduler decided (swap-outs, clearing new blocks, swap-ins,
copy-on-write copies, in an order that never reads overwritten data), then one forward pass and sampling. If the
forward pass or sampling raises, each request is run alone (rewriting the same KV is harmless, and the sampler's
generators are rewound first), so that only the requests whose processing fails are reported.

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from pagedlab.config import EngineConfig
from pagedlab.core.executor import WorkerInfo, check_max_model_len
from pagedlab.core.preemption import PreemptionMode
from pagedlab.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedlab.worker.kv_cache import GiB, KVCacheSpec, num_blocks_for_budget
from pagedlab.worker.kv_quant import is_quantized, resolve_kv_cache_dtype
from pagedlab.worker.model_runner import ModelRunner
from pagedlab.worker.swap import CPUKVCache, measure_cost_model

logger = logging.getLogger("pagedlab")


class Worker:
    """The device side in this process (an `Executor`, `pagedlab.core.executor`). `kv_cache_spec`: the KV cache's
    shape, by default the model's; a parallel rank (`pagedlab.worker.tp_worker`) passes its share of the heads
    and layers, and `last_stage=False` on a pipeline stage before the last (it samples nothing)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, kv_cache_spec: KVCacheSpec | None = None,
                 last_stage: bool = True) -> None:
        if config.world_size > 1 and kv_cache_spec is None:
            from pagedlab.worker.executor import refuse_model_object

            refuse_model_object(config)
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        spec = kv_cache_spec or KVCacheSpec.from_model_config(model.config, self.dtype)
        self.spec = dataclasses.replace(spec, dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, spec.dtype))
        self.num_blocks, max_model_len = self._size_kv_cache(model.config, config)
        self.config = config = dataclasses.replace(config, max_model_len=max_model_len)
        self.bytes_per_block = self.spec.bytes_per_block(config.block_size)
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device, self.spec.dtype)
        self.linear_backend = resolve_linear_backend(config.linear_backend, self.device, self.dtype)
        self.model_runner = ModelRunner(
            model, self.spec, self.num_blocks, config.block_size, config.seed, self.attention_backend, last_stage,
            self.linear_backend, config.cpu_fused_ops,
        )
        graphs = not config.enforce_eager and self.model_runner.kv_scales is None  # fp8: eager (graphs unchecked)
        if self.device.type == "cuda" and self.attention_backend == "triton" and graphs:
            self.model_runner.capture_decode_graphs(config.max_num_seqs, max_model_len)
        self.num_cpu_blocks, self.cpu_kv_cache, self.cost_model = 0, None, None
        mode = PreemptionMode(config.preemption_mode)
        if mode != PreemptionMode.RECOMPUTE:
            self.num_cpu_blocks = config.num_cpu_blocks
            if self.num_cpu_blocks is None:  # swap_space GiB, but never more blocks than the device pool has
                self.num_cpu_blocks = min(int(config.swap_space * 2**30) // self.bytes_per_block, self.num_blocks)
            self.cpu_kv_cache = CPUKVCache(self.spec, max(self.num_cpu_blocks, 1), config.block_size, self.device)
            if mode == PreemptionMode.AUTO:
                self.cost_model = measure_cost_model(self.model_runner, self.cpu_kv_cache, self.spec, config.block_size)
                logger.info("%s", self.cost_model.explain())
        if self.model_runner.kv_scales is not None:  # after the start-up runs, so that real requests set them
            self.model_runner.kv_scales.calculate = config.calculate_kv_scales
        self.info = WorkerInfo(self.num_blocks, self.num_cpu_blocks, self.bytes_per_block, max_model_len,
                               self.attention_backend, self.cost_model)

    def _size_kv_cache(self, model_config, config: EngineConfig) -> tuple[int, int]:
        """The number of KV blocks and the resolved max_model_len (the model's limit, capped by the cache)."""
        model_max_len = getattr(model_config, "max_position_embeddings", None) or 1 << 30
        if config.max_model_len is not None and config.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's limit of {model_max_len} positions"
            )
        wanted_len = config.max_model_len or model_max_len
        num_blocks = num_blocks_for_budget(
            self.spec, config.block_size, self.device, num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=config.kv_cache_memory, gpu_memory_utilization=config.gpu_memory_utilization,
            max_useful_tokens=config.max_num_seqs * wanted_len,
        )
        check_max_model_len(config.max_model_len, num_blocks, config.block_size)
        capacity = num_blocks * config.block_size
        max_model_len = min(wanted_len, capacity)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %s, KV in %s: %d bytes per token, %d tokens "
            "per GiB); max_model_len %d", num_blocks, config.block_size, capacity,
            num_blocks * self.spec.bytes_per_block(config.block_size) / 2**20, self.device,
            str(self.dtype).removeprefix("torch."), str(self.spec.dtype).removeprefix("torch."),
            self.spec.bytes_per_token, GiB // self.spec.bytes_per_token, max_model_len,
        )
        return num_blocks, max_model_len

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Drop the finished sequences' sampling state, apply the step's block moves, then compute it (see the
        module docstring for failures)."""
        for request_id in output.finished_req_ids:
            self.model_runner.sampler.forget(request_id)
        self._move_blocks(output)
        if output.is_empty:
            return ModelRunnerOutput()
        runner, sampler = self.model_runner, self.model_runner.sampler
        state = sampler.get_state()
        try:
            return runner.execute(output.scheduled)
        except Exception as exc:
            groups = {s.group_id for s in output.scheduled}
            if len(groups) == 1 or self.config.pipeline_parallel_size > 1:
                # A pipeline stage cannot retry one request at a time: the other stages ran the batch once. (A
                # stage whose forward pass failed leaves the next one waiting: the executor's timeout ends it.)
                return ModelRunnerOutput(errors={group: _message(exc) for group in groups})
        sampler.set_state(state)  # undo the draws of the failed batch: each request draws once
        merged, errors = ModelRunnerOutput(), {}
        for scheduled in output.scheduled:
            if scheduled.group_id in errors:
                continue  # failed already, with a sibling
            try:
                one = runner.execute([scheduled])
            except Exception as exc:
                errors[scheduled.group_id] = _message(exc)
                continue
            merged.sampled_token_ids.update(one.sampled_token_ids)
            merged.logprobs.update(one.logprobs)
            merged.beam_logprobs.update(one.beam_logprobs)
            merged.prompt_logprobs.update(one.prompt_logprobs)
        alive = {s.request_id for s in output.scheduled if s.group_id not in errors}
        alive |= {t.request_id for s in output.scheduled if s.group_id not in errors for t in s.sampling}
        return ModelRunnerOutput(
            {r: v for r, v in merged.sampled_token_ids.items() if r in alive},
            {r: v for r, v in merged.logprobs.items() if r in alive},
            {r: v for r, v in merged.beam_logprobs.items() if r in alive},
            errors,
            {r: v for r, v in merged.prompt_logprobs.items() if r in alive},
        )

    def _move_blocks(self, output: SchedulerOutput) -> None:
        """Apply the step's block moves to the KV tensors, in an order that never reads overwritten data:
        swap-outs first (their blocks may be handed out again this step), then clear newly allocated blocks,
        swap-ins, and copy-on-write copies (whose source may have just been swapped in; it is held until the
        copy is made, so it is never a new block of this step)."""
        runner = self.model_runner
        if output.swapped_out:
            self.cpu_kv_cache.swap_out(runner.kv_cache, [p for _, pairs in output.swapped_out for p in pairs])
        runner.zero_blocks([b for _, blocks in output.allocated for b in blocks])
        if output.swapped_in:
            self.cpu_kv_cache.swap_in(runner.kv_cache, [p for _, pairs in output.swapped_in for p in pairs])
        runner.copy_blocks([(source, copy) for _, source, copy in output.copies])

    def shutdown(self) -> None:
        """Nothing to stop: everything runs in this process (an executor of worker processes stops them)."""


def _message(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def resolve_attention_backend(name: str, device: torch.device, kv_cache_dtype: torch.dtype | None = None) -> str:
    """Resolve "auto", and check that "triton" can run here (and with this KV cache dtype)."""
    from pagedlab.kernels import HAS_TRITON

    if name == "auto":  # an fp8 cache: torch, until the kernels' float8 variants are checked on a GPU
        return "triton" if device.type == "cuda" and HAS_TRITON and not is_quantized(kv_cache_dtype) else "torch"
    if name == "triton":
        if not HAS_TRITON:
            raise ValueError("attention_backend='triton' needs the triton package (Linux only); use 'torch'")
        if device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "attention_backend='triton' on CPU runs the kernels in Triton's interpreter, which must be "
                    "switched on before triton is first imported: start Python with TRITON_INTERPRET=1"
                )
            logger.warning("attention_backend='triton' on CPU: the kernels run in Triton's interpreter (slow)")
        elif is_quantized(kv_cache_dtype) and (capability := torch.cuda.get_device_capability(device)) < (8, 9):
            raise ValueError(  # Triton has no e4m3 conversion before sm_89; the float8 variants compile for 89, 90
                "attention_backend='triton' with an fp8 KV cache needs a GPU of compute capability 8.9 or newer "
                f"(Ada, Hopper); this one is {'.'.join(map(str, capability))}: "
                "use attention_backend='torch' (the default, 'auto', does)"
            )
    return name


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve "auto" (oneDNN on CPU for float32, and for bfloat16 where the CPU computes in it:
    `cpu_linear.preferred`), and check that "onednn" can run."""
    from pagedlab.worker import cpu_linear

    if name == "auto":
        return "onednn" if cpu_linear.preferred(device, dtype) else "torch"
    if name == "onednn" and not cpu_linear.supported(device, dtype):
        raise ValueError(f"linear_backend='onednn' runs float32 or bfloat16 weights on CPU with oneDNN; this model is "
                         f"{str(dtype).removeprefix('torch.')} on {device.type}"
                         f"{'' if torch.backends.mkldnn.is_available() else ' (and this torch has no oneDNN)'}: "
                         "use 'torch' or 'auto'")
    return name
