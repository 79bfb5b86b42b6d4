"""One function per workload: which systems it runs, in what settings, and the table (and plots) it makes.

Every function takes the `Bench` (model, tokenizer, options, roofline, progress bar) and adds its tables,
results and plots to it. Table columns are fixed per workload (`COLUMNS`), whatever ran.
"""

from __future__ import annotations

import contextlib

from pagedlab.bench import COMPARATORS, overhead, report, run_metrics, systems, workloads
from pagedlab.bench import calibrate as calibrate_suite
from pagedlab.bench import serving as serving_suite
from pagedlab.bench.report import Table

SYSTEM_COLUMNS = (
    "system", "requests", "time_s", "time_range_s", "output_tok_s", "vs_pagedlab", "total_tok_s", "peak_seqs",
    "kv_util", "peak_kv_mb", "peak_rss_mb", "same_tokens", "preemptions", "linear_flops_frac",
)
COLUMNS = {
    "chat": SYSTEM_COLUMNS,
    "nano-vllm": SYSTEM_COLUMNS,
    "prefix": ("system", "prefix_caching", "requests", "prefill_tokens", "prefill_cut", "ttft_p50_s", "time_s",
               "time_range_s", "output_tok_s", "hit_rate", "outputs_identical"),
    "sharing": ("mode", "requests", "sequences", "output_tokens", "time_s", "output_tok_s", "peak_blocks_shared",
                "peak_blocks_unshared", "saving"),
    "pressure": ("preemption_mode", "kv_blocks", "time_s", "time_range_s", "vs_recompute", "output_tok_s",
                 "preemptions", "by_recompute", "by_swap", "by_partial", "swapped_out_blocks", "swapped_in_blocks",
                 "recomputed_tokens", "outputs_identical"),
    "serving": serving_suite.COLUMNS,
    "overhead": ("num_seqs", "scheduler_ms_per_step", "real_step_ms", "share_of_step", "meets_5pct_target"),
    "capacity": ("kv_slots", "contiguous_peak", "contiguous_mean", "paged_peak", "paged_mean", "ratio_peak",
                 "ratio_mean", "paged_preemptions", "meets_3x_target"),
    "sweep": ("max_num_seqs", "time_s", "output_tok_s", "peak_seqs", "kv_util"),
    "decode": ("dtype", "batch", "context", "kv_read_mb", "step_ms", "step_range_ms", "no_attention_ms",
               "attention_ms", "attention_gb_s", "read_gb_s", "fraction_of_read", "torch_path_ms",
               "torch_path_fraction"),
    "calibrate": calibrate_suite.COLUMNS,
    "calibrate_error": calibrate_suite.ERROR_COLUMNS,
    "calibrate_serving": calibrate_suite.SERVING_COLUMNS,
}


def _engine_options(bench, workload: workloads.Workload, **overrides) -> dict:
    o = bench.options
    longest_prompt = max(r.num_prompt_tokens for r in workload.requests)
    options = dict(block_size=o.block_size, max_num_seqs=o.max_num_seqs, max_model_len=workload.max_len,
                   max_num_batched_tokens=max(o.max_num_batched_tokens, longest_prompt), seed=o.seed,
                   linear_backend=o.linear_backend, cpu_fused_ops=o.cpu_fused_ops)
    options.update(overrides)
    return options


def _chat_workload(bench) -> workloads.Workload:
    o = bench.options
    return workloads.chat(bench.tokenizer, bench.vocab_size, o.num_requests or 128, o.seed, o.prompt_len,
                          o.output_mean, o.output_len)


# -- system tables (chat, nano-vllm) --------------------------------------------------------------------------


def _range(values) -> str:
    return f"{min(values):.3g}-{max(values):.3g}"


def times_overlap(a, b) -> bool:
    """Whether two results' time ranges (min-max over their repeats) overlap: then their difference is within the
    run-to-run spread, and no conclusion."""
    return min(a.elapsed_runs) <= max(b.elapsed_runs) and min(b.elapsed_runs) <= max(a.elapsed_runs)


