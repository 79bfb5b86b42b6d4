"""GPU check: the Triton kernels' full correctness grid, a decode micro-benchmark, the engine, and with several
GPUs pipeline and tensor parallelism over NCCL. CUDA only.

    python scripts/gpu_check.py [--output gpu_check.md] [--skip-tests] [--skip-bench]

This script has not run on a GPU yet. The tables below show its layout only: every <...> and "..." is a
figure that comes from its first run, which prints the tables and writes them to --output.

1. Runs `python -m pytest tests/kernels/test_kernels.py -q` with PAGEDLAB_FULL_KERNEL_GRID=1 on the GPU (every kernel
   against its torch reference, before anything is timed). Stops with exit status 1 if a test fails.
2. Times the decode kernel on a Llama-3-8B-shaped layer (32 query heads over 8 KV heads, head_dim 128,
   bfloat16, block size 16, every sequence's blocks scattered at random over the cache) for batch
   {1, 16, 64, 256} x context {512, 2048, 8192}, after checking its output against
   `torch.nn.functional.scaled_dot_product_attention` on the same context laid out contiguously
   ([batch, kv_heads, context, head_dim], enable_gqa=True). Each call is captured in a CUDA graph and
   replayed by `triton.testing.do_bench`, which flushes the L2 cache before every replay: the times are the
   GPU's, without Python's launch overhead, reading K/V from HBM. Prints and writes this table, one row per
   batch and context (12 rows; shown here cut in two after "split-K us", the script prints each row whole):

    # gpu_check: <GPU name>, <SMs> SMs, torch <version>, triton <version>
    # decode: 32 query heads / 8 KV heads, head_dim 128, bfloat16, block_size 16
    # device-to-device copy: <GB/s> GB/s (bytes read + bytes written, 1 GiB copy)
    | batch | context | path    | kernel us | GB/s | of copy | v1 us | split-K us |
    |------:|--------:|:--------|----------:|-----:|--------:|------:|-----------:|
    |     1 |     512 | <path>  |       ... |  ... |     ... |   ... |        ... |
    ...

   and, on the same lines, the rest of each row:

    | SDPA us | SDPA / kernel | fp8 us | bf16 / fp8 |
    |--------:|--------------:|-------:|-----------:|
    |     ... |           ... |    ... |        ... |
    ...

   batch, context: the decode batch and every sequence's context length; path: what `use_split_k` picked
   (v1 or split-K) and "kernel us" its median time; GB/s: bytes the kernel must move (K and V of every
   context token, query, output, block tables) per second; "of copy": that over the measured copy bandwidth
   (the roofline: decode reads each cached byte once, so 1.0 is the ceiling); v1 us and split-K us: both
   versions forced, to check the rule; SDPA us: torch's fused attention over the contiguous K/V;
   SDPA / kernel > 1 means the paged kernel is faster. Small rows may be launch-bound, far below 1.0 "of copy".
   fp8 us: the same kernel (the path `use_split_k` picked) over the cache stored as float8 e4m3 with scales of
   1.0 (`kv_cache_dtype="fp8"`), checked against SDPA over the dequantised K/V; bf16 / fp8 is the speed-up
   from reading half the bytes (2.0 at most, where the step is bound by reading the cache).

3. Runs the embedded SmolLM2 (bfloat16) through the engine on 64 random-token prompts of 20-400 tokens with 128
   greedy output tokens each (EOS ignored), once with decode steps replayed from CUDA graphs and once with
   `enforce_eager=True`, checks that both give the same tokens (exit status 1 otherwise), then times Hugging
   Face `generate` on the same prompts in one left-padded static batch:

    # engine: SmolLM2-135M-Instruct, bfloat16, 64 random-token prompts ...; graphed tokens == eager tokens: <bool>
    | system | time s | output tok/s |
    |:-------|-------:|-------------:|
    | pagedlab (CUDA graphs) | ... | ... |
    | pagedlab (enforce_eager) | ... | ... |
    | HF generate (one static batch) | ... | ... |

4. The compiled forward: `scripts/compile_lever.py --device cuda --dtype bfloat16` in a process of its own (it
   swaps the engine's forward), the chat workload's 32 requests with the model compiled by Inductor
   (`torch.compile(dynamic=True)`, pagedlab's paged attention, the Triton kernels, behind a
   `torch.library.custom_op` so the graph does not break at every layer) against the eager forward, both with
   `enforce_eager=True`, 2 rounds alternating; it reports, not fails, greedy tokens that differ (Inductor's fused
   bfloat16 arithmetic may round differently; the lever is not in the engine, as it did not win on a CPU):

    # compiled forward: chat, 32 requests, bfloat16, <GPU name>, enforce_eager; torch <version>
    eager    median ... s of 2 warm run(s) (...)
    compile  median ... s of 1 warm run(s) (...; the first compiled one compiles)
    greedy tokens: ... of 32 requests differ between eager and compile

5. With two or more GPUs: the embedded SmolLM2 (bfloat16) on 16 of those prompts, 32 greedy tokens each, in one
   process, in two pipeline stages over NCCL with one and with two batches in flight, and (with three GPUs) in
   three tensor-parallel ranks; every run's tokens must equal the one process's (exit status 1 otherwise):

    # parallel: SmolLM2-135M-Instruct, bfloat16, NCCL, 16 prompts x 32 tokens; tokens == one process: <bool>
    | system | time s | output tok/s |
    ...

The tables also go to --output (default gpu_check.md in the working directory), and it prints how long it
took: how long is not known before that first run. A first run spends part of it compiling the kernel
variants of the grid (cached in ~/.triton/cache afterwards). Compiling alone was measured without a GPU:
`tests/kernels/test_kernels_compile.py` compiles the kernels for sm_80, sm_89 and sm_90, and the README's kernel
table (from `scripts/kernel_table.py`) gives their shared memory, registers and warps per target; the
kernels' speed on a GPU is measured by nothing yet. Without CUDA it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ROOT / "tests" / "kernels" / "test_kernels.py"
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192)
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def run_kernel_tests() -> bool:
    env = {**os.environ, "PAGEDLAB_FULL_KERNEL_GRID": "1"}
    env.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU, not the interpreter
    command = [sys.executable, "-m", "pytest", str(KERNEL_TESTS), "-q", "-p", "no:cacheprovider"]
    print(f"[1/5] kernel grid: {' '.join(command[2:])} (PAGEDLAB_FULL_KERNEL_GRID=1)", flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env)
    print(f"      {time.perf_counter() - start:.0f} s", flush=True)
    return result.returncode == 0


def gpu_time_us(fn) -> float:
    """Median GPU time of fn() in microseconds: replayed from a CUDA graph, L2 flushed before each replay."""
    import torch
    from triton.testing import do_bench

    fn()  # compile, and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        replay = graph.replay
    except RuntimeError as error:  # a capture failure should not cost the whole table
        print(f"      (CUDA graph capture failed, timing with launch overhead: {error})", flush=True)
        replay = fn
    return 1000 * do_bench(replay, warmup=10, rep=50, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB: (bytes read + bytes written) per second."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = gpu_time_us(lambda: dst.copy_(src)) / 1e6
    return 2 * src.numel() / seconds


def benchmark(device_name: str = "cuda") -> list[str]:
    import torch
    import torch.nn.functional as F
    import triton

    from pagedlab.kernels.paged_decode import paged_decode, use_split_k

    device = torch.device(device_name)
    props = torch.cuda.get_device_properties(device)
    dtype = torch.bfloat16
    print(f"[2/5] decode micro-benchmark on {props.name}", flush=True)
    copy_bw = copy_bandwidth()
    lines = [
        f"# gpu_check: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
        f"triton {triton.__version__}",
        f"# decode: {NUM_Q_HEADS} query heads / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, bfloat16, "
        f"block_size {BLOCK_SIZE}",
        f"# device-to-device copy: {copy_bw / 1e9:.0f} GB/s (bytes read + bytes written, 1 GiB copy)",
        "| batch | context | path    | kernel us | GB/s | of copy | v1 us | split-K us | SDPA us | SDPA / kernel "
        "| fp8 us | bf16 / fp8 |",
        "|------:|--------:|:--------|----------:|-----:|--------:|------:|-----------:|--------:|--------------:"
        "|-------:|-----------:|",
    ]
    print("\n".join(lines), flush=True)
    generator = torch.Generator(device=device).manual_seed(0)
    scale = HEAD_DIM**-0.5
    for batch in BATCHES:
        for context in CONTEXTS:
            blocks_per_seq = context // BLOCK_SIZE
            num_blocks = batch * blocks_per_seq
            shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
            key_cache = torch.randn(shape, generator=generator, device=device, dtype=dtype)
            value_cache = torch.randn(shape, generator=generator, device=device, dtype=dtype)
            block_tables = torch.randperm(num_blocks, generator=generator, device=device)
            block_tables = block_tables.view(batch, blocks_per_seq).to(torch.int32)
            context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=generator, device=device, dtype=dtype)
            # the same context, contiguous: [batch, kv_heads, context, head_dim]
            key = key_cache[block_tables.long()].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
            value = value_cache[block_tables.long()].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
            key, value = key.contiguous(), value.contiguous()

            def sdpa(query=query, key=key, value=value):
                return F.scaled_dot_product_attention(query[:, :, None], key, value, scale=scale, enable_gqa=True)

            # the cache also in float8 e4m3 (scales 1.0: randn fits its range)
            key_fp8, value_fp8 = key_cache.to(torch.float8_e4m3fn), value_cache.to(torch.float8_e4m3fn)
            kv_scales = torch.ones(2, dtype=torch.float32, device=device)

            def kernel(split_k=None, fp8=False, query=query, key_cache=key_cache, value_cache=value_cache,
                       key_fp8=key_fp8, value_fp8=value_fp8, block_tables=block_tables, context_lens=context_lens,
                       kv_scales=kv_scales):
                if fp8:
                    return paged_decode(query, key_fp8, value_fp8, block_tables, context_lens, scale, split_k=split_k,
                                        kv_scales=kv_scales)
                return paged_decode(query, key_cache, value_cache, block_tables, context_lens, scale, split_k=split_k)

            expected = sdpa()[:, :, 0]
            for split_k in (False, True):
                torch.testing.assert_close(kernel(split_k), expected, atol=2e-2, rtol=2e-2)
            auto = use_split_k(batch, context, NUM_KV_HEADS, props.multi_processor_count)
            v1_us = gpu_time_us(lambda: kernel(False))
            split_us = gpu_time_us(lambda: kernel(True))
            sdpa_us = gpu_time_us(sdpa)
            kernel_us = split_us if auto else v1_us
            # the float8 cache against SDPA over its dequantised K/V, on the path `use_split_k` picks
            fp8 = torch.float8_e4m3fn
            expected_fp8 = F.scaled_dot_product_attention(query[:, :, None], key.to(fp8).to(dtype),
                                                          value.to(fp8).to(dtype), scale=scale, enable_gqa=True)
            torch.testing.assert_close(kernel(fp8=True), expected_fp8[:, :, 0], atol=2e-2, rtol=2e-2)
            fp8_us = gpu_time_us(lambda: kernel(fp8=True))
            num_bytes = (2 * batch * context * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize  # K and V
                         + 2 * query.numel() * dtype.itemsize + block_tables.numel() * 4)
            bandwidth = num_bytes / (kernel_us / 1e6)
            line = (
                f"| {batch:5d} | {context:7d} | {'split-K' if auto else 'v1':7s} | {kernel_us:9.1f} "
                f"| {bandwidth / 1e9:4.0f} | {bandwidth / copy_bw:7.2f} | {v1_us:5.1f} | {split_us:10.1f} "
                f"| {sdpa_us:7.1f} | {sdpa_us / kernel_us:13.2f} | {fp8_us:6.1f} | {kernel_us / fp8_us:10.2f} |"
            )
            print(line, flush=True)
            lines.append(line)
            del key_cache, value_cache, key, value, key_fp8, value_fp8
            torch.cuda.empty_cache()
    return lines


def engine_benchmark(num_prompts: int = 64, max_tokens: int = 128) -> list[str]:
    """The embedded SmolLM2 in bfloat16 through the engine, decode steps replayed from CUDA graphs and eager,
    then Hugging Face `generate` on the same prompts in one static batch. Greedy, EOS ignored, so every
    system produces num_prompts x max_tokens tokens; the graphed tokens must equal the eager ones."""
    import random

    import torch

    from pagedlab import LLM, SamplingParams

    print(f"[3/5] engine: {num_prompts} prompts x {max_tokens} tokens, CUDA graphs on/off, HF generate", flush=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(dtype="bfloat16", device="cuda", max_num_seqs=num_prompts)
    model, tokenizer = llm.llm_engine.model, llm.get_tokenizer()
    rng = random.Random(0)
    vocab = model.get_input_embeddings().num_embeddings
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(20, 400))]}
               for _ in range(num_prompts)]
    results, tokens = {}, {}
    for name, options in (("pagedlab (CUDA graphs)", None), ("pagedlab (enforce_eager)", {"enforce_eager": True})):
        if options is not None:
            llm = LLM(model, tokenizer, dtype="bfloat16", device="cuda", max_num_seqs=num_prompts, **options)
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        results[name] = time.perf_counter() - start
        tokens[name] = [o.outputs[0].token_ids for o in outputs]
        graphs = llm.llm_engine.model_runner.decode_graphs
        state = f"on, sizes {sorted(graphs.graphs)}" if graphs else "off"
        print(f"  {name}: {results[name]:.2f} s; graphs {state}", flush=True)
        del llm
        torch.cuda.empty_cache()
    same = tokens["pagedlab (CUDA graphs)"] == tokens["pagedlab (enforce_eager)"]
    print(f"  graphed tokens == eager tokens: {same}", flush=True)

    batch = [p["prompt_token_ids"] for p in prompts]
    width = max(map(len, batch))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device="cuda")
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
    model.generate(input_ids=input_ids[:4], attention_mask=attention_mask[:4], max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_tokens, do_sample=False,
                   min_new_tokens=max_tokens, pad_token_id=pad)
    torch.cuda.synchronize()
    results["HF generate (one static batch)"] = time.perf_counter() - start

    lines = [
        "",
        f"# engine: SmolLM2-135M-Instruct, bfloat16, {num_prompts} random-token prompts of 20-400 tokens, "
        f"{max_tokens} output tokens each (greedy, EOS ignored); graphed tokens == eager tokens: {same}",
        "| system | time s | output tok/s |",
        "|:-------|-------:|-------------:|",
    ]
    for name, seconds in results.items():
        lines.append(f"| {name} | {seconds:.2f} | {num_prompts * max_tokens / seconds:.0f} |")
    print("\n".join(lines), flush=True)
    if not same:
        print("gpu_check: decode steps replayed from CUDA graphs changed the greedy tokens", file=sys.stderr)
        raise SystemExit(1)
    return lines


def compiled_check(rounds: int = 2) -> list[str]:
    """The compiled-forward lever on this GPU (scripts/compile_lever.py, in a subprocess: it patches the engine's
    forward for its run). Its summary lines, or one line saying how it failed; never fails the check."""
    print(f"[4/5] compiled forward: scripts/compile_lever.py --device cuda, {rounds} rounds", flush=True)
    command = [sys.executable, str(ROOT / "scripts" / "compile_lever.py"), "--device", "cuda", "--dtype", "bfloat16",
               "--rounds", str(rounds)]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        lines = ["", f"# compiled forward: failed (exit status {result.returncode}): {tail[0]}"]
    else:
        summary = result.stdout.strip().splitlines()[-4:]  # the header, the two medians, the token count
        lines = ["", f"# compiled forward: {summary[0]}", *summary[1:]]
    print("\n".join(lines), flush=True)
    return lines


def parallel_check(num_prompts: int = 16, max_tokens: int = 32) -> list[str]:
    """SmolLM2 over NCCL: two pipeline stages (one batch in flight and two) and three tensor-parallel ranks, each
    checked against one process; skipped (one line saying so) with fewer than two GPUs."""
    import random

    import torch

    from pagedlab import LLM, SamplingParams

    count = torch.cuda.device_count()
    if count < 2:
        return ["", f"# parallel: skipped, {count} GPU (pipeline and tensor parallelism need 2 or more)"]
    print(f"[5/5] parallel: {num_prompts} prompts x {max_tokens} tokens over NCCL on {count} GPUs", flush=True)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(49152) for _ in range(rng.randint(20, 400))]}
               for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = [("one process", {}),
            ("2 stages, 1 batch in flight", dict(pipeline_parallel_size=2, max_concurrent_batches=1)),
            ("2 stages, 2 batches in flight", dict(pipeline_parallel_size=2))]
    if count >= 3:
        runs.append(("3 tensor-parallel ranks", dict(tensor_parallel_size=3)))
    results, tokens = {}, {}
    for name, options in runs:
        with LLM(None, dtype="bfloat16", device="cuda", max_num_seqs=num_prompts, **options) as llm:
            llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results[name] = time.perf_counter() - start
            tokens[name] = [o.outputs[0].token_ids for o in outputs]
        print(f"  {name}: {results[name]:.2f} s", flush=True)
    same = all(t == tokens["one process"] for t in tokens.values())
    lines = ["", f"# parallel: SmolLM2-135M-Instruct, bfloat16, NCCL, {num_prompts} prompts x {max_tokens} tokens; "
             f"tokens == one process: {same}", "| system | time s | output tok/s |",
             "|:-------|-------:|-------------:|"]
    lines += [f"| {name} | {t:.2f} | {num_prompts * max_tokens / t:.0f} |" for name, t in results.items()]
    print("\n".join(lines), flush=True)
    if not same:
        print("gpu_check: a parallel engine changed the greedy tokens", file=sys.stderr)
        raise SystemExit(1)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("gpu_check.md"), help="where to write the table")
    parser.add_argument("--skip-tests", action="store_true", help="only the benchmark")
    parser.add_argument("--skip-bench", action="store_true", help="only the kernel grid")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False), nothing to check here.\n"
            "On a CPU, `python -m pytest tests/kernels/test_kernels.py` runs the kernels in Triton's interpreter.",
            file=sys.stderr,
        )
        return 2
    if importlib.util.find_spec("triton") is None:
        print("gpu_check: triton is not installed (pip install triton)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if not args.skip_tests and not run_kernel_tests():
        print("gpu_check: the kernel grid failed; not benchmarking kernels that are wrong", file=sys.stderr)
        return 1
    if not args.skip_bench:
        lines = benchmark()
        lines += engine_benchmark()
        lines += compiled_check()
        lines += parallel_check()
        args.output.write_text("\n".join(lines) + "\n")
        print(f"table written to {args.output}", flush=True)
    print(f"gpu_check: done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
