"""The compiled-forward lever, measured: the chat workload with the model's forward compiled by Inductor against
the engine's eager forward, in one process, runs alternating (eager, compiled, eager, compiled, ...).

    .venv/bin/python scripts/compile_lever.py --threads 1 --rounds 2
    .venv/bin/python scripts/compile_lever.py --threads 1 --mode freeze
    python scripts/compile_lever.py --device cuda --dtype bfloat16   # what `make gpu-check` runs

`--mode compile`: `torch.compile(model, dynamic=True)` with pagedlab's paged attention and each packed oneDNN linear
layer behind a `torch.library.custom_op` (opaque to the compiler, so the graph does not break at every layer, as
vLLM's CPU backend does with its own ops); Inductor fuses the norms, RoPE, activations and residual adds between
them. `--mode freeze`: the same with the model's own linear layers and Inductor's weight freezing (it then packs
the weights for oneDNN itself). The attention op reads the step's `PagedAttentionContext` from a context variable
set around each call, as vLLM's forward context does, so the graph sees only q, k and v.

On a GPU (`--device cuda`) the model's own linear layers stay (there is no packing there), the attention op runs
pagedlab's Triton kernels, and both sides run with `enforce_eager=True`, so that the compiled forward is compared
with the eager one rather than with the engine's CUDA graphs (`scripts/gpu_check.py` times those).

This is a measurement, not an engine option: it swaps `ModelRunner._forward` for the script's run. It prints each
run's seconds (the first compiled one includes compiling: it compiles three times, once for the warm-up's shapes,
again for the first real step, then with dynamic sizes), the medians, and how many requests' greedy tokens differ
from the eager forward's.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import statistics
import time

import torch
from transformers import AttentionInterface

from pagedlab.bench import systems, workloads
from pagedlab.bench.report import cpu_model
from pagedlab.models import load_model
from pagedlab.worker import attention, cpu_linear, model_runner

CONTEXT: contextvars.ContextVar = contextvars.ContextVar("pagedlab_attention_context")
PACKED: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}  # key -> packed weight, bias, out features


class _Layer:
    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


@torch.library.custom_op("pagedlab_lever::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scaling: float,
                    sliding_window: int) -> torch.Tensor:
    out, _ = attention.paged_attention_forward(_Layer(layer_idx), query, key, value, None, scaling,
                                               sliding_window=sliding_window or None, pagedlab_context=CONTEXT.get())
    return out


@paged_attention.register_fake
def _(query, key, value, layer_idx, scaling, sliding_window):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])  # [1, tokens, heads, head_dim]


@torch.library.custom_op("pagedlab_lever::linear", mutates_args=())
def packed_linear(x: torch.Tensor, key: int) -> torch.Tensor:
    weight, bias, _ = PACKED[key]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x, key):
    return x.new_empty(*x.shape[:-1], PACKED[key][2])


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      **kwargs):
    out = torch.ops.pagedlab_lever.paged_attention(query, key, value, module.layer_idx, float(scaling),
                                                   int(sliding_window or 0))
    return out, None


AttentionInterface.register("pagedlab_lever", attention_forward)


def op_forward(packed: torch.Tensor, module: torch.nn.Linear):
    """cpu_linear's per-module forward, through the custom op instead of the mkldnn op itself."""
    key = len(PACKED)
    PACKED[key] = (packed, module.bias, module.out_features)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagedlab_lever.linear(x, key)

    return forward