def versus(reference, result) -> str:
    """reference's output tokens/s over result's: 'N.NNx', or 'tie (N.NNx)' when their time ranges overlap."""
    ratio = result.elapsed_s / reference.elapsed_s
    return f"tie ({ratio:.2f}x)" if times_overlap(reference, result) and result is not reference else f"{ratio:.2f}x"


def same_tokens(reference, result) -> float | None:
    """The share of requests whose generated tokens equal the reference's (greedy, fixed lengths)."""
    if not result.token_ids or len(result.token_ids) != len(reference.token_ids):
        return None
    return sum(a == b for a, b in zip(reference.token_ids, result.token_ids)) / len(reference.token_ids)


def _static_batches_fit(workload: workloads.Workload, batch_sizes, num_slots: int) -> tuple[list[int], list[int]]:
    """The hf-static batch sizes whose modelled KV cache (left-padded rows grown to the batch's longest output)
    fits in `num_slots` token slots, pagedlab's budget; and those that do not."""
    fit, over = [], []
    for bs in sorted({min(bs, len(workload.requests)) for bs in batch_sizes}):
        peak = max(max(s.allocated for s in run_metrics.static_batch_kv(
            [r.num_prompt_tokens for r in batch], [r.max_tokens for r in batch]))
            for batch in (workload.requests[i : i + bs] for i in range(0, len(workload.requests), bs)))
        (fit if peak <= num_slots else over).append(bs)
    return fit, over


class _VLLMAlongside:
    """vLLM's timed runs alternating with pagedlab's (pagedlab, vLLM, pagedlab, vLLM, ...), so that a machine that
    slows down for a while slows both: `after_each` goes to `run_pagedlab`; vLLM is built, from the model's own
    folder in the bench model's dtype and thread count, after pagedlab's first run, whose KV budget (in bytes) and
    step budgets it then gets. The block size is vLLM's own choice (its CPU attention takes only some sizes,
    multiples of 32 here); the table's notes give it. `result()` is vLLM's `RunResult`, None if it never ran."""

    def __init__(self, bench, workload: workloads.Workload, **overrides) -> None:
        from pathlib import Path

        from pagedlab.worker.kv_cache import KVCacheSpec

        self.folder = Path(str(getattr(bench.model, "name_or_path", "") or ""))
        if not (self.folder / "config.json").exists():
            raise ValueError("the vllm comparator loads the model from its folder: give the bench a model by name or "
                             f"path (this model's name_or_path is {str(self.folder)!r})")
        self.bench, self.workload, self.overrides = bench, workload, overrides
        self.dtype = next(bench.model.parameters()).dtype
        self.bytes_per_token = KVCacheSpec.from_model_config(bench.model.config, self.dtype).bytes_per_token
        self.session: systems.VLLMSession | None = None

    def after_each(self, paged) -> None:
        if self.session is None:
            options = {k: v for k, v in _engine_options(self.bench, self.workload, **self.overrides).items()
                       if k not in ("block_size", "linear_backend", "cpu_fused_ops")}
            num_slots = paged.extra["num_kv_blocks"] * paged.extra["block_size"]
            self.session = systems.VLLMSession(
                str(self.folder), self.workload, dtype=str(self.dtype).removeprefix("torch."),
                threads=self.bench.threads, kv_cache_memory_bytes=num_slots * self.bytes_per_token, **options)
        self.session.run_once()

    def result(self):
        return self.session.result() if self.session is not None else None

    def __enter__(self) -> _VLLMAlongside:
        return self

    def __exit__(self, *exc) -> None:
        if self.session is not None:
            self.session.close()


