"""The serving workload: the chat workload with Poisson arrivals, in-process and over HTTP.

In process, requests go straight into `LLMEngine.add_request` / `step` (no server); over HTTP, the same
requests at the same times go to `pagedlab serve` (started here on a free loopback port) or to any
OpenAI-compatible `endpoint`. Both rows at each rate show what the HTTP layer costs. Latencies are what the
caller sees: TTFT from arrival, TPOT per output token after the first, ITL between token deliveries.

# Explained in chapters/13_serving.ipynb
"""

from __future__ import annotations

import contextlib
import random

from pagedlab.bench import http_client, report, run_metrics, systems
from pagedlab.bench.report import Table

COLUMNS = ("system", "request_rate", "requests", "failed", "time_s", "requests_s", "output_tok_s", "ttft_p50_s",
           "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s", "itl_p50_s", "itl_p90_s",
           "itl_p99_s")
VIA = ("in-process", "http")


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start: exponential gaps of mean 1/rate, the first request at 0 (inf: all at 0)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(num):
        arrivals.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    return arrivals


def run(bench, workload, engine_options: dict) -> None:
    o = bench.options
    via = ("http",) if o.endpoint else tuple(o.serving_via)
    unknown = set(via) - set(VIA)
    if unknown:
        raise ValueError(f"unknown serving_via {sorted(unknown)}; choose from {', '.join(VIA)}")
    table = Table("serving: Poisson arrivals, in-process (LLMEngine.add_request / step) and over HTTP", COLUMNS)
    with contextlib.ExitStack() as stack:
        url, label = None, None
        if "http" in via and o.endpoint:
            url, label = o.endpoint.rstrip("/"), o.endpoint
        elif "http" in via:
            url = stack.enter_context(http_client.local_server(
                bench.model, bench.tokenizer, engine_options, bench.model_source, not bench.model_by_name,
                bench.threads))
            label = "pagedlab serve (HTTP)"
        for rate in o.request_rates:  # in process and over HTTP in turns, so that both see the same machine
            arrivals = poisson_arrivals(len(workload.requests), rate, o.seed)
            if "in-process" in via:
                r = bench.run(f"in-process {rate} req/s", lambda bar, a=arrivals: systems.run_pagedlab(
                    bench.model, bench.tokenizer, workload, arrivals=a, repeats=o.repeats, bar=bar, **engine_options))
                _add_row(table, "pagedlab (in-process)", rate, r, 0)
            if url is not None:
                r = bench.run(f"http {rate} req/s", lambda bar, a=arrivals: _run_http(url, workload, a, bar))
                _add_row(table, label, rate, r, r.extra["failed"])
    table.notes.append("ttft: arrival to first token; tpot: per output token after the first; itl: between token "
                       "deliveries (over HTTP: between streamed chunks)")
    bench.add_table("serving", table)
    rates = list(o.request_rates)
    if len(rates) > 1:
        series = {}
        for system in dict.fromkeys(row["system"] for row in table.rows):
            rows = [row for row in table.rows if row["system"] == system]
            for key in ("ttft", "itl"):
                series[f"{key} p50, {system}"] = ([row["request_rate"] for row in rows],
                                                  [row[f"{key}_p50_s"] for row in rows])
        bench.add_plot("serving_latency.png", lambda path: report.plot_lines(
            path, "serving: median latency vs request rate", "requests/s", "seconds", series))


def _run_http(url: str, workload, arrivals, bar) -> systems.RunResult:
    if bar is not None:
        bar.reset(total=len(workload.requests))
    timings, elapsed = http_client.send_requests(url, workload, arrivals, bar=bar)
    ok = [t for t in timings if t.error is None]
    result = systems.RunResult("http", len(workload.requests), workload.num_prompt_tokens,
                               sum(t.num_output_tokens for t in ok), [elapsed])
    result.extra = {
        "ttft_s": [t.ttft for t in ok if t.ttft is not None], "tpot_s": [t.tpot for t in ok if t.tpot is not None],
        "itl_s": [g for t in ok for g in t.chunk_gaps], "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:5], "url": url,
    }
    return result


def _add_row(table: Table, system: str, rate: float, r, failed: int) -> None:
    def p(key, q):
        return run_metrics.percentile(r.extra[key], q)

    table.add(system=system, request_rate=rate, requests=r.num_requests, failed=failed, time_s=r.elapsed_s,
              requests_s=(r.num_requests - failed) / r.elapsed_s, output_tok_s=r.output_tokens_per_s,
              **{f"{k}_p{q}_s": p(f"{k}_s", q) for k in ("ttft", "tpot", "itl") for q in (50, 90, 99)})
