"""What a CUDA graph would record of a decode step, checked on a CPU.

A CUDA graph records a forward pass's kernels with their arguments once; a replay runs those kernels again on
whatever the static tensors hold, with no Python in between. On a CPU the decode graphs are exercised through
`EagerGraph`, whose replay re-runs the Python forward, so two faults that only a real recording has go unseen:

1. a host sync or a tensor built from host data inside the forward (`.item()`, `bool(t)`, `.tolist()`,
   `torch.tensor(...)`): illegal while a CUDA stream captures, so graphs would switch themselves off;
2. a value computed in Python from the step's data (a grid, a loop bound, a scalar argument of a kernel), or a
   tensor the forward reads that is not the same one at every step: frozen into the graph, the replays would
   compute with stale values (wrong tokens).

`TracingGraph` records every aten op and every Triton launch of the forward (op, shapes, strides, dtypes,
scalars, and the storage address of each tensor the forward did not allocate itself: the static tensors, the
KV cache, the weights), flags (1) at capture, and checks at every replay that the trace is exactly the
capture's, which rules out (2). What only a GPU shows: that capture works with CUDA streams and the caching
allocator, that the graphs' shared memory pool is reused safely, and the time saved (scripts/gpu_check.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("traces the kernels' launches in Triton's interpreter (on a GPU: scripts/gpu_check.py)",
                allow_module_level=True)

from pagedlab.worker.cuda_graph import EagerGraph

# aten ops that read device data on the host, or copy host data to the device: not allowed while capturing
HOST_OPS = {
    "aten._local_scalar_dense.default": "a tensor read as a Python number (.item(), int(), float())",
    "aten.item.default": "a tensor read as a Python number (.item(), int(), float())",
    "aten.is_nonzero.default": "a tensor read as a Python bool (if tensor: ...)",
    "aten.lift_fresh.default": "a tensor built from host data (torch.tensor(...))",
    "aten.nonzero.default": "an output whose shape depends on the data (nonzero, boolean indexing)",
    "aten.resolve_conj.default": "a tensor copied to the host (.tolist(), .numpy())",
}


class Trace(TorchDispatchMode):
    """Every aten op under it, with its arguments described; tensors made here are told from those read."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self.made: set[int] = set()  # storages allocated inside the forward

    def describe(self, value):
        if not isinstance(value, torch.Tensor):
            return value
        address = value.untyped_storage().data_ptr()
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, None if address in self.made else address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.events.append((str(func), tree_map(self.describe, args), tree_map(self.describe, kwargs)))
        out = func(*args, **kwargs)
        read = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in read:
                self.made.add(tensor.untyped_storage().data_ptr())  # not a view of an input: new memory
        return out


@pytest.fixture
def traced_launches(monkeypatch):
    """Triton launches join the active Trace as events; the interpreter itself runs untraced."""
    from triton.runtime.interpreter import InterpretedFunction

    active: list[Trace] = []
    run = InterpretedFunction.run

    def traced_run(self, *args, grid, warmup, **kwargs):
        if active:
            trace = active[-1]
            trace.events.append(("launch " + self.fn.__name__, grid, tree_map(trace.describe, (args, kwargs))))
        with _disable_current_modes():
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", traced_run)
    return active


def test_decode_graphs_record_no_host_sync_and_no_stale_value(traced_launches):
    from pagedlab import LLM, SamplingParams
    from tests.helpers import random_prompts, tiny_model

    problems: list[str] = []
    replays: list[int] = []
    launched: set[str] = set()

    class TracingGraph(EagerGraph):
        def traced(self) -> tuple[Trace, torch.Tensor]:
            trace = Trace()
            traced_launches.append(trace)
            try:
                with trace:
                    out = self.forward()
            finally:
                traced_launches.pop()
            return trace, out

        def capture(self, forward):
            self.forward = forward
            self.recorded, self.output = self.traced()
            launched.update(op for op, *_ in self.recorded.events if op.startswith("launch "))
            problems.extend(f"{op}: {HOST_OPS[op]}" for op, *_ in self.recorded.events if op in HOST_OPS)
            return self.output

        def replay(self) -> None:
            trace, out = self.traced()
            if trace.events != self.recorded.events:
                first = next(i for i, (a, b) in enumerate(zip(trace.events + [None], self.recorded.events + [None]))
                             if a != b)
                problems.append(f"a replay differs from its recording at event {first} of "
                                f"{len(self.recorded.events)}:\n{self.recorded.events[first:first + 1]}\n"
                                f"{trace.events[first:first + 1]}")
            replays.append(out.shape[0])
            self.output.copy_(out)

    model = tiny_model("mistral-window8")  # sliding window, GQA 2
    # linear_backend "torch": as on CUDA, where graphs are recorded (oneDNN's packed weights are CPU-only and opaque)
    llm = LLM(model, block_size=4, num_kv_blocks=64, attention_backend="triton", max_num_seqs=4, max_model_len=64,
              linear_backend="torch")
    runner = llm.llm_engine.model_runner
    assert runner.capture_decode_graphs(4, 64, graph_class=TracingGraph), "capture failed (see the warning)"
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 1, 11])]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 12, 3, 7)]  # batches of 4, 3, 2, 1
    llm.generate(prompts, params, use_tqdm=False)
    assert not problems, "\n".join(problems)
    assert launched == {"launch store_kv_kernel", "launch paged_decode_kernel"}, launched
    assert {4, 2, 1} <= set(replays), f"replayed sizes {sorted(set(replays))}"
