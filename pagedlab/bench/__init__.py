"""`pagedlab bench`: seeded workloads run through pagedlab and its comparators in one process.

    from pagedlab.bench import run_benchmark
    report = run_benchmark("chat", compare=("hf-static", "hf-cb"), num_requests=16, out_dir="bench-out")
    print(report.text())

`run_benchmark` loads the model once (or takes one: a tiny model without a tokenizer gets token-id prompts),
runs the workload's systems, and returns a `BenchmarkReport` of tables, raw results and plots; with `out_dir`
it also writes `<workload>.json`, the tables as `<workload>.txt` and the plots as PNG. Modules: `workloads`
(what is asked), `systems` (who answers), `metrics`, `roofline`, `overhead`, `memory`, `decode` (what is
measured), `suites` (one function per workload), `report` (text, JSON, plots).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pagedlab.bench.report import Table

__all__ = ["BenchOptions", "BenchmarkReport", "run_benchmark", "WORKLOADS", "COMPARATORS"]

WORKLOADS = ("chat", "nano-vllm", "prefix", "sharing", "pressure", "serving", "overhead", "capacity", "decode",
             "calibrate")
COMPARATORS = ("hf-static", "hf-cb", "pagedlab-contiguous", "vllm")


@dataclass(frozen=True)
class BenchOptions:
    """Sizes and settings; the defaults are the full benchmark (tests shrink them)."""

    num_requests: int | None = None  # default per workload: chat 128, nano-vllm 256 x scale, prefix 64, sharing 8
    compare: tuple[str, ...] = ()
    repeats: int = 1  # pagedlab systems (calibrate: at least 3)
    hf_repeats: int = 1  # the slow Hugging Face comparators
    batch_sizes: tuple[int, ...] = (8, 16, 32, 64, 128)  # hf-static: the best of those that fit is reported
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # pagedlab's linear layers: "auto" (oneDNN on CPU for float32, and bfloat16 where the CPU computes in it),
    # "onednn", "torch"
    linear_backend: str = "auto"
    cpu_fused_ops: bool = True  # pagedlab's norms and MLPs through one-pass C++ ops on CPU (EngineConfig's)
    seed: int = 0
    prompt_len: tuple[int, int] = (20, 400)  # chat, pressure, serving
    output_mean: float = 128
    output_len: tuple[int, int] = (16, 512)
    scale: float = 1.0  # nano-vllm, calibrate
    prefix_len: int = 400  # prefix
    prefix_max_tokens: int = 32
    sharing_prompt_len: int = 256  # sharing
    sharing_max_tokens: int = 64
    sharing_n: int = 8
    beam_width: int = 4
    request_rates: tuple[float, ...] = (1.0,)  # serving
    serving_via: tuple[str, ...] = ("in-process", "http")  # serving: straight into the engine, and/or over HTTP
    endpoint: str | None = None  # serving: an OpenAI-compatible server to measure (HTTP only), else our own
    sweep_max_num_seqs: tuple[int, ...] = ()  # chat / nano-vllm
    overhead_sizes: tuple[int, ...] = (256, 1024)
    overhead_real_sizes: tuple[int, ...] = (256,)  # where a real step is timed for the share
    capacity_reservations: tuple[int, ...] = (4, 8, 16, 32)  # capacity: KV budgets, in max_model_len reservations
    decode_dtypes: tuple[str, ...] = ("float32", "bfloat16")  # decode: one attention-vs-memory grid per dtype
    decode_batch_sizes: tuple[int, ...] = (16, 64, 256)
    decode_contexts: tuple[int, ...] = (128, 512, 2048)
    decode_max_kv_gib: float | None = None  # decode: skip steps whose KV cache is larger (default: RAM / 4)
    decode_probe_mib: int = 1024  # decode: the tensor summed to measure the read bandwidth
    decode_clock: str = "wall"  # decode: "wall", or "cpu" (process CPU time: one thread on a shared machine)


@dataclass
class BenchmarkReport:
    workload: str
    description: str
    machine: dict
    options: BenchOptions
    tables: dict[str, Table] = field(default_factory=dict)
    results: list = field(default_factory=list)  # systems.RunResult, in run order
    plots: dict[str, Callable[[Path], None]] = field(default_factory=dict, repr=False)  # file name -> draw

    def text(self) -> str:
        from pagedlab.bench.report import header

        parts = [header(self.machine, self.workload, self.description)]
        parts += [table.text() for table in self.tables.values()]
        return "\n\n".join(parts)

    def as_dict(self) -> dict:
        results = []
        for r in self.results:
            extra = {k: v for k, v in r.extra.items() if k != "outputs"}
            results.append({
                "system": r.system, "num_requests": r.num_requests, "num_prompt_tokens": r.num_prompt_tokens,
                "num_output_tokens": r.num_output_tokens, "elapsed_s": r.elapsed_s, "elapsed_runs": r.elapsed_runs,
                "output_tokens_per_s": r.output_tokens_per_s, "total_tokens_per_s": r.total_tokens_per_s,
                "requests_per_s": r.requests_per_s, "peak_num_seqs": r.peak_num_seqs,
                "kv_utilization": r.kv_utilization, "num_preemptions": r.num_preemptions,
                "steady_batch": r.steady_batch, "flops_fraction": r.flops_fraction, "extra": extra,
            })
        return {
            "workload": self.workload, "description": self.description, "machine": self.machine,
            "options": dataclasses.asdict(self.options), "tables": {k: t.as_dict() for k, t in self.tables.items()},
            "results": results,
        }

    def save(self, out_dir: str | Path) -> list[Path]:
        """Write the JSON, the text tables and the plots; return the paths written."""
        from pagedlab.bench.report import write_json

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = self.workload.replace("/", "_")
        paths = [out / f"{name}.json", out / f"{name}.txt"]
        write_json(paths[0], self.as_dict())
        paths[1].write_text(self.text() + "\n")
        for file_name, draw in self.plots.items():
            draw(out / file_name)
            paths.append(out / file_name)
        return paths


class Bench:
    """What a workload function gets: the model, the options, the roofline, a progress bar, and the report
    it fills in."""

    def __init__(self, model, tokenizer, options: BenchOptions, report: BenchmarkReport, progress: bool) -> None:
        from pagedlab.bench.roofline import Roofline

        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.report = report
        self.progress = progress
        self.roofline = Roofline(model)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_token_id = pad if pad is not None else 0
        self._bar = None

    def bar(self, desc: str):
        if not self.progress:
            return None
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=1, desc=desc, unit="req", dynamic_ncols=True, file=sys.stderr)
        self._bar.set_description(desc)
        return self._bar

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def run(self, label: str, run):
        """Run one system (`run(bar)` returns a `RunResult`) and keep its result."""
        result = run(self.bar(label))
        self.report.results.append(result)
        return result

    def describe(self, workload, text: str | None = None) -> None:
        self.report.description = text or workload.description

    def add_table(self, key: str, table: Table) -> None:
        self.report.tables[key] = table

    def note(self, key: str, text: str) -> None:
        self._notes = getattr(self, "_notes", {})
        self._notes.setdefault(key, []).append(text)

    def add_plot(self, file_name: str, draw: Callable[[Path], None]) -> None:
        self.report.plots[file_name] = draw

    def finish(self) -> None:
        for key, notes in getattr(self, "_notes", {}).items():
            if key in self.report.tables:
                self.report.tables[key].notes.extend(notes)
        self.close()


def run_benchmark(
    workload: str = "chat", *, model=None, tokenizer=None, dtype: str = "auto", device: str = "cpu",
    out_dir: str | Path | None = None, progress: bool = True, options: BenchOptions | None = None, **option_values,
) -> BenchmarkReport:
    """Run one workload (see `WORKLOADS`) and return its report; write it to `out_dir` if given.

    model: None for the embedded SmolLM2 (with its tokenizer), a name or path, or a model object; a model
    object without a tokenizer gets token-id prompts. Other keyword arguments are `BenchOptions` fields.
    """
    import torch

    from pagedlab.bench import suites
    from pagedlab.bench.report import machine_info
    from pagedlab.models import load_model, resolve_device, resolve_dtype

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    options = dataclasses.replace(options or BenchOptions(), **option_values)
    unknown = set(options.compare) - set(COMPARATORS)
    if unknown:
        raise ValueError(f"unknown comparator(s) {sorted(unknown)}; choose from {', '.join(COMPARATORS)}")
    device = resolve_device(device)
    by_name = model is None or isinstance(model, str)  # then a server process can load it too
    model_source = model if by_name else None
    model, tokenizer = load_model(model, tokenizer, resolve_dtype(dtype, device), device)
    report = BenchmarkReport(workload, "", machine_info(model), options)
    bench = Bench(model, tokenizer, options, report, progress)
    bench.model_source, bench.model_by_name, bench.threads = model_source, by_name, torch.get_num_threads()
    with torch.inference_mode():  # one warm-up forward: first-call costs are no system's
        model(torch.zeros((1, 8), dtype=torch.long, device=device))
    try:
        suites.RUNNERS[workload](bench)
    finally:
        bench.finish()
    if out_dir is not None:
        report.save(out_dir)
    return report