class Lever:
    """The swap of `ModelRunner._forward`: eager (the engine's own) or compiled, switched between runs."""

    def __init__(self, mode: str) -> None:
        self.mode, self.compiled = mode, None
        self.eager_forward = model_runner.ModelRunner._forward
        self.linears: dict[int, cpu_linear.PackedLinears] = {}  # one per model: the compiled graph guards on them
        self.active = False

    def install(self) -> None:
        lever = self
        own_packed_linears = model_runner.PackedLinears

        def packed_linears(model, skip=frozenset()):
            if lever.mode != "compile" or not lever.active:  # the eager runs: the engine's own
                return own_packed_linears(model, skip)
            if id(model) not in lever.linears:
                own, cpu_linear._forward = cpu_linear._forward, op_forward
                try:
                    lever.linears[id(model)] = own_packed_linears(model, skip)
                finally:
                    cpu_linear._forward = own
            return lever.linears[id(model)]

        def forward(runner, input_ids, positions, context, logits_to_keep=0):
            if not lever.active:
                return lever.eager_forward(runner, input_ids, positions, context, logits_to_keep)
            if lever.compiled is None:
                lever.compiled = torch.compile(runner.model, dynamic=True, options={"freezing": lever.mode == "freeze"})
            token = CONTEXT.set(context)
            linears = runner.linears.installed() if runner.linears is not None else contextlib.nullcontext()
            try:
                with model_runner.engine_call(runner.model, "pagedlab_lever"), linears:
                    return lever.compiled(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                          logits_to_keep=logits_to_keep).logits[0]
            finally:
                CONTEXT.reset(token)

        model_runner.PackedLinears = packed_linears
        model_runner.ModelRunner._forward = forward


def compare(device: str, dtype: str, mode: str, rounds: int, num_requests: int, max_tokens: int | None,
            attention_backend: str = "auto") -> tuple[dict[str, list[float]], int, int]:
    """Eager and compiled runs of the chat workload, alternating: each run's seconds by name, and how many of the
    requests' greedy tokens differ between the two."""
    model, tokenizer = load_model(None, None, dtype=dtype, device=device)
    output_len = (16, 512) if max_tokens is None else (min(16, max_tokens), max_tokens)
    workload = workloads.chat(tokenizer, model.config.vocab_size, num_requests=num_requests, output_len=output_len)
    lever = Lever(mode)
    lever.install()
    if device == "cpu":
        backends = {"eager": "onednn", "compile": "onednn", "freeze": "torch"}  # freezing packs the weights itself
        engine = {}
    else:
        backends = {"eager": "torch", mode: "torch"}
        engine = {"enforce_eager": True}  # the compiled forward against the eager one, no CUDA graphs
    limits = dict(max_num_seqs=256, max_model_len=workload.max_len, max_num_batched_tokens=2048,
                  attention_backend=attention_backend, **engine)
    times: dict[str, list[float]] = {"eager": [], mode: []}
    tokens = {}
    for _ in range(rounds):
        for name in times:
            lever.active = name != "eager"
            start = time.perf_counter()
            result = systems.run_pagedlab(model, tokenizer, workload, linear_backend=backends[name], **limits)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            tokens[name] = result.token_ids
            print(f"{name}: {times[name][-1]:.1f} s", flush=True)
    differ = sum(a != b for a, b in zip(tokens["eager"], tokens[mode]))
    return times, differ, len(tokens["eager"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, help="cap each request's output (default: the workload's 16-512)")
    parser.add_argument("--rounds", type=int, default=2, help="eager and compiled runs each, alternating")
    parser.add_argument("--mode", choices=("compile", "freeze"), default="compile")
    parser.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times, differ, total = compare(args.device, args.dtype, args.mode, args.rounds, args.num_requests,
                                   args.max_tokens, args.attention_backend)
    where = (f"{args.threads} thread(s); {cpu_model()}" if args.device == "cpu"
             else f"{torch.cuda.get_device_name()}, enforce_eager")
    print(f"chat, {args.num_requests} requests, {args.dtype}, {where}; torch {torch.__version__}")
    for name, runs in times.items():
        warm = runs[1:] if name != "eager" and len(runs) > 1 else runs
        print(f"{name:8s} median {statistics.median(warm):.1f} s of {len(warm)} warm run(s) "
              f"({', '.join(f'{t:.1f}' for t in runs)}; the first compiled one compiles)")
    print(f"greedy tokens: {differ} of {total} requests differ between eager and {args.mode}")


if __name__ == "__main__":
    main()