def system_table(bench, workload: workloads.Workload, name: str) -> list:
    """Run pagedlab and the comparators on `workload`; return their results (hf-static: every batch size)."""
    from pagedlab.worker.kv_cache import KVCacheSpec

    o = bench.options
    param = next(bench.model.parameters())
    bytes_per_token = KVCacheSpec.from_model_config(bench.model.config, param.dtype).bytes_per_token
    with (_VLLMAlongside(bench, workload) if "vllm" in o.compare else contextlib.nullcontext()) as vllm_runs:
        paged = bench.run("pagedlab", lambda bar: systems.run_pagedlab(
            bench.model, bench.tokenizer, workload, repeats=o.repeats, bar=bar,
            after_each=vllm_runs.after_each if vllm_runs else None, **_engine_options(bench, workload)))
        vllm_result = vllm_runs.result() if vllm_runs else None
    results = [paged]
    hf_static_runs = []
    num_slots = paged.extra["num_kv_blocks"] * paged.extra["block_size"]
    for system in o.compare:
        if system == "pagedlab-contiguous":
            results.append(bench.run(system, lambda bar: systems.run_contiguous(
                bench.model, bench.tokenizer, workload, num_slots=num_slots, max_model_len=workload.max_len,
                max_batch_size=o.max_num_seqs, repeats=o.repeats, bar=bar)))
        elif system == "hf-static":
            fit, over = _static_batches_fit(workload, o.batch_sizes, num_slots)
            runs = [bench.run(f"hf-static(bs={bs})", lambda bar, bs=bs: systems.run_hf_static(
                bench.model, workload, batch_size=bs, pad_token_id=bench.pad_token_id, repeats=o.hf_repeats, bar=bar))
                for bs in fit]
            best = min(runs, key=lambda r: r.elapsed_s)
            results.append(best)
            hf_static_runs = runs
            bench.note(name, "hf-static: best of batch sizes " + ", ".join(
                f"{r.extra['batch_size']} ({r.output_tokens_per_s:.1f} tok/s)" for r in runs)
                + (f"; {', '.join(map(str, over))} left out: their KV cache would not fit in pagedlab's "
                   f"{num_slots} slots" if over else ""))
        elif system == "hf-cb":
            results.append(bench.run(system, lambda bar: systems.run_hf_cb(
                bench.model, workload, max_num_seqs=o.max_num_seqs, max_num_batched_tokens=o.max_num_batched_tokens,
                num_slots=num_slots, page_size=o.block_size, repeats=o.hf_repeats, bar=bar)))
        elif system == "vllm":
            vllm = bench.run(system, lambda bar: vllm_result)
            results.append(vllm)
            extra = vllm.extra
            bench.note(name, f"vllm: vLLM {extra['version']} (CPU backend) in its own environment, "
                       f"{extra['threads']} OpenMP thread(s) bound to cores {extra['VLLM_CPU_OMP_THREADS_BIND']} "
                       f"(pagedlab: {bench.threads} torch thread(s)); built in {extra['load_s']:.0f} s (untimed, "
                       f"compiling included), warmed up on {extra['warmup_requests']} requests; the same KV "
                       f"budget in bytes and step budgets, blocks of {extra['block_size']} (vLLM's choice)")
        else:
            raise ValueError(f"unknown comparator {system!r}; choose from {', '.join(COMPARATORS)}")
    if paged.extra.get("linear_backend") == "onednn" and any(s.startswith("hf") or s == "pagedlab-contiguous"
                                                              for s in o.compare):
        bench.note(name, "pagedlab's linear layers run through oneDNN on packed weights (linear_backend, the "
                   "default on CPU for float32, and for bfloat16 where the CPU computes in it), the Hugging Face "
                   "comparators' and the contiguous engine's through torch's nn.Linear: --linear-backend torch "
                   "compares the batching alone")
    roofline_batch = o.max_num_seqs
    table = Table(f"{name}: throughput per system", COLUMNS[name])
    for result in results:
        frac = bench.roofline.fraction(result.total_tokens_per_s, result.output_tokens_per_s, roofline_batch)
        result.flops_fraction = frac
        table.add(system=result.system, requests=result.num_requests, time_s=result.elapsed_s,
                  time_range_s=_range(result.elapsed_runs), output_tok_s=result.output_tokens_per_s,
                  vs_pagedlab=versus(paged, result) if result is not paged else "1.00x",
                  total_tok_s=result.total_tokens_per_s, peak_seqs=result.peak_num_seqs,
                  kv_util=result.kv_utilization,
                  peak_kv_mb=result.peak_kv_slots * bytes_per_token / 1e6 if result.peak_kv_slots else None,
                  peak_rss_mb=result.peak_rss_bytes / 1e6 if result.peak_rss_bytes is not None else None,
                  same_tokens=same_tokens(paged, result), preemptions=result.num_preemptions,
                  linear_flops_frac=frac)
    machine = bench.roofline.machine(roofline_batch)
    table.notes += [
        f"times: median of {o.repeats} run(s) for pagedlab systems and vllm (vllm's alternating with pagedlab's), "
        f"{o.hf_repeats} for Hugging Face ones, "
        "min-max in time_range_s; vs_pagedlab: pagedlab's output tok/s over the system's, 'tie' where the time ranges "
        "overlap",
        "kv_util and peak_kv_mb: measured from pagedlab's and the contiguous engine's block tables; for hf-static "
        "modelled (left-padded rows grown to the batch's longest output, as its DynamicCache does); for hf-cb its "
        "cache as allocated up front (kv_util not observable); peak_rss_mb: resident memory the run added, sampled",
        "same_tokens: share of requests whose greedy tokens equal pagedlab's (hf-static pads prompts on the left "
        "and hf-cb runs other kernels, so float rounding may flip a near-tie and everything after it)",
        f"linear_flops_frac: 2 x linear params x tokens/s (lm_head: output tokens only), one definition for every "
        f"system, over torch matmul FLOP/s on the model's linear shapes at {roofline_batch} rows "
        f"({machine / 1e9:.1f} GFLOP/s)",
        f"KV budget: {num_slots} token slots for every system; max_num_seqs {o.max_num_seqs}, max_model_len "
        f"{workload.max_len}; hf-cb: pages of {o.block_size} tokens, warmed up on "
        f"{systems.HF_CB_WARMUP_REQUESTS} requests",
    ]
    bench.add_table(name, table)
    bench.add_plot(f"{name}_throughput.png", lambda path: report.plot_throughput(
        path, f"{name}: output tokens/s", [r.system for r in results], [r.output_tokens_per_s for r in results]))
    kv_series = {r.system: [s.live / s.allocated for s in r.kv_per_step if s.allocated]
                 for r in results if r.kv_per_step}
    if kv_series:
        bench.add_plot(f"{name}_kv_utilization.png", lambda path: report.plot_kv_utilization(
            path, f"{name}: KV utilisation per step", kv_series))
    return results[:1] + hf_static_runs + [r for r in results[1:] if r not in hf_static_runs]


