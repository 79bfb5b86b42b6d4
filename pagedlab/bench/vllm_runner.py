"""vLLM's offline `LLM` over one pagedlab workload, for `pagedlab bench --compare vllm`, run by the Python of
vLLM's own virtual environment (`make vllm-env` builds `.venv-vllm`):

    .venv-vllm/bin/python vllm_runner.py JOB.json RESULT.json

It imports vLLM and never pagedlab: the two pin different transformers, so they cannot share an environment, and
the bench runs this file by its path. JOB holds the model folder, dtype, the prompts (token ids) and each one's
exact output length, the engine's limits and KV budget, the warm-up size and the repeats; RESULT gets vLLM's
version, the load time (building `LLM`, which compiles for minutes on first start; reported, never timed into
throughput), each repeat's generation time and every request's tokens. Greedy, EOS ignored, as for every system.

vLLM's `LLM` spawns its engine-core process, so it must be built under `if __name__ == "__main__"`.
"""

from __future__ import annotations

import json
import sys
import time


def run(job: dict) -> dict:
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
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    detokenize = not job["skip_tokenizer_init"]  # text as pagedlab makes it, where the folder has a tokenizer
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=detokenize)
              for n in job["max_tokens"]]
    warmup = job["warmup_requests"]
    llm.generate(prompts[:warmup], params[:warmup], use_tqdm=False)  # first-call costs, untimed
    elapsed_runs, token_ids = [], None
    for _ in range(job["repeats"]):
        if job["enable_prefix_caching"]:
            llm.reset_prefix_cache()  # each repeat computes its prompts, as the first did
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_runs.append(time.perf_counter() - start)
        run_tokens = [list(o.outputs[0].token_ids) for o in outputs]
        if token_ids is not None and run_tokens != token_ids:
            raise RuntimeError("vLLM's greedy tokens changed between repeats")
        token_ids = run_tokens
    return {"version": vllm.__version__, "load_s": load_s, "elapsed_runs": elapsed_runs, "token_ids": token_ids,
            "block_size": block_size}


if __name__ == "__main__":
    job_path, result_path = sys.argv[1:3]
    with open(job_path) as f:
        result = run(json.load(f))
    with open(result_path, "w") as f:
        json.dump(result, f)
