"""Where the time of a workload goes, pagedlab beside vLLM's CPU backend: py-spy's native samples of one run of
each, sorted into the same parts.

    .venv/bin/pip install py-spy          # a sampling profiler; not one of pagedlab's dependencies
    make vllm-env                         # vLLM in .venv-vllm
    .venv/bin/python scripts/profile_vs_vllm.py --threads 1 --dtype float32
    .venv/bin/python scripts/profile_vs_vllm.py --workload prefix --threads 2

The workloads and settings are `pagedlab bench --workload chat|prefix --compare vllm`'s (`--num-requests` requests,
greedy, exact output lengths, the same KV budget in bytes; prefix: both with prefix caching on, vLLM's blocks its
own choice). Each system runs once untimed by the profiler (its time is the
table's `seconds` column) and once under py-spy (`--native`, so that C++ frames are seen: oneDNN's kernels, the
attention kernels, Inductor's fused loops). Only the thread that runs the model is counted: pagedlab's main thread,
vLLM's worker process (its engine-core process, which waits on the worker, and its front end are left out). A
sample is put in the first part whose test matches its stack (`PARTS`, in order); a part's seconds are its share
of the samples times the untimed run. The profiler slows both runs (it pauses the process to read its stack), so
the shares, not its own times, are what it measures.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JIT = re.compile(r"^0x[0-9a-f]+ \(\?\)$")  # code without a symbol: oneDNN's JIT kernels (Xbyak), under a linear


def _linear(stack: str, leaf: str) -> bool:
    # JIT code in pagedlab's one-call decoder layer (csrc/llama_layer_cpu.cpp) is oneDNN's: the layer's own
    # kernels are compiled C++, with symbols; py-spy cannot unwind past JIT code, so only the Python frames remain
    return bool(re.search(r"dnnl|brgemm|mkldnn|onednn|cpu_linear\.py|sgemm|mkl_", stack, re.I)) or (
        JIT.match(leaf) is not None and re.search(r"Runner\.call|linear|_decoder_layer \(pagedlab/", stack) is not None)


def pagedlab_timed(stack: str) -> bool:
    """A sample of pagedlab's run that its time counts: on the main thread, not building the engine (packing the
    weights for oneDNN, allocating the KV cache), which the bench times apart as vLLM's start is."""
    return "Thread._bootstrap" not in stack and "LLMEngine.__init__" not in stack


# pagedlab's C++ extension: its library's name is in every frame of its code, the decode kernel's and the fused ops'
EXTENSION = r"pagedlab_paged_decode_cpu\w*\.so"


def _fused_op(stack: str) -> bool:
    """A sample in pagedlab's fused norm, SiLU or rotary op (`cpu_fused`), or in vLLM's compiled loops."""
    return re.search(rf"kernel\._omp_fn|cpp_fused|Vectorized<|_mm512|_mm256|{EXTENSION}", stack) is not None


PARTS = [  # (part, test on (whole stack, its innermost frame)); the first that matches takes the sample
    ("waiting (queues, locks)", lambda s, leaf: re.search(r"sched_yield|SpinCondition|MessageQueue|Condition\.wait|"
                                                            r"Connection\._recv|acquire_read", s) is not None),
    ("attention (cache writes, decode, prefill)",  # the decode kernel by its functions, not by its library's name
     lambda s, leaf: re.search(r"cpu_attn|cpu_attention(\.py|::)|CPUAttention|kv_cache_update|paged_decode \(|"
                               r"write_to_cache|scaled_dot_product|prefill_attention|index_copy", s) is not None),
    ("linear layers", _linear),
    ("norms, RoPE, activations (eager)", lambda s, leaf: not re.search(EXTENSION, s) and re.search(
        r"RMSNorm|rotary|rotate_half|apply_rotary|act_fn|silu|Sleef", s) is not None),
    ("norms, RoPE, activations (fused: C++ or compiled)", lambda s, leaf: _fused_op(s)),
    ("rest of the forward (Python, adds, views)", lambda s, leaf: re.search(
        r"modeling_llama|Runner\.call|CompiledFxGraph|compiled_function|_call_impl|model_executor", s) is not None),
    ("sampling", lambda s, leaf: re.search(r"[Ss]ampler|argmax|sample", s) is not None),
    ("outside the forward (scheduling, inputs, outputs)", lambda s, leaf: True),
]


def classify(path: Path, keep) -> collections.Counter:
    """Samples per part of the stacks in py-spy's raw file that `keep(stack)` selects."""
    parts: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not keep(stack):
            continue
        leaf = stack.rsplit(";", 1)[-1]
        parts[next(name for name, test in PARTS if test(stack, leaf))] += int(count)
    return parts


