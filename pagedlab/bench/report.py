"""Tables as text and JSON, the machine they were measured on, and the plots (PNG, matplotlib's Agg backend).

A `Table` is a title, its columns and one dict per row; a workload's table always has every one of its
columns (None where a system cannot say), so the text, the JSON and the tests read the same thing.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Table:
    title: str
    columns: tuple[str, ...]
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, **row) -> None:
        missing, unknown = set(self.columns) - set(row), set(row) - set(self.columns)
        if missing or unknown:
            raise ValueError(f"{self.title}: row is missing {sorted(missing)}, has unknown {sorted(unknown)}")
        self.rows.append(row)

    def text(self) -> str:
        cells = [list(self.columns)] + [[_cell(row[c]) for c in self.columns] for row in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = [self.title, ""]
        for n, r in enumerate(cells):
            lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"title": self.title, "columns": list(self.columns), "rows": self.rows, "notes": self.notes}


def _cell(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:,.0f}"
        if magnitude >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def cpu_model() -> str:
    """The CPU's model name and the widest vector instructions torch's kernels use on it ("AMD EPYC with AVX512"):
    machines of one name differ in that (AVX2 on one day's EPYC, AVX-512 on another's), and speeds with it."""
    import torch

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} with {torch.backends.cpu.get_cpu_capability()}"


def machine_info(model) -> dict:
    import torch
    import transformers

    import pagedlab

    param = next(model.parameters())
    device = param.device
    return {
        "cpu": cpu_model(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "dtype": str(param.dtype).removeprefix("torch."),
        "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
        "num_params": sum(p.numel() for p in model.parameters()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pagedlab": pagedlab.__version__,
    }


def header(machine: dict, workload: str, description: str) -> str:
    m = machine
    return (
        f"pagedlab bench --workload {workload}: {description}\n"
        f"machine: {m['cpu']} ({m['device']}), {m['threads']} threads; model {m['model']} "
        f"({m['num_params'] / 1e6:.0f}M params, {m['dtype']}); torch {m['torch']}, transformers "
        f"{m['transformers']}, pagedlab {m['pagedlab']}"
    )


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    return str(value)


# -- plots --------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(path: Path, title: str, labels: list[str], values: list[float], ylabel: str = "output tokens/s"):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(labels)), 3.5))
    bars = ax.bar(labels, values, color="#4C72B0")
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_kv_utilization(path: Path, title: str, series: dict[str, list[float]]):
    """KV utilisation (live / allocated slots) per step, each system's run stretched to the same width."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for label, values in series.items():
        if values:
            xs = [i / max(len(values) - 1, 1) for i in range(len(values))]
            ax.plot(xs, [100 * v for v in values], label=label, linewidth=1.2)
    ax.set_xlabel("share of the run (steps)")
    ax.set_ylabel("KV slots holding tokens (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]], logx=False):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
