"""Llama's RMSNorm and MLP on CPU in fewer passes: one C++ pass for the norm, one GEMM for the gate and up projections
and one pass for SiLU-and-multiply, for the duration of an engine call.

A Hugging Face `LlamaRMSNorm` runs six torch operators, each reading and writing the whole row block (a widening
copy, pow, mean, add, rsqrt, two multiplies), and `LlamaMLP` two projections, a SiLU and a multiply. On a CPU
those are memory traffic on a prefill (a 1,600-token chunk: 3.1 ms a norm against 0.34 ms fused) and operator
dispatch on a decode step (72 us against 6 us at 32 rows); vLLM's CPU backend fuses them the same way (its own
model code, compiled). Here the model object stays the user's: as `cpu_linear.PackedLinears` does for the linear
layers, `FusedModules.installed()` routes the forward of each module that qualifies through the fused ops and
restores the module's own afterwards.

A module qualifies when its class's `forward` is Llama's, statement for statement (compared as syntax trees, so
Mistral's and Qwen2's copies qualify and Gemma's `1 + weight` norm does not), on CPU, with the MLP's activation a
SiLU (`nn.SiLU`, or a module whose forward is transformers' `SiLUActivation`'s). The fused ops round as the
modules do (float32 arithmetic, the normalised row and the SiLU rounded to the model's dtype before the multiply
that follows); only the order of the sum of squares, the exponential's last bit and the GEMM's blocking differ, as
between any two libraries: greedy tokens stay Hugging Face's (the equivalence tests run with it).

With the oneDNN linear backend the gate and up weights are packed as one [2 x intermediate, hidden] weight (and not
also one by one), for the products where the packed path wins (`cpu_linear.unpacked_wins`: a decode step of up
to 3 sequences computes the two with MKL on their own weights); a weight changed in place or replaced since is
packed again at the next call, as for `PackedLinears`.

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


def _llama_classes() -> tuple[type, type, type]:
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    return LlamaRMSNorm, LlamaMLP, SiLUActivation


def is_llama_norm(module: nn.Module) -> bool:
    norm, _, _ = _llama_classes()
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and hasattr(module, "variance_epsilon")
            and _same_forward(type(module), norm))


def is_llama_mlp(module: nn.Module) -> bool:
    _, mlp, silu = _llama_classes()
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act = type(getattr(module, "act_fn", None))
    return (all(type(p) is nn.Linear for p in parts) and (act is nn.SiLU or _same_forward(act, silu))
            and _same_forward(type(module), mlp))


def _same_forward(cls: type, reference: type) -> bool:
    tree = _forward_tree(cls)
    return tree is not None and tree == _forward_tree(reference)


@dataclass
class _GateUp:
    weights: tuple[torch.Tensor, torch.Tensor]  # gate's and up's weights when packed (to see a replacement)
    versions: tuple[int, int]  # their version counters then (to see an in-place change)
    packed: torch.Tensor
    bias: torch.Tensor | None


class FusedModules:
    """The fused forwards of a model's Llama-style norms and MLPs on CPU, installed for one engine call at a time.
    `kernel`: the C++ extension (`cpu_attention.kernel()`); `pack_gate_up`: one oneDNN GEMM for the gate and up
    projections (the oneDNN linear backend), else the model's two layers."""

    def __init__(self, model: nn.Module, kernel, pack_gate_up: bool) -> None:
        self.kernel = kernel
        on_cpu = [m for m in model.modules() if _on_cpu(m)]
        self.norms = [m for m in on_cpu if is_llama_norm(m)]
        self.mlps = [m for m in on_cpu if is_llama_mlp(m)]
        self.pack_gate_up = pack_gate_up and all(
            cpu_linear.supported(m.gate_proj.weight.device, m.gate_proj.weight.dtype) for m in self.mlps)
        self._gate_up: dict[nn.Module, _GateUp] = {}

    @property
    def gate_up_layers(self) -> frozenset[nn.Module]:
        """The linear layers this packs itself (so that `PackedLinears` need not pack them too)."""
        if not self.pack_gate_up:
            return frozenset()
        return frozenset(layer for m in self.mlps for layer in (m.gate_proj, m.up_proj))

    def _packed_gate_up(self, mlp: nn.Module) -> _GateUp:
        gate, up = mlp.gate_proj, mlp.up_proj
        weights, versions = (gate.weight, up.weight), (gate.weight._version, up.weight._version)
        entry = self._gate_up.get(mlp)
        if entry is None or any(a is not b for a, b in zip(entry.weights, weights)) or entry.versions != versions:
            with torch.no_grad():
                bias = None
                if gate.bias is not None or up.bias is not None:
                    bias = torch.cat([_bias_of(gate), _bias_of(up)])
                packed = cpu_linear.pack(torch.cat(weights))
            entry = self._gate_up[mlp] = _GateUp(weights, versions, packed, bias)
        return entry

    def gate_up(self, mlp: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """An MLP's gate and up projections of rows [n, hidden], side by side: [n, 2 x intermediate]; one GEMM on
        their packed weights with `pack_gate_up`, else the model's two layers."""
        if not self.pack_gate_up or cpu_linear.unpacked_wins(rows.shape[0], mlp.gate_proj.weight):
            return torch.cat([mlp.gate_proj(rows), mlp.up_proj(rows)], dim=-1)
        entry = self._packed_gate_up(mlp)
        return cpu_linear.packed_linear(rows, entry.packed, entry.bias)

    @contextlib.contextmanager
    def installed(self):
        """Route every qualifying module's forward through the fused ops until the block ends."""
        swapped = []  # set in __dict__ directly, as PackedLinears does (nn.Module.__setattr__ costs per step)
        try:
            for module in self.norms:
                swapped.append((module.__dict__, module.__dict__.get("forward")))
                module.__dict__["forward"] = functools.partial(_rms_norm, self.kernel, module)
            for module in self.mlps:
                packed = self._packed_gate_up(module) if self.pack_gate_up else None
                swapped.append((module.__dict__, module.__dict__.get("forward")))
                module.__dict__["forward"] = functools.partial(_mlp, self.kernel, module, packed)
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
    return layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features)


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


def _mlp(kernel, module: nn.Module, packed: _GateUp | None, x: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    if packed is not None and not cpu_linear.unpacked_wins(rows.shape[0], module.gate_proj.weight):
        gate_up = cpu_linear.packed_linear(rows, packed.packed, packed.bias)
        inter = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        gate, up = _rows(module.gate_proj(rows)), _rows(module.up_proj(rows))
    act = torch.empty_like(gate, memory_format=torch.contiguous_format)
    kernel.silu_and_mul(act, gate, up)
    return module.down_proj(act.view(*x.shape[:-1], act.shape[-1]))
