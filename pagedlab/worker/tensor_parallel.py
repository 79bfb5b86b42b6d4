"""Tensor parallelism: which sizes a model allows, and how one rank's shard of it is cut and run.

Megatron's split, applied with PyTorch's tensor-parallel API (`parallelize_module` and `ParallelStyle`) over the
plan each `transformers` family publishes (`config.base_model_tp_plan`): q/k/v and gate/up column-wise (this rank's
heads and its slice of the MLP, no communication), o and down row-wise (a partial sum, all-reduced), the embedding
and the LM head split by vocabulary (one all-reduce, one all-gather). The model code is not modified.

Each shard is the one DTensor's `Shard(dim)` placement gives this rank (`distribute_tensor`); the forward pass then
runs on these local tensors and calls the collectives itself, as transformers' and vLLM's inference paths do,
because PyTorch's stock `ColwiseParallel`/`RowwiseParallel` dispatch every linear layer through DTensor, which on
the model runner's 3-D activations costs milliseconds per layer on a CPU (chapter 12 measures it).

# Explained in chapters/12_tensor_parallelism.ipynb
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


def valid_tensor_parallel_sizes(config) -> list[int]:
    """The sizes at which every rank holds whole query and KV heads and an equal slice of the MLP."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    common = math.gcd(math.gcd(heads, kv_heads), config.intermediate_size)
    return [n for n in range(1, common + 1) if common % n == 0]


def check_tensor_parallel_size(config, size: int) -> None:
    """Raise a ValueError naming the valid sizes if `size` does not split this model's heads evenly."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    valid = valid_tensor_parallel_sizes(config)
    if size not in valid:
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        raise ValueError(
            f"tensor_parallel_size={size} does not divide this model evenly: it has {config.num_attention_heads} "
            f"query heads, {kv_heads} key/value heads and an MLP of {config.intermediate_size}, and each rank must "
            f"hold an equal share of each; valid sizes: {', '.join(map(str, valid))} (pagedlab does not replicate "
            f"KV heads across ranks, as vLLM does when the size exceeds their count)"
        )


@dataclass
class Counters:
    """Counters a rank keeps between resets; `snapshot` copies them to send to the driver."""

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def snapshot(self):
        return type(self)(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass
class CollectiveStats(Counters):
    """One rank's communication since the last reset: how many collectives, how many bytes, how long they blocked.

    Times are wall time around each blocking call, so they include waiting for the slowest rank; on CUDA the calls
    only enqueue work (NCCL is asynchronous) and the times say little, while counts and bytes hold everywhere."""

    num_all_reduce: int = 0
    all_reduce_bytes: int = 0
    all_reduce_s: float = 0.0
    num_all_gather: int = 0
    all_gather_bytes: int = 0
    all_gather_s: float = 0.0

    def all_reduce(self, tensor: torch.Tensor, group) -> None:
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        self.all_reduce_s += time.perf_counter() - start
        self.num_all_reduce += 1
        self.all_reduce_bytes += tensor.nbytes

    def all_gather_last_dim(self, tensor: torch.Tensor, group) -> torch.Tensor:
        """Every rank's slice of the last dimension, concatenated in rank order."""
        start = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        self.all_gather_s += time.perf_counter() - start
        self.num_all_gather += 1
        self.all_gather_bytes += tensor.nbytes * len(parts)
        return torch.cat(parts, dim=-1)


def _local_shard(parameter: nn.Parameter, mesh, dim: int) -> nn.Parameter:
    """This rank's piece of `parameter` along `dim`, as DTensor's Shard(dim) cuts it (every rank loaded the whole
    tensor, so nothing is sent: src_data_rank=None)."""
    local = distribute_tensor(parameter.detach(), mesh, [Shard(dim)], src_data_rank=None).to_local()
    return nn.Parameter(local.contiguous(), requires_grad=False)


class _Sharded(ParallelStyle):
    """A style that cuts some of a module's parameters; a parameter shared by several modules (tied embeddings)
    is cut once and stays shared."""

    def __init__(self, stats: CollectiveStats, shards: dict[int, nn.Parameter]) -> None:
        self.stats, self._shards = stats, shards

    def _shard(self, module: nn.Module, name: str, mesh, dim: int) -> None:
        parameter = getattr(module, name)
        if parameter is None:
            return
        key = id(parameter)
        if key not in self._shards:
            self._shards[key] = _local_shard(parameter, mesh, dim)
        setattr(module, name, self._shards[key])


class ColumnParallel(_Sharded):
    """nn.Linear split by output features (q/k/v: this rank's heads; gate/up: its slice of the MLP). The input is
    the whole activation on every rank; the output is this rank's features. No communication."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._shard(module, "weight", device_mesh, 0)  # [out_features / N, in_features]
        self._shard(module, "bias", device_mesh, 0)
        return module


class RowParallel(_Sharded):
    """nn.Linear split by input features (o, down): this rank's heads or MLP slice in, a partial sum of the whole
    output out, all-reduced so that every rank holds the sum; a bias is added once, after the sum."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._shard(module, "weight", device_mesh, 1)  # [out_features, in_features / N]
        bias, group, stats = module.bias, device_mesh.get_group(), self.stats
        module.bias = None

        def all_reduce(_module, _args, output: torch.Tensor) -> torch.Tensor:
            stats.all_reduce(output, group)
            return output if bias is None else output + bias

        module.register_forward_hook(all_reduce)
        return module


