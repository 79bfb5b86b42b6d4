"""The engine's settings in one frozen object (vLLM's names), checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlab.checks import is_int, is_real, is_seed

KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's --kv-cache-dtype names (worker/kv_quant.py)
from pagedlab.spec_decode.config import SpeculativeConfig  # noqa: E402


@dataclass(frozen=True)
class EngineConfig:
    """How the engine is built.

    block_size: token slots per KV block, a power of two from 1 to 256.
    num_kv_blocks / kv_cache_memory / gpu_memory_utilization: the KV capacity, taken from the first given
        (a block count, a byte budget, or on CUDA a share of the free memory after loading; on CPU a default).
    max_num_seqs, max_num_batched_tokens: the per-step budgets of the scheduler.
    max_model_len: prompt plus output, at most; default the model's limit, capped by the KV capacity.
    enable_prefix_caching: keep the KV of full blocks findable by content, so that requests sharing a
        prefix compute it once (vLLM's --enable-prefix-caching).
    enable_chunked_prefill: split prompts longer than the step's token budget over several steps.
    attention_backend: "torch" (the reference, any device), "triton" (the kernels of pagedlab.kernels; on CPU
        they run in Triton's interpreter: slow, for stepping through them, and TRITON_INTERPRET=1 must be set
        before anything imports triton), or "auto": Triton on CUDA when it is installed, else torch.
    linear_backend: how the model's linear layers run on CPU: "onednn" (their weights packed once into oneDNN's
        layout, a second copy of them, used for the engine's calls only: `pagedlab.worker.cpu_linear`), "torch"
        (the model's own `nn.Linear`), or "auto" (default): oneDNN on CPU for a float32 model, and for a bfloat16
        one where the CPU has bfloat16 arithmetic (AVX512-BF16, AMX); else torch.
    cpu_fused_ops: on CPU, run Llama-style RMSNorm and MLP modules (those whose `forward` is Llama's) through
        one-pass C++ ops, for the engine's calls only (`pagedlab.worker.cpu_fused`); False: their own forward.
    enforce_eager: never record decode steps as CUDA graphs (vLLM's name). By default, on CUDA with the Triton
        backend, pure-decode steps replay graphs recorded at start-up for padded batch sizes up to max_num_seqs
        (`pagedlab.worker.cuda_graph`); elsewhere everything runs eagerly anyway.
    preemption_mode: what a preempted request does with its KV blocks (see `pagedlab.core.preemption`):
        "recompute" (free them, re-prefill later), "swap" (copy them to a CPU pool of `swap_space` GiB but at
        most as many blocks as the device pool, or exactly `num_cpu_blocks` blocks, and back), or "auto" (per
        victim, the cheaper of the two by a cost model measured at start-up on this device). A swap falls back
        to recompute when the CPU pool is full.
    enable_partial_preemption: take from a victim only the last blocks the request needs; it keeps the rest
        and recomputes its lost tail later (off by default, as in vLLM, which has no such mode).
    force_preemption_rate: for tests, preempt the newest running request in this share of steps (vLLM's
        artificial-preemption trick); 0 in normal use.
    kv_cache_dtype: how K and V are stored (vLLM's names): "auto" (the model's dtype), "fp8" / "fp8_e4m3" or
        "fp8_e5m2" (one byte per value, with a K and a V scale per layer: `pagedlab.worker.kv_quant`).
    calculate_kv_scales: with an fp8 cache, set each layer's scales from the first batch it stores (vLLM's
        option); otherwise they are 1.0.
    seed: seeds the sampler of requests that bring no seed of their own, and the forced preemptions.
    record_trace: keep a `StepRecord` of each step (what the chapters draw).
    max_trace_steps: keep only the most recent this many steps in the trace (None: all), so that a long-running
        engine stays in bounded memory; `trace.num_dropped` counts the older ones.
    tensor_parallel_size: split the model and the KV cache over this many ranks, each in its own process (or the
        processes of `torchrun`); see `pagedlab.worker.executor`. The model must be a folder or Hub id.
    pipeline_parallel_size: cut the model into this many stages by layers, each rank holding its layers and a KV
        pool for them only (`pagedlab.worker.pipeline_parallel`); with tensor_parallel_size T, P x T ranks. The
        model must be a folder or Hub id.
    pipeline_layer_partition: the number of layers of each stage (P counts summing to the model's layers), vLLM's
        VLLM_PP_LAYER_PARTITION as an argument; None: an even split, the remainder to the first stages.
    max_concurrent_batches: with pipeline parallelism, the batches in flight at once, each with its share of the
        running requests (vLLM's name): None (default) one per stage, so that no stage waits for the others; 1
        one at a time (stages take turns: the pipeline bubble). At most pipeline_parallel_size.
    distributed_executor_backend: where the P x T ranks run (vLLM's name): "mp" (default), processes of this
        machine started by the engine; "ray", actors placed on a Ray cluster by a placement group (`ray.init`'s
        cluster: the one this process joined, RAY_ADDRESS, or a local one), across machines (`pip install
        "pagedlab[ray]"`).
    distributed_timeout: seconds a tensor- or pipeline-parallel rank may take to start, or to answer a step (and
        a collective may wait), before the engine declares it hung, stops every rank and raises.
    speculative_config: speculative decoding, vLLM's dict (`pagedlab.spec_decode.SpeculativeConfig`): draft tokens
        by n-gram lookup or a draft model, verified by the target in its next pass. None (default): off.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = False
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    cpu_fused_ops: bool = True
    enforce_eager: bool = False
    preemption_mode: str = "auto"
    swap_space: float = 4.0
    num_cpu_blocks: int | None = None
    enable_partial_preemption: bool = False
    force_preemption_rate: float = 0.0
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    seed: int = 0
    record_trace: bool = True
    max_trace_steps: int | None = 1000
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: tuple[int, ...] | None = None
    max_concurrent_batches: int | None = None
    distributed_executor_backend: str = "mp"
    distributed_timeout: float = 300.0
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        bs = self.block_size
        if not is_int(bs) or bs < 1 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {bs!r}")
        for name, low in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("tensor_parallel_size", 1),
                          ("pipeline_parallel_size", 1)):
            self._check_int(name, low)
        for name, low in (("num_kv_blocks", 1), ("kv_cache_memory", 1), ("num_cpu_blocks", 0), ("max_model_len", 2),
                          ("max_trace_steps", 1), ("max_concurrent_batches", 1)):
            self._check_int(name, low, optional=True)
        self._check_number("gpu_memory_utilization", "in (0, 1]", lambda x: 0.0 < x <= 1.0)
        self._check_number("swap_space", ">= 0 GiB", lambda x: x >= 0)
        self._check_number("force_preemption_rate", "in [0, 1]", lambda x: 0.0 <= x <= 1.0)
        self._check_number("distributed_timeout", "> 0 seconds", lambda x: x > 0)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "enable_partial_preemption",
                     "calculate_kv_scales", "record_trace", "cpu_fused_ops"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not is_seed(self.seed):
            raise ValueError(f"seed must be an integer from -2**63 to 2**64 - 1, got {self.seed!r}")
        self._check_choices()
        partition = self.pipeline_layer_partition
        if partition is not None:
            if (isinstance(partition, (str, bytes)) or not hasattr(partition, "__len__")
                    or not all(is_int(count) and count >= 1 for count in partition)):
                raise ValueError(f"pipeline_layer_partition must be a list of layer counts of at least 1, one per "
                                 f"stage, got {partition!r}")
            object.__setattr__(self, "pipeline_layer_partition", tuple(partition))
            if len(partition) != self.pipeline_parallel_size:
                raise ValueError(f"pipeline_layer_partition gives {len(partition)} stages; pipeline_parallel_size is "
                                 f"{self.pipeline_parallel_size}")
        batches = self.max_concurrent_batches
        if batches is not None and batches > self.pipeline_parallel_size:
            raise ValueError(f"max_concurrent_batches={batches} exceeds pipeline_parallel_size="
                             f"{self.pipeline_parallel_size}: more batches than stages keep none of them busier")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.world_size > 1:
            raise ValueError("speculative_config: method 'draft_model' runs its draft in the engine's own process and "
                             "does not combine with tensor_parallel_size or pipeline_parallel_size > 1; use method "
                             "'ngram'")

    @property
    def world_size(self) -> int:
        """The number of rank processes: pipeline stages x tensor-parallel ranks per stage."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def _check_int(self, name: str, low: int, optional: bool = False) -> None:
        value = getattr(self, name)
        if not (optional and value is None) and (not is_int(value) or value < low):
            raise ValueError(f"{name} must be an integer >= {low}{' or None' if optional else ''}, got {value!r}")

    def _check_number(self, name: str, what: str, holds) -> None:
        value = getattr(self, name)
        if not is_real(value) or not holds(value):
            raise ValueError(f"{name} must be a finite number {what}, got {value!r}")

    def _check_choices(self) -> None:
        """The fields that name one of a few settings."""
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
        if self.linear_backend not in ("auto", "torch", "onednn"):
            raise ValueError(f"linear_backend must be 'auto', 'torch' or 'onednn', got {self.linear_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPE_NAMES))}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError(
                "calculate_kv_scales needs an fp8 KV cache (kv_cache_dtype='fp8', 'fp8_e4m3' or 'fp8_e5m2')"
            )
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'auto', 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}")