def chat(bench) -> None:
    workload = _chat_workload(bench)
    bench.describe(workload)
    results = system_table(bench, workload, "chat")
    if bench.options.sweep_max_num_seqs:
        sweep(bench, workload, results)


def nano_vllm(bench) -> None:
    o = bench.options
    workload = workloads.nano_vllm(bench.vocab_size, o.num_requests, o.scale, o.seed)
    bench.describe(workload)
    results = system_table(bench, workload, "nano-vllm")
    if o.sweep_max_num_seqs:
        sweep(bench, workload, results)


def _batch_limit(result, options) -> int:
    """The most sequences a system may run at once: its batch size or max_num_seqs."""
    return result.extra.get("batch_size") or options.max_num_seqs


def sweep(bench, workload: workloads.Workload, measured: list = ()) -> None:
    """Throughput of pagedlab as max_num_seqs grows (the batch the scheduler may build), drawn with the
    comparators already measured on the same workload at their own batch limits."""
    table = Table(f"{workload.name}: pagedlab throughput vs max_num_seqs", COLUMNS["sweep"])
    for m in bench.options.sweep_max_num_seqs:
        if measured and m == bench.options.max_num_seqs:
            r = measured[0]  # pagedlab at this max_num_seqs just ran: no need to run it again
        else:
            r = bench.run(f"pagedlab max_num_seqs={m}", lambda bar, m=m: systems.run_pagedlab(
                bench.model, bench.tokenizer, workload, repeats=bench.options.repeats, bar=bar,
                **_engine_options(bench, workload, max_num_seqs=m)))
        table.add(max_num_seqs=m, time_s=r.elapsed_s, output_tok_s=r.output_tokens_per_s, peak_seqs=r.peak_num_seqs,
                  kv_util=r.kv_utilization)
    bench.add_table("sweep", table)
    series = {"pagedlab": ([r["max_num_seqs"] for r in table.rows], [r["output_tok_s"] for r in table.rows])}
    for result in measured[1:]:  # [0] is pagedlab at the default max_num_seqs
        label = result.system.split("(")[0]
        xs, ys = series.setdefault(label, ([], []))
        xs.append(_batch_limit(result, bench.options))
        ys.append(result.output_tokens_per_s)
    bench.add_plot(f"{workload.name}_sweep_max_num_seqs.png", lambda path: report.plot_lines(
        path, f"{workload.name}: throughput vs max_num_seqs (batch size)", "max_num_seqs / batch size",
        "output tokens/s", series, logx=True))


