"""How close a system comes to the machine on the model's linear layers (most of a decoder's FLOPs).

achieved = (2 x body linear params x tokens/s  +  2 x lm_head params x output tokens/s)
machine  = measured torch matmul FLOP/s at the same shapes: x [batch, in] @ W.T [in, out] for every linear
           layer of the model, at the system's steady-state batch (tokens per step), in the model's dtype.

The fraction achieved / machine says how much of the matmul speed the system turns into useful tokens;
padding, wasted steps, attention and Python overhead all lower it.
"""

from __future__ import annotations

import time
from collections import Counter

import torch


def linear_shapes(model: torch.nn.Module) -> tuple[Counter, tuple[int, int] | None]:
    """Counts of (in_features, out_features) over the body's linear layers, and the lm_head's shape."""
    head = model.get_output_embeddings()
    body: Counter = Counter()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            body[(module.in_features, module.out_features)] += 1
    head_shape = (head.in_features, head.out_features) if isinstance(head, torch.nn.Linear) else None
    return body, head_shape


def linear_params(model: torch.nn.Module) -> tuple[int, int]:
    """(weights of the body's linear layers, weights of the lm_head)."""
    body, head = linear_shapes(model)
    return sum(i * o * n for (i, o), n in body.items()), (head[0] * head[1] if head else 0)


def matmul_flops(model: torch.nn.Module, batch: int, min_time: float = 0.2) -> float:
    """The machine's FLOP/s on the body's linear shapes at `batch` rows: one pass over every distinct shape,
    weighted by how often the model has it, repeated until `min_time` seconds have passed (median pass)."""
    body, _ = linear_shapes(model)
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    batch = max(1, int(batch))
    operands = [(torch.randn(batch, i, dtype=dtype, device=device), torch.randn(o, i, dtype=dtype, device=device), n)
                for (i, o), n in body.items()]
    flops = sum(2 * batch * x.shape[1] * w.shape[0] * n for x, w, n in operands)
    times = []
    with torch.inference_mode():
        for x, w, _ in operands:  # warm-up
            torch.nn.functional.linear(x, w)
        start = time.perf_counter()
        while time.perf_counter() - start < min_time or len(times) < 3:
            total = 0.0
            for x, w, n in operands:
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                total += (time.perf_counter() - t0) * n
            times.append(total)
    times.sort()
    return flops / times[len(times) // 2]


class Roofline:
    """Measures the machine once per batch size (kept here, not in a global) and scores results."""

    def __init__(self, model: torch.nn.Module, min_time: float = 0.2) -> None:
        self.model = model
        self.min_time = min_time
        self.body_params, self.head_params = linear_params(model)
        self.machine_flops: dict[int, float] = {}  # batch -> measured FLOP/s

    def machine(self, batch: int) -> float:
        batch = max(1, int(batch))
        if batch not in self.machine_flops:
            self.machine_flops[batch] = matmul_flops(self.model, batch, self.min_time)
        return self.machine_flops[batch]

    def achieved(self, total_tokens_per_s: float, output_tokens_per_s: float) -> float:
        return 2 * self.body_params * total_tokens_per_s + 2 * self.head_params * output_tokens_per_s

    def fraction(self, total_tokens_per_s: float, output_tokens_per_s: float, batch: int) -> float:
        return self.achieved(total_tokens_per_s, output_tokens_per_s) / self.machine(batch)
