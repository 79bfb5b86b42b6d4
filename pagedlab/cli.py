"""The command line: `pagedlab generate "prompt"`, `pagedlab serve` and `pagedlab bench --workload chat`.

Also `python -m pagedlab ...`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pagedlab.config import KV_CACHE_DTYPE_NAMES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedlab", description="PagedAttention and continuous batching.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate a completion for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("-v", "--verbose", action="store_true", help="log the engine's set-up")
    _engine_options(gen)
    _serve_parser(commands)
    _bench_parser(commands)
    return parser


def _engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's settings, shared by `generate` and `serve` (EngineConfig's names)."""
    group = parser.add_argument_group("engine options")
    group.add_argument("--model", default=None, help="model name, folder or Hub id (default: the embedded SmolLM2)")
    group.add_argument("--dtype", default="auto")
    group.add_argument("--device", default="auto")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (default 256)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (default 2048)")
    group.add_argument("--max-model-len", type=int, default=None, help="prompt + output at most")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    group.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    group.add_argument("--gpu-memory-utilization", type=float, default=None)
    group.add_argument("--enable-prefix-caching", action="store_true", default=None)
    group.add_argument("--enable-chunked-prefill", action="store_true", default=None)
    group.add_argument("--preemption-mode", choices=("auto", "recompute", "swap"), default=None,
                       help="default auto (measures a cost model at start-up)")
    group.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default=None)
    group.add_argument("--linear-backend", choices=("auto", "torch", "onednn"), default=None,
                       help="the linear layers on CPU: onednn, weights packed once (default for float32); torch")
    group.add_argument("--no-cpu-fused-ops", dest="cpu_fused_ops", action="store_false", default=None,
                       help="on CPU, Llama's norms, MLPs, attention projections and decode-step layers as the "
                            "model's own modules, not the C++ ops (EngineConfig.cpu_fused_ops)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, default=None,
                       help="how K and V are stored: auto (the model's dtype) or FP8 (one byte a value)")
    group.add_argument("--calculate-kv-scales", action="store_true", default=None,
                       help="with an FP8 cache, set each layer's K/V scales from the first batch (else 1.0)")
    group.add_argument("--engine-seed", type=int, default=None, help="seed of requests that bring none")
    group.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="split the model and KV cache over this many worker processes (default 1)")
    group.add_argument("--pipeline-parallel-size", type=int, default=None,
                       help="cut the model into this many stages by layers, one worker process each (default 1)")
    group.add_argument("--pipeline-layer-partition", type=lambda text: [int(n) for n in text.split(",")],
                       default=None, help="layers per stage, comma-separated (e.g. 16,14; default an even split)")
    group.add_argument("--max-concurrent-batches", type=int, default=None,
                       help="batches in flight under pipeline parallelism (default one per stage; 1: one at a time)")
    group.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default=None,
                       help="where the ranks run: mp, processes here (default); ray, actors on a Ray cluster")
    group.add_argument("--distributed-timeout", type=float, default=None,
                       help="seconds a parallel rank may take to answer before the engine stops (default 300)")


_ENGINE_FIELDS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                  "kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching", "enable_chunked_prefill",
                  "preemption_mode", "attention_backend", "linear_backend", "tensor_parallel_size",
                  "pipeline_parallel_size", "pipeline_layer_partition", "max_concurrent_batches",
                  "distributed_executor_backend", "distributed_timeout", "kv_cache_dtype", "calculate_kv_scales",
                  "cpu_fused_ops")


def _engine_kwargs(args) -> dict:
    kwargs = {name: getattr(args, name) for name in _ENGINE_FIELDS if getattr(args, name) is not None}
    if args.engine_seed is not None:
        kwargs["seed"] = args.engine_seed
    return kwargs


