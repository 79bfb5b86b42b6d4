"""Prometheus metrics of a running server, under vLLM's names with a `pagedlab:` prefix.

`PrometheusStatLogger.record(stats, iteration)` is called by `AsyncLLM` after every step and abort: gauges
take the engine's current state, counters grow by what the engine's cumulative counters grew, histograms
get each step's tokens and each finished request's tokens, latency and phases (queued, prefill, decode; the
prefill is the step that gave the first token, exact when a prompt is prefilled in one step). Each logger
owns its own `CollectorRegistry` (no global state), so several servers can live in one process. `render()`
is the text `/metrics` serves.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedlab.outputs import EngineStats

__all__ = ["CONTENT_TYPE_LATEST", "PrometheusStatLogger", "parse_metrics"]

# Seconds; CPU steps take tens to hundreds of milliseconds, GPU steps a few: both ends are covered.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for per-request token counts)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1

# Engine counter (cumulative in EngineStats) -> (metric attribute, label values)
_COUNTED = {
    "prefix_cache_queries": ("prefix_cache_queries", ()),
    "prefix_cache_hits": ("prefix_cache_hits", ()),
    "num_preemptions_recompute": ("num_preemptions", ("recompute",)),
    "num_preemptions_swap": ("num_preemptions", ("swap",)),
    "num_preemptions_partial": ("num_preemptions", ("partial",)),
    "num_swapped_out_blocks": ("swapped_blocks", ("out",)),
    "num_swapped_in_blocks": ("swapped_blocks", ("in",)),
    "num_swapped_bytes": ("swapped_bytes", ()),
    "num_recomputed_tokens": ("recomputed_tokens", ()),
}


class PrometheusStatLogger:
    """The server's metrics for one model. Metric names are vLLM's (`vllm:` -> `pagedlab:`) where vLLM has
    one; swap and partial-preemption counters are pagedlab's own."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, prefix: str = "pagedlab:",
                 max_model_len: int = 8192) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r, p = self.registry, prefix

        def gauge(name, doc):
            return Gauge(p + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc, extra=()):
            metric = Counter(p + name, doc, labels + list(extra), registry=r)
            return metric if extra else metric.labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(p + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests running in the last step.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests swapped out to the CPU block pool.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage: share of blocks in use (1 = full).")
        self.num_kv_blocks_used = gauge("num_kv_blocks_used", "KV blocks in use.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got their first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Preemptions, by mode (partial: only tail blocks taken).",
                                       ("mode",))
        self.swapped_blocks = counter("swapped_blocks", "KV blocks swapped, by direction.", ("direction",))
        self.swapped_bytes = counter("swapped_bytes", "Bytes of KV swapped out and in.")
        self.recomputed_tokens = counter("recomputed_tokens", "Computed tokens dropped by recompute preemptions.")
        self.request_success = counter("request_success", "Finished requests, by finish reason of their first sample.",
                                       ("finished_reason",))
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens of each finished request.", token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Prompt tokens of the requests that got their "
                                          "first token, and generated tokens, per step.", _ITERATION_TOKEN_BUCKETS)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Between a request's token steps.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Arrival to the start of the step that gave the first token (exact for one-step prefills).",
            _LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram("request_prefill_time_seconds", "The step that gave the first token.",
                                              _LATENCY_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                             _LATENCY_BUCKETS)
        self._last: dict[str, int] = {}
        for mode in ("recompute", "swap", "partial"):  # every labelled series shows from the start, at 0
            self.num_preemptions.labels(model_name, mode)
        for direction in ("out", "in"):
            self.swapped_blocks.labels(model_name, direction)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)

    def record(self, stats: EngineStats, iteration=None) -> None:
        """Take the engine's state after a step or an abort, and the step's measurements if any."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.num_kv_blocks_used.set(stats.num_used_blocks)
        for field_name, (attribute, label_values) in _COUNTED.items():
            value = getattr(stats, field_name)
            grown = value - self._last.get(field_name, 0)
            self._last[field_name] = value
            if grown > 0:
                metric = getattr(self, attribute)
                (metric.labels(self.model_name, *label_values) if label_values else metric).inc(grown)
        if iteration is None:
            return
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        if iteration.is_step:
            self.iteration_tokens.observe(iteration.num_prompt_tokens + iteration.num_generation_tokens)
        for value in iteration.time_to_first_tokens:
            self.time_to_first_token.observe(value)
        for value in iteration.inter_token_latencies:
            self.inter_token_latency.observe(value)
        for finished in iteration.finished:
            self.request_success.labels(self.model_name, str(finished.finish_reason)).inc()
            self.e2e_request_latency.observe(finished.e2e_latency)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            if finished.queue_time is not None:
                self.request_queue_time.observe(finished.queue_time)
                self.request_prefill_time.observe(finished.prefill_time)
                self.request_decode_time.observe(finished.decode_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {"name{labels}": value} (samples only; for tests, notebooks and the benchmark)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
