"""vLLM's offline `LLM` over one pagedlab workload, for `pagedlab bench --compare vllm`, run by the Python of
vLLM's own virtual environment (`make vllm-env` builds `.venv-vllm`):

    .venv-vllm/bin/python vllm_runner.py JOB.json

It imports vLLM and never pagedlab: the two pin different transformers, so they cannot share an environment, and
the bench runs this file by its path. JOB holds the model folder, dtype, the prompts (token ids) and each one's
exact output length, the engine's limits and KV budget and the warm-up size. The runner builds `LLM` (it compiles
for minutes on first start: reported, never timed into throughput), warms it up, says so, and then runs the
workload once for each `run` line it reads on stdin, until stdin closes: the bench keeps it alive between its
timed runs so that they alternate with pagedlab's (interleaved, so that a machine that slows down for a while
slows both). Greedy, EOS ignored, as for every system. Its answers are stdout lines that start with `MARK`
(vLLM logs to stdout too), each a JSON object: first the version, load time and block size, then one per run
with its generation time and every request's tokens.

vLLM's `LLM` spawns its engine-core process, so it must be built under `if __name__ == "__main__"`.
"""

from __future__ import annotations

import json
import sys
import time

MARK = "pagedlab-vllm-runner "


def answer(message: dict) -> None:
    print(MARK + json.dumps(message), flush=True)


def serve(job: dict, commands) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    # block_size None: vLLM's own choice (its CPU attention takes only some sizes, e.g. multiples of 32)
    sized = {} if job["block_size"] is None else {"block_size": job["block_size"]}
    start = time.perf_counter()
    llm = LLM(
        model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"], kv_cache_memory_bytes=job["kv_cache_memory_bytes"],
        enable_prefix_caching=job["enable_prefix_caching"], seed=job["seed"],
        skip_tokenizer_init=job["skip_tokenizer_init"], **sized,
    )
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    detokenize = not job["skip_tokenizer_init"]  # text as pagedlab makes it, where the folder has a tokenizer
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=detokenize)
              for n in job["max_tokens"]]
    warmup = job["warmup_requests"]
    llm.generate(prompts[:warmup], params[:warmup], use_tqdm=False)  # first-call costs, untimed
    answer({"version": vllm.__version__, "load_s": load_s,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size})
    for command in commands:
        if command.strip() != "run":
            raise ValueError(f"unknown command {command.strip()!r} (the runner knows 'run')")
        if job["enable_prefix_caching"]:
            llm.reset_prefix_cache()  # each run computes its prompts, as the first did
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        answer({"elapsed_s": elapsed, "token_ids": [list(o.outputs[0].token_ids) for o in outputs]})


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        serve(json.load(f), sys.stdin)
