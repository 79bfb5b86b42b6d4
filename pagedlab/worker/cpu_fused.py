"""Llama's RMSNorm, MLP and attention projections on CPU in fewer passes: one C++ pass for the norm, one GEMM for the
gate and up projections and one pass for SiLU-and-multiply, one GEMM for q, k and v and one pass for their rotary
embedding, for the duration of an engine call.

A Hugging Face `LlamaRMSNorm` runs six torch operators, each reading and writing the whole row block (a widening
copy, pow, mean, add, rsqrt, two multiplies), and `LlamaMLP` two projections, a SiLU and a multiply. On a CPU
those are memory traffic on a prefill (a 1,600-token chunk: 3.1 ms a norm against 0.34 ms fused) and operator
dispatch on a decode step (72 us against 6 us at 32 rows). Llama's attention runs three projections, then twelve
operators for the rotary embedding of q and k (`apply_rotary_pos_emb`), each a few microseconds of dispatch on a
decode step. vLLM's CPU backend fuses them the same way (its own model code, compiled). Here the model object stays
the user's: as `cpu_linear.PackedLinears` does for the linear layers, `FusedModules.installed()` routes the forward
of each module that qualifies through the fused ops and restores the module's own afterwards.

A module qualifies when its class's `forward` is Llama's, statement for statement (compared as syntax trees, so
Mistral's and Qwen2's norms and MLPs qualify, their attention, which passes a sliding window, does not, and
Gemma's `1 + weight` norm does not), on CPU, with the MLP's activation a SiLU (`nn.SiLU`, or a module whose forward
is transformers' `SiLUActivation`'s). The fused ops round as the modules do (float32 arithmetic, the normalised
row and the SiLU rounded to the model's dtype before the multiply that follows, the rotary embedding's products
and sum each rounded as torch rounds them: bit for bit Hugging Face's); only the order of the sum of squares, the
exponential's last bit and the GEMM's blocking differ, as between any two libraries: greedy tokens stay Hugging
Face's (the equivalence tests run with it). The attention itself is still the model's attention interface
(pagedlab's paged attention in the engine), called as Llama's forward calls it.

With the oneDNN linear backend the gate and up weights are packed as one [2 x intermediate, hidden] weight, and
the q, k and v weights as one [(q + 2 kv heads) x head_dim, hidden] (and not also one by one), for the products
where the packed path wins (`cpu_linear.unpacked_wins`: on an Intel CPU a decode step of up to 3 sequences
computes them with MKL on their own weights); a weight changed in place or replaced since is packed again at the
next call, as for `PackedLinears`.

# Explained in README.md (Benchmarks: the levers)
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

from pagedlab.worker import cpu_linear


@functools.cache
def _forward_tree(cls: type) -> str | None:
    """The syntax tree of a class's own `forward` (its arguments' names and its statements; annotations and the
    docstring left out), or None."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):  # defined in C, in a notebook cell that is gone, ...
        return None
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        return None
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    arguments = function.args
    names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
    names += [f"*{a.arg}" for a in (arguments.vararg, arguments.kwarg) if a is not None]
    return repr(names) + "".join(ast.dump(statement) for statement in body)


def _llama_classes() -> tuple[type, type, type, type]:
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    return LlamaRMSNorm, LlamaMLP, SiLUActivation, LlamaAttention


def is_llama_norm(module: nn.Module) -> bool:
    norm, _, _, _ = _llama_classes()
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and hasattr(module, "variance_epsilon")
            and _same_forward(type(module), norm))


def is_llama_mlp(module: nn.Module) -> bool:
    _, mlp, silu, _ = _llama_classes()
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act = type(getattr(module, "act_fn", None))
    return (all(type(p) is nn.Linear for p in parts) and (act is nn.SiLU or _same_forward(act, silu))
            and _same_forward(type(module), mlp))


def is_llama_attention(module: nn.Module) -> bool:
    *_, attention = _llama_classes()
    parts = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return (all(type(p) is nn.Linear for p in parts) and isinstance(getattr(module, "head_dim", None), int)
            and _same_forward(type(module), attention))


def _same_forward(cls: type, reference: type) -> bool:
    tree = _forward_tree(cls)
    return tree is not None and tree == _forward_tree(reference)


@dataclass
class _Stacked:
    """Linear layers of one input packed as one weight, their outputs side by side (gate and up; q, k and v)."""

    weights: tuple[torch.Tensor, ...]  # the layers' weights when packed (to see a replacement)
    versions: tuple[int, ...]  # their version counters then (to see an in-place change)
    packed: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int]  # each layer's output features


