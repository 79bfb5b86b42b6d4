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

On a decode step a decoder layer whose parts all qualify is one C++ call (csrc/llama_layer_cpu.cpp): the same
kernels in the same order as the fused forwards above, so the same bits, without their fifty-odd torch calls from
Python (at 2 threads 6-8 ms off a SmolLM2 decode step of 22-83 ms; vLLM's CPU backend compiles its graph for the
same reason).
`decode_layer_inputs` lets through only what that call computes as the Python forwards do: decodes alone through
pagedlab's CPU attention on a full-precision cache, every product on packed weights (o_proj's and down_proj's
from `PackedLinears`), no hook anywhere in the layer (tensor parallelism's all-reduce, transformers' output
recording); every other call runs the layer's own forward.

# Explained in README.md (Benchmarks: the levers)
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import operator
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from pagedlab.worker import cpu_attention, cpu_linear
from pagedlab.worker.attention import ATTENTION_NAME


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


def is_llama_decoder_layer(module: nn.Module) -> bool:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return _same_forward(type(module), LlamaDecoderLayer)


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


@dataclass
class _LayerPlan:
    """A decoder layer's weights for the C++ `llama_decode_layer`, and what tells that they still hold."""

    checks: tuple[tuple[nn.Module, torch.Tensor, int], ...]  # (module, its weight then, its version counter then)
    modules: tuple[nn.Module, ...]  # the layer and everything in it (hooks on any of them keep the Python path)
    dtype: torch.dtype
    layer_idx: int
    head_dim: int
    attention: tuple  # the call's arguments before cos and sin
    rest: tuple  # and after the cache and step tensors


@dataclass
class _LayerPlans:
    """All decoder layers' plans as last checked, for the check once a step that they all still hold: one pass in
    C (`map`) over every weight and module. Layer by layer, between kernels that stream megabytes of weights through
    the caches, the same tests and the arguments' assembly ran cold: 45-61 us a layer, 1.4-1.8 ms a decode step
    of SmolLM2 (8 sequences, float32, 1 thread, 2-core AMD EPYC), against 0.7-0.8 ms a step this way."""

    layers: dict[nn.Module, _LayerPlan | None]
    kv_cache: torch.Tensor  # the cache the views below are of
    caches: list[tuple[torch.Tensor, ...]]  # each layer's (key cache, value cache)
    owners: list[dict]  # each checked module's parameters
    weights: list[torch.Tensor]  # its weight then
    versions: list[int]  # and that weight's version counter then
    modules: list[nn.Module]  # every module in the planned layers
    hooked: bool  # a hook on any of them (then each layer is checked on its own)
    complete: bool  # every layer planned (a layer that was not is tried again each step, as before the pass)

    def holds(self) -> bool:
        return (self.complete and all(map(operator.is_, map(operator.itemgetter("weight"), self.owners), self.weights))
                and list(map(_VERSION, self.weights)) == self.versions
                and self.hooked == _hooked(self.modules))