# -- prefix caching -----------------------------------------------------------------------------------------


def prefix(bench) -> None:
    """pagedlab with prefix caching off and on; with `--compare vllm`, vLLM with its prefix caching on, its runs
    alternating with those of pagedlab's with caching on."""
    o = bench.options
    workload = workloads.shared_prefix(bench.tokenizer, bench.vocab_size, o.num_requests or 64, o.prefix_len,
                                       max_tokens=o.prefix_max_tokens, seed=o.seed)
    bench.describe(workload)
    table = Table("prefix: one shared system prompt, prefix caching off vs on", COLUMNS["prefix"])
    runs = {}
    with (_VLLMAlongside(bench, workload, enable_prefix_caching=True) if "vllm" in o.compare
          else contextlib.nullcontext()) as vllm_runs:
        for caching in (False, True):
            after_each = vllm_runs.after_each if caching and vllm_runs else None
            runs[caching] = bench.run(
                f"prefix caching {'on' if caching else 'off'}", lambda bar, c=caching, a=after_each:
                systems.run_pagedlab(bench.model, bench.tokenizer, workload, repeats=o.repeats, bar=bar, after_each=a,
                                     **_engine_options(bench, workload, enable_prefix_caching=c)))
        vllm = bench.run("vllm", lambda bar: vllm_runs.result()) if vllm_runs else None
    decode_tokens = sum(spec.max_tokens - 1 for spec in workload.requests)
    prefill = {c: r.extra["stats"]["num_computed_tokens"] - decode_tokens for c, r in runs.items()}
    for caching, r in runs.items():
        table.add(system="pagedlab", prefix_caching=caching, requests=r.num_requests, prefill_tokens=prefill[caching],
                  prefill_cut=1 - prefill[caching] / prefill[False],
                  ttft_p50_s=run_metrics.percentile(r.extra["ttft_s"], 50),
                  time_s=r.elapsed_s, time_range_s=_range(r.elapsed_runs), output_tok_s=r.output_tokens_per_s,
                  hit_rate=r.extra["stats"]["prefix_cache_hits"] / max(r.extra["stats"]["prefix_cache_queries"], 1),
                  outputs_identical=r.token_ids == runs[False].token_ids)
    if vllm is not None:
        table.add(system="vllm", prefix_caching=True, requests=vllm.num_requests, prefill_tokens=None,
                  prefill_cut=None, ttft_p50_s=None, hit_rate=None, time_s=vllm.elapsed_s,
                  time_range_s=_range(vllm.elapsed_runs), output_tok_s=vllm.output_tokens_per_s,
                  outputs_identical=vllm.token_ids == runs[False].token_ids)
        table.notes.append(f"vllm: vLLM {vllm.extra['version']} (CPU backend) with its prefix caching on (reset "
                           "before each run), its runs alternating with pagedlab's with caching on; the same KV "
                           f"budget in bytes, blocks of {vllm.extra['block_size']} (vLLM's choice), "
                           f"{vllm.extra['threads']} OpenMP thread(s); outputs_identical: its greedy tokens against "
                           "pagedlab's")
    table.notes.append("prefill_tokens: prompt tokens run through the model; target cut >= 80%; "
                       "ttft: every request arrives at t=0; times: medians of --repeats runs, min-max in time_range_s")
    bench.add_table("prefix", table)


# -- block sharing: parallel sampling and beam search --------------------------------------------------------


