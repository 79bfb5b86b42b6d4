"""What the engine hands back: vLLM's `RequestOutput` and `CompletionOutput`, and the engine's statistics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or None while generating
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if any
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    cumulative_logprob: float | None = None  # beam search: the sequence's summed log-probability

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
                f"; prefix cache hit rate {100 * self.prefix_cache_hit_rate:.1f}% "
                f"({self.prefix_cache_hits}/{self.prefix_cache_queries} tokens, "
                f"{self.prefix_cache_hits // self.block_size} blocks reused), {self.num_evicted_blocks} evicted"
                if self.prefix_cache_queries
                else ""
            )
        )
