"""What the engine hands back: vLLM's `RequestOutput` and `CompletionOutput`, and the engine's statistics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error", or None while generating
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if any
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    cumulative_logprob: float | None = None  # beam search: the sequence's summed log-probability
    error: str | None = None  # finish_reason "error": what went wrong in this request's processing

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (vLLM's name)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {token_id: logprob} (vLLM's);
    # a DELTA output carries them once, in the request's first output
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True)
class EngineStats:
    num_kv_blocks: int
    num_used_blocks: int
    peak_used_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_steps: int
    num_computed_tokens: int  # tokens run through the model (prompts, recomputation and decodes)
    num_generated_tokens: int
    num_finished: int
    num_preemptions: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found cached (not computed)
    num_evicted_blocks: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_partial: int = 0  # only the victim's tail blocks taken (enable_partial_preemption)
    num_recomputed_tokens: int = 0  # computed tokens whose KV a recompute preemption dropped
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_swapped_bytes: int = 0  # out and in
    num_swapped: int = 0  # requests in the swapped queue now
    num_cpu_blocks: int = 0
    num_used_cpu_blocks: int = 0
    kv_cache_dtype: str = "auto"  # the engine's kv_cache_dtype: "auto" (the model's dtype), "fp8", "fp8_e5m2", ...
    kv_bytes_per_token: int = 0  # K and V of one token in every layer (over all tensor-parallel ranks)

    @classmethod
    def combine(cls, *slices, **values) -> EngineStats:
        """The engine's statistics from each component's own frozen slice (`pagedlab.core.stats`: the pool's, the
        swap space's, the scheduler's, the core's) and `values` (what the device side knows)."""
        names = {f.name for f in dataclasses.fields(cls)}

        def gather(part) -> dict:
            found = {}
            for f in dataclasses.fields(part):
                value = getattr(part, f.name)
                if dataclasses.is_dataclass(value):
                    found.update(gather(value))
                elif f.name in names:
                    found[f.name] = tuple(value) if isinstance(value, list) else value
            return found

        for part in slices:
            values = {**gather(part), **values}
        return cls(**values)

    @property
    def kv_tokens_per_gib(self) -> int:
        return (1 << 30) // self.kv_bytes_per_token if self.kv_bytes_per_token else 0
    spec_num_drafts: int = 0  # speculative decoding: verifications (one sequence's drafts checked in one step)
    spec_num_draft_tokens: int = 0  # draft tokens proposed and verified
    spec_num_accepted_tokens: int = 0  # of which accepted
    spec_num_draft_tokens_per_pos: tuple[int, ...] = ()  # [i]: drafts verified at position i of their chunk
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [i]: of which accepted

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average (vLLM's mean acceptance length): the accepted drafts plus the
        one token the target draws after them."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_kv_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def __str__(self) -> str:
        return (
            f"KV blocks {self.num_used_blocks}/{self.num_kv_blocks} used ({100 * self.kv_usage:.1f}%), "
            f"peak {self.peak_used_blocks}, block size {self.block_size}; "
            f"{self.num_running} running, {self.num_waiting} waiting; {self.num_steps} steps, "
            f"{self.num_computed_tokens} tokens computed, {self.num_generated_tokens} generated, "
            f"{self.num_preemptions} preemptions"
            + (
                f" ({self.num_preemptions_recompute} recompute, {self.num_preemptions_swap} swap, "
                f"{self.num_preemptions_partial} partial; "
                f"{self.num_recomputed_tokens} tokens recomputed, {self.num_swapped_out_blocks} blocks swapped out, "
                f"{self.num_swapped_in_blocks} in)"
                if self.num_preemptions
                else ""
            )
            + (
                f"; prefix cache hit rate {100 * self.prefix_cache_hit_rate:.1f}% "
                f"({self.prefix_cache_hits}/{self.prefix_cache_queries} tokens, "
                f"{self.prefix_cache_hits // self.block_size} blocks reused), {self.num_evicted_blocks} evicted"
                if self.prefix_cache_queries
                else ""
            )
            + (
                f"; speculative decoding: {self.spec_num_accepted_tokens}/{self.spec_num_draft_tokens} draft tokens "
                f"accepted ({100 * self.spec_acceptance_rate:.1f}%), mean acceptance length "
                f"{self.spec_mean_acceptance_length:.2f} tokens per verification"
                if self.spec_num_drafts
                else ""
            )
        )
