"""A quantised KV cache: K and V stored as 8-bit floats with one scale per layer for K and one for V.

    stored = saturate(x / scale)  as float8          (on write: `quantize`)
    x      ~ stored.to(compute dtype) * scale         (on read: `dequantize`, tile by tile, inside attention)

`kv_cache_dtype` takes vLLM's names: "auto" (the model's dtype), "fp8" (= "fp8_e4m3": 4 exponent bits, 3
mantissa bits, range +-448) and "fp8_e5m2" (5 and 2, range +-57344). The scales default to 1.0, as in vLLM;
with `calculate_kv_scales` each layer's scales are set once, from the first batch it writes (amax / (max / 2),
leaving 2x headroom for later tokens, like vLLM's K/V scale constants of 200 and 100 against e4m3's 448).
Scales are per layer, so swapping, copy-on-write and prefix caching move float8 blocks and nothing else.

# Explained in chapters/10_quantised_kv.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's own dtype
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_HEADROOM = 2.0  # calculated scales map the first batch's largest |x| to max / SCALE_HEADROOM


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache is stored in, for vLLM's `kv_cache_dtype` name."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale, saturated to the format's largest finite value (e5m2 would overflow to inf), as `dtype`."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """The stored values back in the compute dtype: x * scale."""
    return x.to(dtype) * scale


def relative_error_bound(dtype: torch.dtype) -> float:
    """Round-to-nearest's worst relative error on normal numbers: half a unit in the last place, 2^-(mantissa+1)."""
    mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    return 2.0 ** -(mantissa_bits + 1)


@dataclass
class KVScales:
    """The K and V scale of every layer, `scales[layer] = (k_scale, v_scale)`, float32 on the cache's device.

    calculate: the next write to a layer not yet in `calculated` sets that layer's scales from its K and V
    (vLLM's calculate_kv_scales); the worker switches it on after its start-up runs, so that the first real
    batch, not a warm-up of random tokens, decides them.

    Invariants: scales > 0 and finite; a layer's scales change at most once, before any of its K/V is stored.
    """

    scales: torch.Tensor  # [num_layers, 2] float32
    dtype: torch.dtype  # the float8 storage dtype
    calculate: bool = False
    calculated: set[int] = field(default_factory=set)

    @classmethod
    def ones(cls, num_layers: int, dtype: torch.dtype, device: torch.device) -> KVScales:
        return cls(torch.ones(num_layers, 2, dtype=torch.float32, device=device), dtype)

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Before storing a layer's first K/V: set its scales from them, if asked to (see the class docstring)."""
        if not self.calculate or layer in self.calculated:
            return
        amax = torch.stack([key.detach().abs().amax(), value.detach().abs().amax()]).float()
        scale = amax * SCALE_HEADROOM / torch.finfo(self.dtype).max
        self.scales[layer] = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.calculated.add(layer)

    def check_invariants(self) -> None:
        assert bool(torch.isfinite(self.scales).all()) and bool((self.scales > 0).all()), self.scales