class Sampler:
    """py-spy recording `pid` (and its children) into a raw file until `stop()`."""

    def __init__(self, pid: int, out: Path, subprocesses: bool = False) -> None:
        command = [py_spy(), "record", "--pid", str(pid), "--native", "--rate", "50", "--format", "raw",
                   "-o", str(out)] + (["--subprocesses"] if subprocesses else [])
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(2)  # attached before the run starts

    def stop(self) -> None:
        self.process.send_signal(2)
        _, err = self.process.communicate(timeout=120)
        if self.process.returncode not in (0, -2):
            raise RuntimeError(f"py-spy failed: {err.strip()[-500:]}")


def py_spy() -> str:
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--workload", default="chat", choices=("chat", "prefix"))
    parser.add_argument("--num-requests", type=int, default=None, help="default: 32 chat, 64 prefix requests")
    parser.add_argument("--out", default=None, help="folder for py-spy's raw files (default: a temporary one)")
    args = parser.parse_args()
    py_spy()

    import torch

    from pagedlab.bench import BenchOptions, systems, workloads
    from pagedlab.bench.report import cpu_model
    from pagedlab.models import embedded_model_dir, load_model
    from pagedlab.worker.kv_cache import KVCacheSpec

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(None, None, dtype=args.dtype)
    bench = BenchOptions()  # the bench's step budgets and workload sizes
    if args.workload == "chat":
        workload = workloads.chat(tokenizer, model.config.vocab_size, num_requests=args.num_requests or 32)
    else:
        workload = workloads.shared_prefix(tokenizer, model.config.vocab_size, args.num_requests or 64,
                                           bench.prefix_len, max_tokens=bench.prefix_max_tokens)
    caching = args.workload == "prefix"
    longest_prompt = max(r.num_prompt_tokens for r in workload.requests)
    limits = dict(max_num_seqs=bench.max_num_seqs, max_model_len=workload.max_len,
                  max_num_batched_tokens=max(bench.max_num_batched_tokens, longest_prompt))
    out = Path(args.out or tempfile.mkdtemp(prefix="pagedlab-profile-"))
    out.mkdir(parents=True, exist_ok=True)

    seconds, samples = {}, {}
    first = systems.run_pagedlab(model, tokenizer, workload, enable_prefix_caching=caching, **limits)  # warms up
    seconds["pagedlab"] = first.elapsed_s
    steps = first.extra["step_seconds"]
    num_slots = first.extra["num_kv_blocks"] * first.extra["block_size"]
    sampler = Sampler(os.getpid(), out / "pagedlab.txt")
    systems.run_pagedlab(model, tokenizer, workload, enable_prefix_caching=caching, **limits)
    sampler.stop()
    samples["pagedlab"] = classify(out / "pagedlab.txt", pagedlab_timed)

    bytes_per_token = KVCacheSpec.from_model_config(model.config, model.dtype).bytes_per_token
    with systems.VLLMSession(str(embedded_model_dir()), workload, dtype=args.dtype, threads=args.threads,
                             kv_cache_memory_bytes=num_slots * bytes_per_token, enable_prefix_caching=caching,
                             **limits) as session:
        seconds["vllm"] = session.run_once()
        sampler = Sampler(session.pid, out / "vllm.txt", subprocesses=True)
        session.run_once()
        sampler.stop()
    samples["vllm"] = classify(out / "vllm.txt", lambda stack: "VLLM::Worker" in stack)

    print(f"{args.workload}, {len(workload.requests)} requests, {args.dtype}, {args.threads} thread(s); {cpu_model()}; "
          f"py-spy --native at 50 Hz; raw samples in {out}")
    print(f"untimed-by-the-profiler runs: pagedlab {seconds['pagedlab']:.1f} s, vLLM {seconds['vllm']:.1f} s")
    header = f"{'part':52s} {'pagedlab':>9s} {'s':>6s} {'vLLM':>9s} {'s':>6s} {'gap s':>6s}"
    print(header, "-" * len(header), sep="\n")
    for name, _ in PARTS:
        row = []
        for system in ("pagedlab", "vllm"):
            share = samples[system][name] / max(sum(samples[system].values()), 1)
            row += [share, share * seconds[system]]
        print(f"{name:52s} {row[0]:8.1%} {row[1]:6.1f} {row[2]:8.1%} {row[3]:6.1f} {row[1] - row[3]:6.1f}")
    print("pagedlab's steps (its trace, the untimed run):")
    for kind in ("prefill", "decode"):
        times = [t for k, t in steps if k == kind]
        median = 1e3 * sorted(times)[len(times) // 2] if times else 0.0
        print(f"  {kind:8s} steps {len(times):4d}  {sum(times):6.2f} s  median {median:.1f} ms")
    print(f"  between steps and after: {seconds['pagedlab'] - sum(t for _, t in steps):.2f} s")


if __name__ == "__main__":
    main()