_VERSION = operator.attrgetter("_version")


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
        self._plans: dict[nn.Module, _LayerPlan] = {}
        self._all_plans: _LayerPlans | None = None
        # decoder layers whose norms, attention and MLP are all fused here: a decode step's layer is one C++ call
        norms, attentions, mlps = set(self.norms), set(self.attentions), set(self.mlps)
        self.layers = [m for m in on_cpu if is_llama_decoder_layer(m) and self.pack_stacked
                       and getattr(m, "input_layernorm", None) in norms
                       and getattr(m, "post_attention_layernorm", None) in norms
                       and getattr(m, "self_attn", None) in attentions and getattr(m, "mlp", None) in mlps]

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

    def decode_layer_inputs(self, layer: nn.Module, linears: cpu_linear.PackedLinears, hidden_states: torch.Tensor,
                            args: tuple, kwargs: dict) -> tuple | None:
        """The arguments of the C++ `llama_decode_layer` for this call of a decoder layer's forward, or None where
        the call is not one it computes as the Python forwards do: anything but a step of decodes alone through
        pagedlab's CPU attention on a full-precision cache, rows that `unpacked_wins` sends to MKL, a layer with
        hooks (tensor parallelism's all-reduce, transformers' output recording), a weight not packed."""
        context = kwargs.get("pagedlab_context")
        position_embeddings = kwargs.get("position_embeddings")
        if (args or context is None or position_embeddings is None
                or kwargs.get("cache", kwargs.get("past_key_values")) is not None or layer.training):
            return None
        cached = context.metadata.kernel_inputs.get("llama_decode_layer")
        if cached is None or cached[0] is not position_embeddings:  # once per step, at its first layer
            cached = context.metadata.kernel_inputs["llama_decode_layer"] = (
                position_embeddings, self._decode_step(context, linears, hidden_states, position_embeddings))
        step = cached[1]
        rest = step.layers.get(layer) if step is not None else None
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        if rest is None or rows.shape[0] != step.tokens or rows.dtype != step.dtype or not rows.is_contiguous():
            return None
        return rows, *rest

    def _decode_step(self, context, linears: cpu_linear.PackedLinears, hidden_states: torch.Tensor,
                     position_embeddings) -> _DecodeStep | None:
        """The step's inputs, shared and per layer, or None where no layer of it can take the C++ call: prefill
        rows, the Triton backend, a float8 cache (its scales), a cache or dtype the CPU kernel does not take, the
        kernel switched off (PAGEDLAB_CPU_KERNEL=0), a global forward hook. Every layer is checked here, at the
        step's first layer (`_current_plans`), so a hook that a hook registers during the forward is not seen."""
        metadata, (cos, sin) = context.metadata, position_embeddings
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        if (context.backend != "torch" or context.kv_scales is not None or metadata.prefills
                or metadata.num_decodes != rows.shape[0] or cos.dtype != rows.dtype
                or not cpu_attention.supports(rows, context.kv_cache[0][0]) or cpu_attention.kernel() is None
                or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks):
            return None
        cos, sin = (_rows(t.expand(*hidden_states.shape[:-1], t.shape[-1])) for t in position_embeddings)
        shared = (metadata.slot_mapping.to(torch.long), metadata.decode_block_tables.to(torch.long).contiguous(),
                  metadata.decode_context_lens.to(torch.long).contiguous())
        plans = self._current_plans(linears, context.kv_cache)
        tokens, layers = rows.shape[0], {}
        for layer, plan in plans.layers.items():
            if (plan is None or plan.dtype != rows.dtype or plan.head_dim != cos.shape[1]
                    or cpu_linear.unpacked_wins(tokens, plan.checks[0][1]) or (plans.hooked and _hooked(plan.modules))):
                continue
            key_cache, value_cache = plans.caches[plan.layer_idx]
            layers[layer] = (*plan.attention, cos, sin, key_cache, value_cache, *shared, *plan.rest)
        return _DecodeStep(tokens, rows.dtype, layers)

    def _current_plans(self, linears: cpu_linear.PackedLinears, kv_cache: torch.Tensor) -> _LayerPlans:
        """Every layer's plan, checked in one pass over all of them (the weights' identities and versions, the
        hooks) and made again, layer by layer, where that pass fails."""
        plans = self._all_plans
        if plans is not None and plans.kv_cache is kv_cache and plans.holds():
            return plans
        layers = {layer: self._layer_plan(layer, linears) for layer in self.layers}
        checks = [check for plan in layers.values() if plan is not None for check in plan.checks]
        modules = [m for plan in layers.values() if plan is not None for m in plan.modules]
        self._all_plans = plans = _LayerPlans(
            layers, kv_cache, [c.unbind() for c in kv_cache], [m._parameters for m, _, _ in checks],
            [w for _, w, _ in checks], [v for _, _, v in checks], modules, _hooked(modules),
            all(plan is not None for plan in layers.values()))
        return plans

    def _layer_plan(self, layer: nn.Module, linears: cpu_linear.PackedLinears) -> _LayerPlan | None:
        """The layer's weights as the C++ call takes them, made again when a weight changed in place or was
        replaced since (a few identity and version checks per call, not the packing's)."""
        plan = self._plans.get(layer)
        if plan is not None and all(m._parameters["weight"] is w and w._version == v for m, w, v in plan.checks):
            return plan
        self._plans.pop(layer, None)
        attention, mlp = layer.self_attn, layer.mlp
        norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
        dtype = norm.weight.dtype
        o, down = linears.packed(attention.o_proj), linears.packed(mlp.down_proj)
        if (o is None or down is None or attention.head_dim % 2
                or attention.config._attn_implementation != ATTENTION_NAME
                or any(n.weight.dtype != dtype or not n.weight.is_contiguous() for n in (norm, post_norm))):
            return None
        qkv, gate_up = self._stacked(attention, _qkv(attention)), self._stacked(mlp, _gate_up(mlp))
        parts = (*_qkv(attention), attention.o_proj, *_gate_up(mlp), mlp.down_proj, norm, post_norm)
        plan = self._plans[layer] = _LayerPlan(
            checks=tuple((m, m.weight, m.weight._version) for m in parts), modules=tuple(layer.modules()),
            dtype=dtype, layer_idx=attention.layer_idx, head_dim=attention.head_dim,
            attention=(norm.weight, float(norm.variance_epsilon), qkv.packed, qkv.bias,
                       qkv.sizes[0] // attention.head_dim, qkv.sizes[1] // attention.head_dim),
            rest=(float(attention.scaling), o, attention.o_proj.bias, post_norm.weight,
                  float(post_norm.variance_epsilon), gate_up.packed, gate_up.bias, down, mlp.down_proj.bias))
        return plan

    @contextlib.contextmanager
    def installed(self, linears: cpu_linear.PackedLinears | None = None):
        """Route every qualifying module's forward through the fused ops until the block ends; with `linears` (the
        oneDNN backend's packed weights, o_proj's and down_proj's among them) a decoder layer's decode steps too."""
        swapped = []  # set in __dict__ directly, as PackedLinears does (nn.Module.__setattr__ costs per step)
        try:
            for module in self.layers if linears is not None else ():
                swapped.append((module.__dict__, module.__dict__.get("forward")))
                module.__dict__["forward"] = functools.partial(_decoder_layer, self, linears, module)
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


def _decoder_layer(fused: FusedModules, linears: cpu_linear.PackedLinears, module: nn.Module,
                   hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Llama's decoder layer: a decode step in one C++ call (`FusedModules.decode_layer_inputs`), else its own
    forward (whose norms, attention and MLP run the fused forwards)."""
    inputs = fused.decode_layer_inputs(module, linears, hidden_states, args, kwargs)
    if inputs is None:
        return type(module).forward(module, hidden_states, *args, **kwargs)
    return fused.kernel.llama_decode_layer(*inputs).view(hidden_states.shape)


@dataclass
class _DecodeStep:
    """One decode step's C++ calls: the rows every layer takes, and for each layer that takes the call its
    arguments after the rows (its weights, the step's cos and sin, its cache, the step's slots, tables and
    lengths)."""

    tokens: int
    dtype: torch.dtype
    layers: dict[nn.Module, tuple]


def _hooked(modules: Iterable[nn.Module]) -> bool:
    """Whether a module's own forward hook would run on any of these (the global ones: `_decode_step`)."""
    return any(map(_FORWARD_HOOKS, modules)) or any(map(_FORWARD_PRE_HOOKS, modules))


_FORWARD_HOOKS, _FORWARD_PRE_HOOKS = operator.attrgetter("_forward_hooks"), operator.attrgetter("_forward_pre_hooks")


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