def _serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a model over the OpenAI API with continuous batching. Binds to 127.0.0.1 unless told.",
    )
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model name, folder or Hub id (default: the embedded SmolLM2)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 (or set PAGEDLAB_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.add_argument("-v", "--verbose", action="store_true", help="log the engine's set-up")
    _engine_options(serve)


def _serve(args) -> int:
    import os
    import signal

    from pagedlab.async_llm import build_on_engine_thread
    from pagedlab.engine import LLMEngine
    from pagedlab.entrypoints.openai.api_server import bind_socket, build_app, run_server

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    api_key = args.api_key or os.environ.get("PAGEDLAB_API_KEY") or None
    # A server runs for days: it keeps no record of every step (record_trace is for the chapters). The model is
    # loaded on the thread that will step it (`engine_thread` says why).
    engine, executor = build_on_engine_thread(LLMEngine.from_pretrained, model, dtype=args.dtype, device=args.device,
                                              record_trace=False, **_engine_kwargs(args))
    name = args.served_model_name or model or "smollm2-135m-instruct"
    app = build_app(engine, name, api_key, executor)
    sock = bind_socket(args.host, args.port)  # port 0: a free one, printed below
    host, port = sock.getsockname()[:2]
    print(f"pagedlab serve: {name} on http://{host}:{port}/v1 (max_model_len {engine.max_model_len}, "
          f"{engine.stats().num_kv_blocks} KV blocks){'; API key required' if api_key else ''}",
          file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for the handler it found:
    # this one notes it, so the command exits with 0 after a clean shutdown instead of dying by the signal.
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    run_server(app, sock=sock, log_level=args.log_level)
    how = f" on {signal.Signals(received[0]).name}" if received else ""
    print(f"pagedlab serve: shut down cleanly{how}", file=sys.stderr, flush=True)
    return 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


_BOTH_WAYS = ("in-process", "http")  # the serving bench's default: straight into the engine, then over HTTP


def _serving_via(text: str) -> tuple[str, ...]:
    return _BOTH_WAYS if text.strip() == "both" else _names(text)


def _bench_parser(commands) -> None:
    from pagedlab.bench import COMPARATORS, WORKLOADS

    bench = commands.add_parser(
        "bench", help="run a benchmark workload: print a table, write JSON and PNG plots",
        description="Seeded workloads through pagedlab (and comparators, in the same process).",
    )
    bench.add_argument("--workload", default="chat", choices=WORKLOADS)
    bench.add_argument("--compare", type=_names, default=(), help=f"comma-separated: {', '.join(COMPARATORS)}")
    bench.add_argument("--num-requests", type=int, default=None, help="default per workload (chat 128)")
    bench.add_argument("--out", default="bench-results", help="folder for the JSON, text table and plots")
    bench.add_argument("--model", default=None, help="model name, folder or Hub id (default: the embedded SmolLM2)")
    bench.add_argument("--dtype", default="auto", help="auto (float32 on CPU), float32, bfloat16 or float16")
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    bench.add_argument("--repeats", type=int, default=1, help="runs per pagedlab system (median time)")
    bench.add_argument("--hf-repeats", type=int, default=1, help="runs per Hugging Face comparator")
    bench.add_argument("--hf-batch-size", type=_ints, default=(8, 16, 32, 64, 128),
                       help="hf-static batch sizes (the best of those whose KV fits in pagedlab's budget is reported)")
    bench.add_argument("--max-num-seqs", type=int, default=256)
    bench.add_argument("--max-num-batched-tokens", type=int, default=2048)
    bench.add_argument("--block-size", type=int, default=16)
    bench.add_argument("--linear-backend", choices=("auto", "torch", "onednn"), default="auto",
                       help="pagedlab's linear layers on CPU (default auto: oneDNN for float32)")
    bench.add_argument("--no-cpu-fused-ops", action="store_true",
                       help="pagedlab's norms and MLPs through the model's own modules, not one-pass C++ ops")
    bench.add_argument("--scale", type=float, default=1.0,
                       help="nano-vllm, calibrate: shrink lengths and request count")
    bench.add_argument("--request-rate", type=_floats, default=(1.0,), help="serving: requests/s, comma-separated")
    bench.add_argument("--endpoint", default=None,
                       help="serving: measure this OpenAI-compatible server (e.g. http://127.0.0.1:8000) over HTTP; "
                            "default: in process and over HTTP against `pagedlab serve` started on a free port")
    bench.add_argument("--serving-via", type=_serving_via, default=_BOTH_WAYS,
                       help="serving without --endpoint: in-process, http, or both (default)")
    bench.add_argument("--sweep-max-num-seqs", type=_ints, default=(), help="chat/nano-vllm: e.g. 8,32,128,256")
    bench.add_argument("--overhead-sizes", type=_ints, default=(256, 1024), help="overhead: running sequences")
    bench.add_argument("--capacity-reservations", type=_ints, default=(4, 8, 16, 32),
                       help="capacity: KV budgets, as numbers of max_model_len reservations")
    bench.add_argument("--decode-dtypes", type=_names, default=("float32", "bfloat16"), help="decode: dtypes")
    bench.add_argument("--decode-batch-sizes", type=_ints, default=(16, 64, 256), help="decode: batch sizes")
    bench.add_argument("--decode-contexts", type=_ints, default=(128, 512, 2048), help="decode: context lengths")
    bench.add_argument("--decode-max-kv-gib", type=float, default=None,
                       help="decode: skip steps whose KV cache is larger (default: a quarter of the RAM)")
    bench.add_argument("--decode-clock", choices=("wall", "cpu"), default="wall",
                       help="decode: wall time, or process CPU time (with --threads 1 on a shared machine)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("-v", "--verbose", action="store_true", help="log the engines' set-up")


def _bench(args) -> int:
    import torch

    from pagedlab.bench import run_benchmark

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report = run_benchmark(
        args.workload, model=args.model, dtype=args.dtype, device=args.device, out_dir=args.out,
        progress=not args.no_progress, compare=args.compare, num_requests=args.num_requests, repeats=args.repeats,
        hf_repeats=args.hf_repeats, batch_sizes=args.hf_batch_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        linear_backend=args.linear_backend, cpu_fused_ops=not args.no_cpu_fused_ops, scale=args.scale,
        request_rates=args.request_rate, endpoint=args.endpoint, serving_via=args.serving_via,
        sweep_max_num_seqs=args.sweep_max_num_seqs,
        overhead_sizes=args.overhead_sizes, overhead_real_sizes=args.overhead_sizes[:1],
        capacity_reservations=args.capacity_reservations, decode_dtypes=args.decode_dtypes,
        decode_batch_sizes=args.decode_batch_sizes, decode_contexts=args.decode_contexts,
        decode_max_kv_gib=args.decode_max_kv_gib, decode_clock=args.decode_clock, seed=args.seed,
    )
    print(report.text())
    print(f"[results written to {args.out}/]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    from pagedlab import LLM, SamplingParams

    if not args.verbose:
        hf_logging.disable_progress_bar()  # a command line tool: no loading bars on stderr
    if args.command == "serve":
        try:
            return _serve(args)
        except (ValueError, OSError) as error:
            print(f"pagedlab: error: {error}", file=sys.stderr)
            return 2
    if args.command == "bench":
        if not args.verbose:
            hf_logging.set_verbosity_error()  # generate()'s notes on generation flags would drown the table
        try:
            return _bench(args)
        except ValueError as error:
            print(f"pagedlab: error: {error}", file=sys.stderr)
            return 2

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens,
        )
        llm = LLM(args.model, dtype=args.dtype, device=args.device, **_engine_kwargs(args))
        start = time.perf_counter()
        tokenizer = llm.get_tokenizer()
        if args.raw or not getattr(tokenizer, "chat_template", None):
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
        else:
            conversations = [[{"role": "user", "content": p}] for p in args.prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    except (ValueError, TypeError) as error:
        print(f"pagedlab: error: {error}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompts, outputs):
        if len(outputs) > 1:
            print(f"--- {prompt}")
        print(output.outputs[0].text)
    stats = llm.stats()
    print(
        f"[{stats.num_generated_tokens} tokens in {stats.num_steps} steps, {elapsed:.2f} s; "
        f"KV blocks: peak {stats.peak_used_blocks} of {stats.num_kv_blocks} used, "
        f"{stats.block_size} tokens each]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
