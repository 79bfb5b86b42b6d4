"""The model's linear layers on CPU through oneDNN, with their weights packed once into its blocked layout.

`torch.nn.Linear` on CPU calls MKL's sgemm on the weight as it lies in memory. oneDNN (the library behind
torch's `mkldnn` ops, which Inductor and vLLM's CPU backend use for the same reason) does better on the
engine's shapes once the weight is reordered into its own tiles: measured on a 2-core AMD EPYC (AVX2), float32,
SmolLM2-135M's shapes, the packed path is 1.2-1.5x faster for 32 to 2,048 rows, and the 49,152-row LM head,
which MKL does not spread over a second thread, 2.8x faster at 32 rows on two threads (`scripts/bench_cpu_linear.py`).

Not for the fewest rows: up to 3, MKL has a kernel of its own that streams the weight faster than oneDNN's, whose
call also costs some 20-30 us more before it multiplies anything. Measured on a 2-core Intel Xeon (AVX-512),
float32, 1 thread, MKL against packed: one row of k_proj (192 x 576) 11 against 30 us, of q_proj (576 x 576) 42
against 69, of down_proj (576 x 1,536) 202 against 272, of the LM head 9.5 against 9.1 ms, three rows of it 10.9
against 11.4; at 4 rows MKL changes kernels and the packed path wins from the MLP up; at 2 threads the same
order. So on an Intel CPU a float32 product of at most `UNPACKED_ROWS` rows (a decode step of up to 3
sequences) goes to `nn.Linear`'s MKL on the module's own weight (`unpacked_wins`), larger ones to the packed copy.
The decode step of one or two sequences: 72 -> 66 ms at 1 thread, 54-57 -> 46 ms at 2
(`scripts/bench_unpacked_rows.py`). Only there: MKL chooses its fast kernels by the CPU's vendor, and on an AMD
EPYC (with AVX-512 too) it runs its generic code (`mkl_blas_def_xsgemv`), so the same rule made those steps
1.1-3.2x longer (2 threads: 1 sequence 38.0 -> 56.6 ms, 3 sequences 35.6 -> 114). Every other CPU packs every product.

The model object stays the user's: `PackedLinears(model)` keeps the packed copies beside it (a second copy of
each weight, the price of the layout), and `installed()` routes each plain `nn.Linear` through its copy for the
duration of one engine call only, restoring the module's own forward afterwards. A weight changed in place
since it was packed (a training step between two engine calls: its version counter moved) or replaced (a
tensor-parallel shard) is packed again at the next call. Hooks on a module (tensor parallelism's all-reduce)
still run: only `forward` is swapped.

Packing changes the order of the float additions, not the arithmetic: logits move by a few ulps, as they do
between any two GEMM libraries; greedy tokens stay those of Hugging Face's `generate()` (the equivalence tests
run with it).

# Explained in README.md (Benchmarks: the `vllm` comparator, the levers, measured)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROW_HINT = 32  # oneDNN picks its weight tiles for a typical row count; any row count computes correctly
MKL_ROWS = 3  # up to this many rows, MKL on the weight as it lies is faster on an Intel CPU (float32; measured above)
_DTYPES = (torch.float32, torch.bfloat16)


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights can take the packed path: float32 or bfloat16 on CPU, with oneDNN in this torch build."""
    return device.type == "cpu" and dtype in _DTYPES and torch.backends.mkldnn.is_available()


def preferred(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `linear_backend="auto"` packs: float32 wherever it can, bfloat16 where the CPU has bfloat16
    arithmetic (AVX512-BF16, AMX; `mkldnn._is_mkldnn_bf16_supported`). Measured on a 2-core AMD EPYC with
    AVX512-BF16, 1 thread, the chat bench's 32 requests: bfloat16 41.0 s packed against 55.7 s with `nn.Linear`
    (medians of 2 alternated runs, the same greedy tokens); on a CPU without it, unmeasured, `nn.Linear` stays."""
    if not supported(device, dtype):
        return False
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class _Packed:
    weight: torch.Tensor  # the module's weight when it was packed (to see a replacement)
    version: int  # its version counter then (to see an in-place change)
    packed: torch.Tensor  # oneDNN's copy
    forward: object  # the module's forward through it, made once per packing (not per step)


class PackedLinears:
    """Packed copies of a model's plain `nn.Linear` weights, installed for the duration of an engine call."""

    def __init__(self, model: nn.Module, skip: frozenset[nn.Module] = frozenset()) -> None:
        """`skip`: linear layers left unpacked because something else computes them (`cpu_fused`'s gate and up
        projections, packed there as one)."""
        linears = (m for m in model.modules() if type(m) is nn.Linear and m not in skip)
        self.modules = [m for m in linears if supported(m.weight.device, m.weight.dtype)]
        self._packed: dict[nn.Module, _Packed] = {}
        self.num_packs = 0  # weights packed so far (a repack after a change counts again)
        for module in self.modules:
            self._current(module, module.weight)

    def _current(self, module: nn.Linear, weight: torch.Tensor) -> _Packed:
        entry = self._packed.get(module)
        if entry is None or entry.weight is not weight or entry.version != weight._version:
            packed = pack(weight)
            entry = self._packed[module] = _Packed(weight, weight._version, packed, _forward(packed, module))
            self.num_packs += 1
        return entry

    def packed(self, module: nn.Module) -> torch.Tensor | None:
        """The module's weight as packed now (packed again if it changed), or None where it is not packed here."""
        if module not in self._packed or not supported(module.weight.device, module.weight.dtype):
            return None
        return self._current(module, module.weight).packed

    @contextlib.contextmanager
    def installed(self):
        """Route every packed module's forward through oneDNN until the block ends."""
        # The instance attribute is set in the module's __dict__ directly: nn.Module.__setattr__ checks its
        # parameters, buffers and submodules first, and ~200 of those per step cost 1-2% of a CPU decode step.
        swapped = []
        try:
            for module in self.modules:
                weight = module.weight
                if not supported(weight.device, weight.dtype):  # moved or converted since: its own forward
                    continue
                attributes = module.__dict__
                swapped.append((attributes, attributes.get("forward")))
                attributes["forward"] = self._current(module, weight).forward
            yield
        finally:
            for attributes, own in swapped:
                if own is None:
                    del attributes["forward"]
                else:
                    attributes["forward"] = own


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a [out, in] weight in oneDNN's blocked layout, for `packed_linear`."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROW_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, the weight packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def cpu_vendor() -> str | None:
    """The CPU's vendor as the kernel reports it ("GenuineIntel", "AuthenticAMD"), or None where it does not."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def unpacked_rows(vendor: str | None) -> int:
    """How many rows at most go to MKL on a CPU of this vendor: `MKL_ROWS` on Intel's, none elsewhere."""
    return MKL_ROWS if vendor == "GenuineIntel" else 0


UNPACKED_ROWS = unpacked_rows(cpu_vendor())  # this machine's


def unpacked_wins(rows: int, weight: torch.Tensor) -> bool:
    """Whether `rows` rows times this weight are faster through MKL on the weight itself than through its packed
    copy: up to `UNPACKED_ROWS` rows (3 on an Intel CPU, none elsewhere), in float32 (measured; bfloat16 was not)."""
    return rows <= UNPACKED_ROWS and weight.dtype == torch.float32


def _forward(packed: torch.Tensor, module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if unpacked_wins(x.numel() // x.shape[-1], module.weight):
            return F.linear(x, module.weight, module.bias)
        return packed_linear(x, packed, module.bias)

    return forward