def sharing(bench) -> None:
    from pagedlab.beam_search import BeamSearchParams
    from pagedlab.sampling_params import SamplingParams

    o = bench.options
    num = o.num_requests or 8
    workload = workloads.random_prompts(bench.vocab_size, num, o.sharing_prompt_len, o.sharing_max_tokens, o.seed)
    bench.describe(workload)
    n, width = o.sharing_n, o.beam_width
    modes = {
        f"parallel n={n}": (n, lambda i, spec: SamplingParams(n=n, temperature=0.8, seed=o.seed + i,
                                                              max_tokens=spec.max_tokens, ignore_eos=True)),
        f"beam width={width}": (width, lambda i, spec: BeamSearchParams(width, spec.max_tokens, ignore_eos=True)),
    }
    table = Table("sharing: KV blocks with shared prompts (copy-on-write) vs n separate copies", COLUMNS["sharing"])
    for mode, (group, params) in modes.items():
        r = bench.run(mode, lambda bar, p=params, g=group: systems.run_pagedlab(
            bench.model, bench.tokenizer, workload, params=p, repeats=o.repeats, bar=bar,
            **_engine_options(bench, workload, max_num_seqs=max(o.max_num_seqs, num * g))))
        size = r.extra["block_size"]
        shared = max(s.allocated for s in r.kv_per_step) // size
        unshared = max(s.unshared for s in r.kv_per_step) // size
        generated = r.extra["stats"]["num_generated_tokens"]
        table.add(mode=mode, requests=num, sequences=num * group, output_tokens=generated, time_s=r.elapsed_s,
                  output_tok_s=generated / r.elapsed_s, peak_blocks_shared=shared, peak_blocks_unshared=unshared,
                  saving=1 - shared / unshared if unshared else None)
    table.notes.append("peak_blocks_unshared: the same step's block tables if every sequence held its own copy")
    bench.add_table("sharing", table)


# -- memory pressure: recompute vs swap vs auto ---------------------------------------------------------------


