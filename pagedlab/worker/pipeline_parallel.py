"""Pipeline parallelism: the model cut into stages by layers, each stage with a KV pool for its own layers.

Stage s of P holds a contiguous range of decoder layers (`layer_partition`; the embedding on the first stage, the
final norm and the LM head on the last). Its KV pool holds those layers only, in as many blocks as every other
stage, so that one block table, the scheduler's, addresses all P pools: block 7 is block 7 on every stage, each
holding its own layers' K and V of it. Every stage applies the step's block moves (allocations, copies, swaps) to
its own pool; the hidden states go stage to stage with torch.distributed point-to-point sends (gloo on CPU, NCCL
on CUDA), and the last stage samples.

The model code is not modified: `cut_stage` swaps three of the model's modules. On a stage after the first the
embedding becomes `ReceiveHidden` (the model's forward looks up "embeddings" and gets the previous stage's hidden
states); on a stage before the last the final norm becomes `SendHidden` (the hidden states go on, un-normed, as
the residual stream they are) and the LM head an identity (its "logits" are never sampled). The layers a stage
keeps are renumbered from 0, so that each indexes its own pool.

With one batch in flight, while stage s computes the others wait (the pipeline bubble), and stage times add up,
so on one machine this is slower than one process; it is how a model too big for one device's memory runs. The
engine keeps P batches in flight instead (`EngineConfig.max_concurrent_batches`; the batch queue of
`pagedlab.core.engine_core`): while stage 1 runs batch k, stage 0 runs batch k + 1.

# Explained in chapters/12_tensor_parallelism.ipynb
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pagedlab.worker.tensor_parallel import Counters


def layer_partition(num_layers: int, size: int, partition=None) -> list[tuple[int, int]]:
    """Each stage's layers as [start, stop): `partition` (one count per stage, vLLM's VLLM_PP_LAYER_PARTITION as an
    argument) or an even split whose remainder goes to the first stages (the last one also runs the LM head)."""
    if partition is None:
        base, extra = divmod(num_layers, size)
        partition = [base + (stage < extra) for stage in range(size)]
    bounds, start = [], 0
    for count in partition:
        bounds.append((start, start + count))
        start += count
    return bounds


def check_pipeline_parallel_size(config, size: int, partition=None) -> None:
    """A ValueError naming the problem if `size` stages (and `partition`) cannot cut this model. (EngineConfig
    has checked that both are well formed: an integer >= 1, and as many counts >= 1 as stages.)"""
    num_layers = config.num_hidden_layers
    if size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={size} exceeds the model's {num_layers} layers: every stage needs a layer"
        )
    if partition is not None and sum(partition) != num_layers:
        raise ValueError(f"pipeline_layer_partition {list(partition)} covers {sum(partition)} layers; the model has "
                         f"{num_layers}")


@dataclass
class StageStats(Counters):
    """One rank's pipeline traffic and time since the last reset: tensors and bytes sent on and received, the
    seconds its steps took (`execute_s`, the block moves included) and of those, the seconds it waited for the
    previous stage's hidden states (`receive_wait_s`). Busy time is the difference; with one batch in flight a
    stage is busy about 1/P of the time and waits, or has nothing to do, the rest (the pipeline bubble).
    `spans`: the last `MAX_SPANS` steps as (start, receive start, receive end, end) on the machine's monotonic clock
    (`time.perf_counter`, comparable between processes of one machine), what a timeline of the stages draws; a
    stage that receives nothing has receive start = receive end = start."""

    MAX_SPANS = 1000

    num_sent: int = 0
    bytes_sent: int = 0
    num_received: int = 0
    bytes_received: int = 0
    receive_wait_s: float = 0.0
    execute_s: float = 0.0
    received_at: float = 0.0  # when the last receive ended
    spans: tuple[tuple[float, float, float, float], ...] = ()

    def record_step(self, start: float, end: float, waited_s: float) -> None:
        receive = (self.received_at - waited_s, self.received_at) if waited_s else (start, start)
        self.execute_s += end - start
        self.spans = self.spans[-(self.MAX_SPANS - 1):] + ((start, *receive, end),)

    @property
    def busy_s(self) -> float:
        return self.execute_s - self.receive_wait_s


class ReceiveHidden(nn.Module):
    """In place of the embedding on a stage after the first: the hidden states of the previous stage, received
    in the shape of the step's token ids. Keeps `num_embeddings`, which the start-up measurements read."""

    def __init__(self, num_embeddings: int, hidden_size: int, dtype: torch.dtype, source: int, stats: StageStats):
        super().__init__()
        self.num_embeddings, self.hidden_size, self.dtype = num_embeddings, hidden_size, dtype
        self.source, self.stats = source, stats

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.empty(*input_ids.shape, self.hidden_size, dtype=self.dtype, device=input_ids.device)
        start = time.perf_counter()
        dist.recv(hidden, src=self.source)
        self.stats.received_at = time.perf_counter()
        self.stats.receive_wait_s += self.stats.received_at - start
        self.stats.num_received += 1
        self.stats.bytes_received += hidden.nbytes
        return hidden