class FusedModules:
    """The fused forwards of a model's Llama-style norms, MLPs and attentions on CPU, installed for one engine call
    at a time. `kernel`: the C++ extension (`cpu_attention.kernel()`); `pack_stacked`: one oneDNN GEMM for the
    gate and up projections and one for q, k and v (the oneDNN linear backend), else the model's layers."""

    def __init__(self, model: nn.Module, kernel, pack_stacked: bool) -> None:
        self.kernel = kernel
        on_cpu = [m for m in model.modules() if _on_cpu(m)]
        self.norms = [m for m in on_cpu if is_llama_norm(m)]
        self.mlps = [m for m in on_cpu if is_llama_mlp(m)]
        self.attentions = [m for m in on_cpu if is_llama_attention(m)]
        self.pack_stacked = pack_stacked and all(
            cpu_linear.supported(layer.weight.device, layer.weight.dtype)
            for layers in self._stacks() for layer in layers)
        self._stacked_cache: dict[nn.Module, _Stacked] = {}

    def _stacks(self) -> list[tuple[nn.Linear, ...]]:
        return [_gate_up(m) for m in self.mlps] + [_qkv(m) for m in self.attentions]

    @property
    def stacked_layers(self) -> frozenset[nn.Module]:
        """The linear layers this packs itself (so that `PackedLinears` need not pack them too)."""
        if not self.pack_stacked:
            return frozenset()
        return frozenset(layer for layers in self._stacks() for layer in layers)

    def _stacked(self, owner: nn.Module, layers: tuple[nn.Linear, ...]) -> _Stacked:
        weights = tuple(layer.weight for layer in layers)
        versions = tuple(weight._version for weight in weights)
        entry = self._stacked_cache.get(owner)
        if entry is None or any(a is not b for a, b in zip(entry.weights, weights)) or entry.versions != versions:
            with torch.no_grad():
                bias = None
                if any(layer.bias is not None for layer in layers):
                    bias = torch.cat([_bias_of(layer) for layer in layers])
                packed = cpu_linear.pack(torch.cat(weights))
            sizes = [weight.shape[0] for weight in weights]  # not out_features: a tensor-parallel shard keeps it
            entry = self._stacked_cache[owner] = _Stacked(weights, versions, packed, bias, sizes)
        return entry

    def projections(self, owner: nn.Module, layers: tuple[nn.Linear, ...], rows: torch.Tensor) -> list[torch.Tensor]:
        """The layers' products of rows [n, in], each [n, out] (views into one product when packed): one GEMM on
        their stacked weight with `pack_stacked`, else each layer on its own (also where `unpacked_wins`)."""
        if not self.pack_stacked or cpu_linear.unpacked_wins(rows.shape[0], layers[0].weight):
            return [layer(rows) for layer in layers]
        entry = self._stacked(owner, layers)
        return list(cpu_linear.packed_linear(rows, entry.packed, entry.bias).split(entry.sizes, dim=-1))

    @contextlib.contextmanager
    def installed(self):
        """Route every qualifying module's forward through the fused ops until the block ends."""
        swapped = []  # set in __dict__ directly, as PackedLinears does (nn.Module.__setattr__ costs per step)
        try:
            for module in self.norms:
                swapped.append((module.__dict__, module.__dict__.get("forward")))
                module.__dict__["forward"] = functools.partial(_rms_norm, self.kernel, module)
            for module in self.mlps:
                swapped.append((module.__dict__, module.__dict__.get("forward")))
                module.__dict__["forward"] = functools.partial(_mlp, self, module)
            for module in self.attentions:
                swapped.append((module.__dict__, module.__dict__.get("forward")))
                module.__dict__["forward"] = functools.partial(_attention, self, module)
            yield
        finally:
            for attributes, own in swapped:
                if own is None:
                    del attributes["forward"]
                else:
                    attributes["forward"] = own


def _on_cpu(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if weight is None:
        weight = next(module.parameters(recurse=True), None)
    return isinstance(weight, torch.Tensor) and weight.device.type == "cpu"


def _bias_of(layer: nn.Linear) -> torch.Tensor:
    return layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.weight.shape[0])


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _rms_norm(kernel, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if x.dtype != weight.dtype or not weight.is_contiguous():  # the module's own mixes dtypes; so does it here
        return type(module).forward(module, x)
    rows = _rows(x)
    out = torch.empty_like(rows)
    kernel.rms_norm(out, rows, weight, float(module.variance_epsilon))
    return out.view(x.shape)


def _gate_up(mlp: nn.Module) -> tuple[nn.Linear, nn.Linear]:
    return mlp.gate_proj, mlp.up_proj


def _qkv(attention: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    return attention.q_proj, attention.k_proj, attention.v_proj


def _mlp(fused: FusedModules, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    gate, up = (_rows(p) for p in fused.projections(module, _gate_up(module), rows))
    act = torch.empty_like(gate, memory_format=torch.contiguous_format)
    fused.kernel.silu_and_mul(act, gate, up)
    return module.down_proj(act.view(*x.shape[:-1], act.shape[-1]))


def _attention(fused: FusedModules, module: nn.Module, hidden_states: torch.Tensor, position_embeddings=None,
               attention_mask=None, **kwargs):
    """Llama's attention forward, its q, k and v from one GEMM and their rotary embedding from one C++ pass."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    mixed = position_embeddings is not None and position_embeddings[0].dtype != hidden_states.dtype
    if position_embeddings is None or mixed or cache is not None or module.training:  # not fused: its own forward
        return type(module).forward(module, hidden_states, position_embeddings, attention_mask, **kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    input_shape, head_dim = hidden_states.shape[:-1], module.head_dim
    rows = _rows(hidden_states)
    q, k, v = (p.view(rows.shape[0], -1, head_dim) for p in fused.projections(module, _qkv(module), rows))
    cos, sin = (_rows(t.expand(*input_shape, head_dim)) for t in position_embeddings)  # [tokens, head_dim]
    query, key = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k))
    fused.kernel.rotary_embedding(query, key, q, k, cos, sin)
    shape = (*input_shape, -1, head_dim)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_attention_forward)
    out, weights = attention(module, query.view(shape).transpose(1, 2), key.view(shape).transpose(1, 2),
                             v.view(shape).transpose(1, 2), attention_mask, dropout=0.0, scaling=module.scaling,
                             **kwargs)
    return module.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
