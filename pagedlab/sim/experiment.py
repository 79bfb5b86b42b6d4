"""One playground experiment: the knobs (`Settings`), and the same workload run paged and contiguous.

`Settings` holds what the playground's sliders set: the workload (how many requests, how fast and how bursty
they arrive, prompt and output lengths, prefix sharing, samples) and the engine (block size, KV budget in token
slots, step budgets, preemption, chunked prefill, prefix caching). `run(settings)` simulates the paged engine
(`simulate`) and contiguous reservations (`simulate_contiguous`, on the same slots and budgets) and returns
both traces. Pure: the same settings give the same `Comparison`.

# Explained in chapters/14_playground.ipynb
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedlab.sim.contiguous_schedule import ContiguousTrace, simulate_contiguous
from pagedlab.sim.cost_model import Calibration, load_calibration
from pagedlab.sim.simulator import SimTrace, simulate
from pagedlab.sim.synthetic_workload import Lengths, SimRequest, make_workload


@dataclass(frozen=True)
class Settings:
    # the workload
    num_requests: int = 200
    request_rate: float = 0.4  # requests per second (math.inf: all at once); near what the calibrated engine serves
    burstiness: float = 1.0  # 1: Poisson; below 1: bursts
    prompt_kind: str = "uniform"
    prompt_mean: int = 160  # uniform: from 1/4 to 7/4 of it
    output_kind: str = "exponential"
    output_mean: int = 64
    max_len: int = 512  # prompts and outputs are each clipped to it
    shared_prefix_fraction: float = 0.0
    prefix_len: int = 128
    n: int = 1
    seed: int = 0
    # the engine
    block_size: int = 16
    kv_slots: int = 8192  # the KV budget in token slots, paged and contiguous alike
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    enable_partial_preemption: bool = False
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    contiguous_batching: str = "continuous"
    contiguous_reserve: str = "max_model_len"

    def lengths(self, kind: str, mean: int) -> Lengths:
        if kind == "uniform":
            return Lengths("uniform", mean, low=max(1, mean // 4), high=max(1, min(self.max_len, 7 * mean // 4)))
        return Lengths(kind, mean, low=1, high=self.max_len)

    def workload(self) -> tuple[SimRequest, ...]:
        return make_workload(
            self.num_requests, request_rate=self.request_rate, burstiness=self.burstiness,
            prompt_len=self.lengths(self.prompt_kind, self.prompt_mean),
            output_len=self.lengths(self.output_kind, self.output_mean),
            shared_prefix_fraction=self.shared_prefix_fraction, prefix_len=self.prefix_len, n=self.n, seed=self.seed,
        )

    def max_model_len(self, requests: tuple[SimRequest, ...]) -> int:
        """The longest request: what a contiguous reservation of max_model_len holds."""
        return max(r.num_prompt_tokens + r.output_len for r in requests)

    def engine_config(self, requests: tuple[SimRequest, ...]) -> dict:
        longest_prompt = max(r.num_prompt_tokens for r in requests)
        budget = self.max_num_batched_tokens if self.enable_chunked_prefill else max(
            self.max_num_batched_tokens, longest_prompt)
        return dict(
            block_size=self.block_size, num_kv_blocks=max(1, self.kv_slots // self.block_size),
            max_model_len=self.max_model_len(requests), max_num_seqs=max(self.max_num_seqs, self.n),
            max_num_batched_tokens=budget, preemption_mode=self.preemption_mode,
            enable_partial_preemption=self.enable_partial_preemption,
            enable_chunked_prefill=self.enable_chunked_prefill, enable_prefix_caching=self.enable_prefix_caching,
        )

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Comparison:
    settings: Settings
    requests: tuple[SimRequest, ...]
    paged: SimTrace
    contiguous: ContiguousTrace


def run(settings: Settings, calibration: Calibration | None = None) -> Comparison:
    """Simulate the settings' workload paged and contiguous. A KV budget too small for the longest request is
    a ValueError that says so."""
    calibration = calibration or load_calibration()
    requests = settings.workload()
    config = settings.engine_config(requests)
    capacity = config["num_kv_blocks"] * settings.block_size
    if config["max_model_len"] > capacity:
        raise ValueError(f"the KV budget of {settings.kv_slots} slots ({config['num_kv_blocks']} blocks of "
                         f"{settings.block_size}) cannot hold the longest request ({config['max_model_len']} "
                         "tokens): raise kv_slots")
    paged = simulate(requests, calibration=calibration, **config)
    contiguous = simulate_contiguous(  # on the same slots: if the paged cache holds a request, this does too
        requests, num_slots=settings.kv_slots, max_model_len=config["max_model_len"],
        cost_model=calibration.step_cost, max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=max(settings.max_num_batched_tokens, max(r.num_prompt_tokens for r in requests)),
        batching=settings.contiguous_batching, reserve=settings.contiguous_reserve,
    )
    return Comparison(settings, requests, paged, contiguous)