class VocabParallelEmbedding(_Sharded):
    """nn.Embedding split by vocabulary: this rank looks up the ids in its rows, writes zeros for the others,
    and the all-reduce fills in every row from the rank that holds it."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        vocab_size, rank, size = module.num_embeddings, device_mesh.get_local_rank(), device_mesh.size()
        start, stop = rank * vocab_size // size, (rank + 1) * vocab_size // size
        self._shard(module, "weight", device_mesh, 0)  # rows [start, stop)
        group, stats, outside = device_mesh.get_group(), self.stats, {}

        def local_ids(_module, args):
            (input_ids,) = args
            mask = (input_ids < start) | (input_ids >= stop)
            outside["mask"] = mask
            return ((input_ids - start).masked_fill(mask, 0),)

        def all_reduce(_module, _args, output: torch.Tensor) -> torch.Tensor:
            output = output.masked_fill(outside.pop("mask")[..., None], 0)
            stats.all_reduce(output, group)
            return output

        module.register_forward_pre_hook(local_ids)
        module.register_forward_hook(all_reduce)
        return module


class VocabParallelHead(_Sharded):
    """The LM head (nn.Linear to the vocabulary) split by output features: each rank computes its slice of the
    logits, and an all-gather gives every rank all of them (every rank samples the same token)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._shard(module, "weight", device_mesh, 0)
        self._shard(module, "bias", device_mesh, 0)
        group, stats = device_mesh.get_group(), self.stats
        module.register_forward_hook(lambda _m, _a, output: stats.all_gather_last_dim(output, group))
        return module


STYLES = {"colwise": ColumnParallel, "rowwise": RowParallel}
REPLICATED = ("replicated_with_grad_allreduce", "replicate")  # e.g. Qwen3's per-head q_norm/k_norm: kept whole


def tensor_parallel_plan(model: nn.Module, stats: CollectiveStats, size: int) -> dict[str, ParallelStyle]:
    """The family's `base_model_tp_plan` from transformers, as PyTorch styles, plus the vocabulary split.

    The embedding and head are split only when the vocabulary divides evenly; otherwise each rank keeps them
    whole (the result is the same, with more memory and no communication for them)."""
    base = model.base_model_prefix
    plan_names = getattr(model.config, "base_model_tp_plan", None) or {}
    if not plan_names:
        raise ValueError(f"{type(model).__name__} publishes no tensor-parallel plan (config.base_model_tp_plan)")
    shards: dict[int, nn.Parameter] = {}
    plan: dict[str, ParallelStyle] = {}
    for pattern, name in plan_names.items():
        if name in REPLICATED:
            continue
        if name not in STYLES:
            raise ValueError(f"pagedlab cannot apply the tensor-parallel style {name!r} (of {pattern!r})")
        plan[f"{base}.{pattern}"] = STYLES[name](stats, shards)
    world_size = size
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding.num_embeddings % world_size == 0 and head.out_features % world_size == 0:
        names = {module: name for name, module in model.named_modules()}
        plan[names[embedding]] = VocabParallelEmbedding(stats, shards)
        plan[names[head]] = VocabParallelHead(stats, shards)
    return plan


def shard_model(model: nn.Module, mesh, stats: CollectiveStats) -> nn.Module:
    """Cut `model` (loaded whole on every rank) down to this rank's shard, in place."""
    check_tensor_parallel_size(model.config, mesh.size())
    return parallelize_module(model, mesh, tensor_parallel_plan(model, stats, mesh.size()))


@dataclass(frozen=True)
class TensorParallelCost:
    """On paper, for one model split over `size` ranks: what each rank holds and what the ranks exchange.

    Per token each layer all-reduces its attention output and its MLP output (hidden_size values each), the
    embedding one more; a ring all-reduce of B bytes sends 2 (N - 1) / N x B from every rank."""

    size: int
    weight_bytes_per_rank: int  # the split layers' 1/N plus norms (and the embedding and head, split by vocabulary)
    kv_bytes_per_token_per_rank: int
    num_all_reduce_per_step: int  # per forward pass, whatever the batch
    all_reduce_bytes_per_token: int  # the tensor each rank contributes, per token, summed over the step
    ring_bytes_sent_per_token: int  # what each rank sends for it with a ring all-reduce


def tensor_parallel_cost(config, size: int, dtype_bytes: int = 2) -> TensorParallelCost:
    """`TensorParallelCost` of a Llama-like transformers `config` at `size` ranks, `dtype_bytes` per value."""
    hidden, layers, inter = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * inter
    embedding = config.vocab_size * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    norms = (2 * layers + 1) * hidden
    weights = (layers * (attention + mlp) + embedding) // size + norms
    reduce_bytes = (2 * layers + 1) * hidden * dtype_bytes
    return TensorParallelCost(
        size, weights * dtype_bytes, layers * 2 * (kv_heads // size) * head_dim * dtype_bytes, 2 * layers + 1,
        reduce_bytes, reduce_bytes * 2 * (size - 1) // size,
    )