class SendHidden(nn.Module):
    """In place of the final norm on a stage before the last: send the hidden states on, return them unchanged."""

    def __init__(self, destination: int, stats: StageStats):
        super().__init__()
        self.destination, self.stats = destination, stats

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        dist.send(hidden, dst=self.destination)
        self.stats.num_sent += 1
        self.stats.bytes_sent += hidden.nbytes
        return hidden


def decoder_layers(model: nn.Module) -> tuple[nn.Module, str]:
    """(the module holding the decoder layers, the attribute name of their ModuleList)."""
    base = getattr(model, model.base_model_prefix)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise ValueError(f"{type(model).__name__} keeps no `layers` list: pagedlab cannot cut it into stages")
    return base, "layers"


def cut_stage(model: nn.Module, stage: int, bounds: list[tuple[int, int]], rank: int, ranks_per_stage: int,
              stats: StageStats) -> nn.Module:
    """Cut `model` (loaded whole, perhaps already tensor-parallel) down to stage `stage` of `len(bounds)`, in place.
    The rank of the same tensor-parallel position in the next stage is `rank + ranks_per_stage`."""
    start, stop = bounds[stage]
    base, name = decoder_layers(model)
    kept = nn.ModuleList(list(getattr(base, name))[start:stop])
    for local, layer in enumerate(kept):  # each layer indexes its stage's pool
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = local
    setattr(base, name, kept)
    dtype = next(model.parameters()).dtype
    if stage > 0:
        embedding = model.get_input_embeddings()
        model.set_input_embeddings(ReceiveHidden(embedding.num_embeddings, model.config.hidden_size, dtype,
                                                 rank - ranks_per_stage, stats))
    if stage < len(bounds) - 1:
        base.norm = SendHidden(rank + ranks_per_stage, stats)
        model.lm_head = nn.Identity()
    return model


@dataclass(frozen=True)
class PipelineCost:
    """On paper, for one model cut into `size` stages: what each stage holds and what goes between them."""

    size: int
    layers_per_stage: tuple[int, ...]
    weight_bytes_per_stage: tuple[int, ...]  # its layers, plus the embedding (first) and norm and head (last)
    kv_bytes_per_token_per_stage: tuple[int, ...]
    bytes_sent_per_token: int  # each stage boundary: one hidden state per token
    bubble_fraction: float  # one batch in flight: the share of stage-time spent waiting, (P - 1) / P


def pipeline_cost(config, size: int, dtype_bytes: int = 2, partition=None) -> PipelineCost:
    """`PipelineCost` of a Llama-like transformers `config` cut into `size` stages, `dtype_bytes` per value."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter + 2 * hidden
    embedding = config.vocab_size * hidden
    head = 0 if getattr(config, "tie_word_embeddings", False) and size == 1 else config.vocab_size * hidden
    bounds = layer_partition(config.num_hidden_layers, size, partition)
    counts = tuple(stop - start for start, stop in bounds)
    weights = [n * per_layer for n in counts]
    weights[0] += embedding
    weights[-1] += head + hidden
    kv = tuple(n * 2 * kv_heads * head_dim * dtype_bytes for n in counts)
    return PipelineCost(size, counts, tuple(w * dtype_bytes for w in weights), kv, hidden * dtype_bytes,
                        (size - 1) / size)