def pressure(bench) -> None:
    from pagedlab.bench.systems import engine_config
    from pagedlab.worker.kv_cache import KVCacheSpec

    o = bench.options
    workload = _chat_workload(bench)
    bench.describe(workload)
    size = o.block_size
    need = sum(-(-(r.num_prompt_tokens + r.max_tokens) // size) for r in workload.requests)
    biggest = max(-(-(r.num_prompt_tokens + r.max_tokens) // size) for r in workload.requests)
    pool = max(need // 4, biggest + 1)
    spec = KVCacheSpec.from_model_config(bench.model.config, next(bench.model.parameters()).dtype)
    swap_gib = 1.05 * need * spec.bytes_per_block(size) / 2**30
    has_modes = hasattr(engine_config(), "preemption_mode")
    modes = ["recompute", "swap", "auto"] if has_modes else ["recompute"]
    has_partial = hasattr(engine_config(), "enable_partial_preemption")
    table = Table(f"pressure: the chat workload on {pool} KV blocks, a quarter of the {need} it needs",
                  COLUMNS["pressure"])
    rows = [("ample KV", need, "recompute", {})] + [(m, pool, m, {}) for m in modes]
    if has_partial:  # partial preemption: the victim gives up only its tail blocks and recomputes them
        rows += [(f"partial + {m}", pool, m, {"enable_partial_preemption": True}) for m in ("recompute", "auto")]
    reference, recompute = None, None
    for label, blocks, mode, extra in rows:
        r = bench.run(f"pressure {label}", lambda bar, b=blocks, m=mode, x=extra: systems.run_pagedlab(
            bench.model, bench.tokenizer, workload, repeats=o.repeats, bar=bar, **_engine_options(
                bench, workload, num_kv_blocks=b, preemption_mode=m, swap_space=swap_gib, **x)))
        reference = reference or r.token_ids
        recompute = recompute or (r if label == "recompute" else None)
        s = r.extra["stats"]
        table.add(preemption_mode=label, kv_blocks=blocks, time_s=r.elapsed_s, time_range_s=_range(r.elapsed_runs),
                  vs_recompute=versus(r, recompute) if recompute is not None and r is not recompute else None,
                  output_tok_s=r.output_tokens_per_s,
                  preemptions=s.get("num_preemptions"), by_recompute=s.get("num_preemptions_recompute"),
                  by_swap=s.get("num_preemptions_swap"), by_partial=s.get("num_preemptions_partial"),
                  swapped_out_blocks=s.get("num_swapped_out_blocks"),
                  swapped_in_blocks=s.get("num_swapped_in_blocks"), recomputed_tokens=s.get("num_recomputed_tokens"),
                  outputs_identical=r.token_ids == reference)
    if not has_modes:
        table.notes.append("this engine has no preemption_mode option: only recompute preemption was measured")
    table.notes.append(f"swap space {swap_gib:.3g} GiB (room for every block); outputs compared with the ample run; "
                       f"times: median of {o.repeats} run(s), min-max in time_range_s; vs_recompute: how many times "
                       "faster than whole recompute preemption, 'tie' where the time ranges overlap")
    bench.add_table("pressure", table)
    labels = [row["preemption_mode"] for row in table.rows]
    values = [row["output_tok_s"] for row in table.rows]
    bench.add_plot("pressure_throughput.png", lambda path: report.plot_throughput(
        path, "pressure: output tokens/s", labels, values))


# -- online serving: Poisson arrivals ------------------------------------------------------------------------


def serving(bench) -> None:
    """In process and over HTTP (`pagedlab.bench.serving`)."""
    workload = _chat_workload(bench)
    bench.describe(workload)
    serving_suite.run(bench, workload, _engine_options(bench, workload))


# -- scheduler overhead ---------------------------------------------------------------------------------------


def scheduler_overhead(bench) -> None:
    o = bench.options
    bench.describe(None, f"scheduler + block manager per decode step at {', '.join(map(str, o.overhead_sizes))} "
                         "running sequences, model stubbed out")
    table = Table("overhead: scheduler + block manager time per step (no model compute)", COLUMNS["overhead"])
    bar = bench.bar("overhead")
    for result in overhead.measure(bench.model, bench.tokenizer, o.overhead_sizes, o.overhead_real_sizes):
        share = result.share
        table.add(num_seqs=result.num_seqs, scheduler_ms_per_step=result.scheduler_ms,
                  real_step_ms=result.real_step_ms, share_of_step=share,
                  meets_5pct_target=None if share is None else share <= 0.05)
        if bar is not None:
            bar.update(1)
    table.notes.append("real_step_ms: median decode step of the real engine at that batch with short contexts "
                       "(a lower bound on a real step, so the share is an upper bound); target <= 5% at 256")
    bench.add_table("overhead", table)


# -- capacity: concurrent sequences in one KV budget -----------------------------------------------------------


def capacity(bench) -> None:
    from pagedlab.bench.capacity import contiguous_concurrency, paged_concurrency

    o = bench.options
    workload = _chat_workload(bench)
    bench.describe(workload)
    lengths = [(r.num_prompt_tokens, r.max_tokens) for r in workload.requests]
    max_len = workload.max_len
    table = Table(f"capacity: sequences running at once in the KV budget of N contiguous reservations of "
                  f"max_model_len={max_len}", COLUMNS["capacity"])
    bar = bench.bar("capacity")
    for n in o.capacity_reservations:
        slots = n * max_len
        contiguous = contiguous_concurrency(lengths, slots, max_len, o.max_num_seqs)
        paged = paged_concurrency(lengths, slots, o.block_size, o.max_num_seqs, o.max_num_batched_tokens, max_len)
        table.add(kv_slots=slots, contiguous_peak=contiguous.peak, contiguous_mean=contiguous.mean_saturated,
                  paged_peak=paged.peak, paged_mean=paged.mean_saturated, ratio_peak=paged.peak / contiguous.peak,
                  ratio_mean=paged.mean_saturated / contiguous.mean_saturated, paged_preemptions=paged.num_preemptions,
                  meets_3x_target=min(paged.peak / contiguous.peak, paged.mean_saturated / contiguous.mean_saturated)
                  >= 3)
        if bar is not None:
            bar.update(1)
    table.notes.append("bookkeeping only (no model): the real scheduler and block manager (block size "
                       f"{o.block_size}) against the contiguous allocator in static batches; means over the steps "
                       "while requests still waited (a static batch keeps its reservations until its longest "
                       "request ends, so its live sequences thin out); target: paged >= 3x contiguous, peak and mean")
    bench.add_table("capacity", table)
    rows = table.rows
    bench.add_plot("capacity.png", lambda path: report.plot_lines(
        path, "capacity: sequences at once, mean while requests wait", "KV budget (token slots)",
        "sequences", {"paged": ([r["kv_slots"] for r in rows], [r["paged_mean"] for r in rows]),
                      "contiguous": ([r["kv_slots"] for r in rows], [r["contiguous_mean"] for r in rows])},
        logx=True))


# -- decode attention against the memory ---------------------------------------------------------------------


def decode(bench) -> None:
    import torch

    from pagedlab.bench import decode as decode_bench
    from pagedlab.worker import cpu_attention
    o = bench.options
    if o.decode_clock not in decode_bench.CLOCKS:
        raise ValueError(f"decode_clock must be one of {sorted(decode_bench.CLOCKS)}, got {o.decode_clock!r}")
    dtypes = [getattr(torch, name) for name in o.decode_dtypes]
    max_kv = int(o.decode_max_kv_gib * 2**30) if o.decode_max_kv_gib else decode_bench.physical_memory() // 4
    bench.describe(None, f"one decode step at batch {', '.join(map(str, o.decode_batch_sizes))} x context "
                         f"{', '.join(map(str, o.decode_contexts))}, {', '.join(o.decode_dtypes)}: attention "
                         "against the machine's read bandwidth")
    build = cpu_attention.load() if next(bench.model.parameters()).device.type == "cpu" else None
    bar = bench.bar("decode")
    if bar is not None:
        bar.reset(total=len(dtypes) * len(o.decode_batch_sizes) * len(o.decode_contexts))
    results, skipped = decode_bench.measure(bench.model, dtypes, o.decode_batch_sizes, o.decode_contexts,
                                            o.block_size, max(1, o.repeats), max_kv, clock=o.decode_clock,
                                            probe_bytes=o.decode_probe_mib << 20, bar=bar)
    table = Table("decode: one engine decode step vs the same forward without attention", COLUMNS["decode"])
    for r in results:
        attention = r.attention_s()
        steps = r.times["step"]
        torch_path = r.times.get("torch path")
        table.add(dtype=r.dtype, batch=r.batch, context=r.context, kv_read_mb=r.kv_read_bytes / 1e6,
                  step_ms=1e3 * r.median("step"), step_range_ms=f"{1e3 * min(steps):.0f}-{1e3 * max(steps):.0f}",
                  no_attention_ms=1e3 * r.median("no attention"), attention_ms=1e3 * attention,
                  attention_gb_s=r.kv_read_bytes / attention / 1e9 if attention > 0 else None,
                  read_gb_s=run_metrics.median(r.read_bandwidth) / 1e9, fraction_of_read=r.fraction(),
                  torch_path_ms=1e3 * r.median("torch path") if torch_path else None,
                  torch_path_fraction=r.fraction("torch path") if torch_path else None)
    kernel = "n/a (not CPU)" if build is None else (
        f"C++ kernel {'compiled' if build.compiled else 'loaded from cache'} in {build.seconds:.1f} s"
        if build.module is not None else f"C++ kernel unavailable ({build.error}): the torch path ran")
    table.notes += [
        f"medians of {max(1, o.repeats)} interleaved rounds; attention = step - no_attention; kv_read: K and V of "
        f"every context token in every layer; read_gb_s: a {o.decode_probe_mib} MiB float32 tensor summed between "
        "the same rounds; "
        f"{torch.get_num_threads()} threads; {o.decode_clock} clock; block size {o.block_size}, blocks scattered "
        "over the pool",
        f"decode attention: {kernel}; torch_path: the same step with PAGEDLAB_CPU_KERNEL=0 (gather + SDPA)",
        "goal: fraction_of_read >= 0.5 at batch 64, context 512",
    ]
    if skipped:
        table.notes.append(f"skipped (KV cache over {max_kv / 2**30:.1f} GiB, --decode-max-kv-gib): "
                           + "; ".join(skipped))
    bench.add_table("decode", table)


RUNNERS = {
    "chat": chat, "nano-vllm": nano_vllm, "prefix": prefix, "sharing": sharing, "pressure": pressure,
    "serving": serving, "overhead": scheduler_overhead, "capacity": capacity, "decode": decode,
    "calibrate": calibrate_suite.run,
}
