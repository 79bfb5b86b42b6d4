"""`pagedlab bench --compare vllm`: vLLM runs in its own virtual environment, driven through
`pagedlab/bench/vllm_runner.py` in a subprocess. Here a stand-in `vllm` package (an `LLM` that records how it was
built and answers with made-up tokens) plays vLLM, so that the protocol, the settings passed and the table are
checked without vLLM; `test_real_vllm_gives_hugging_faces_tokens` runs the real one where `make vllm-env` built it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pagedlab.bench import run_benchmark, systems
from tests.bench.test_bench import TINY
from tests.helpers import tiny_model

FAKE_VLLM = '''
import json, os
__version__ = "0.0-stand-in"

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, detokenize):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens

class _Out:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class _RequestOutput:
    def __init__(self, token_ids):
        self.outputs = [_Out(token_ids)]

class LLM:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("the stand-in refuses to start")
        if os.environ.get("FAKE_VLLM_HANG"):
            import time
            time.sleep(600)
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            json.dump({"kwargs": kwargs, "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}, f)

    class llm_engine:
        class vllm_config:
            class cache_config:
                block_size = 32

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=True):
        if os.environ.get("FAKE_VLLM_EVENTS"):
            with open(os.environ["FAKE_VLLM_EVENTS"], "a") as f:
                f.write(f"vllm {len(prompts)}\\n")
        return [_RequestOutput([(sum(p["prompt_token_ids"]) + i) % 128 for i in range(s.max_tokens)])
                for p, s in zip(prompts, params)]
'''


@pytest.fixture
def stand_in_vllm(tmp_path, monkeypatch):
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    record = tmp_path / "record.json"
    monkeypatch.setenv("PAGEDLAB_VLLM_PYTHON", str(python))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    return record


def tiny_folder(tmp_path) -> Path:
    folder = tmp_path / "tiny-llama"
    tiny_model().save_pretrained(folder)
    return folder


def test_vllm_joins_the_chat_table_with_pagedlabs_settings(tmp_path, stand_in_vllm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder(tmp_path))  # name_or_path: its folder
    report = run_benchmark("chat", model=model, progress=False, compare=("vllm",), **TINY)
    rows = {row["system"]: row for row in report.tables["chat"].rows}
    assert list(rows) == ["pagedlab", "vllm"] and rows["vllm"]["output_tok_s"] > 0
    assert 0 <= rows["vllm"]["same_tokens"] <= 1
    vllm = next(r for r in report.results if r.system == "vllm")
    paged = next(r for r in report.results if r.system == "pagedlab")
    assert [len(t) for t in vllm.token_ids] == [len(t) for t in paged.token_ids]  # exact lengths, EOS ignored
    built = json.loads(stand_in_vllm.read_text())
    kwargs = built["kwargs"]
    assert kwargs["model"] == str(tmp_path / "tiny-llama") and kwargs["dtype"] == "float32"
    assert "block_size" not in kwargs and kwargs["max_num_seqs"] == TINY["max_num_seqs"]  # vLLM's own block size
    assert kwargs["enable_prefix_caching"] is False and kwargs["kv_cache_memory_bytes"] > 0
    assert built["bind"] == systems.vllm_thread_env(vllm.extra["threads"])["VLLM_CPU_OMP_THREADS_BIND"]
    notes = " ".join(report.tables["chat"].notes)
    assert "vLLM 0.0-stand-in" in notes and "untimed" in notes and "blocks of 32 (vLLM's choice)" in notes


def test_vllms_timed_runs_alternate_with_pagedlabs(tmp_path, monkeypatch, stand_in_vllm):
    """Interleaved: pagedlab, vLLM (built after pagedlab's first run sizes its KV budget, then warmed up on
    VLLM_WARMUP_REQUESTS), pagedlab, vLLM, ...; one vLLM process for all its runs, ended with the bench."""
    from transformers import AutoModelForCausalLM

    events = tmp_path / "events.txt"
    monkeypatch.setenv("FAKE_VLLM_EVENTS", str(events))
    run_once = systems._run_pagedlab_once

    def recorded(*args):
        with events.open("a") as f:
            f.write("pagedlab\n")
        return run_once(*args)

    monkeypatch.setattr(systems, "_run_pagedlab_once", recorded)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder(tmp_path))
    report = run_benchmark("chat", model=model, progress=False, compare=("vllm",), **{**TINY, "repeats": 3})
    n = TINY["num_requests"]
    warmup = f"vllm {min(systems.VLLM_WARMUP_REQUESTS, n)}"
    assert events.read_text().split("\n")[:-1] == ["pagedlab", warmup, f"vllm {n}", "pagedlab", f"vllm {n}",
                                                    "pagedlab", f"vllm {n}"]
    vllm = next(r for r in report.results if r.system == "vllm")
    assert len(vllm.elapsed_runs) == 3
    assert "alternating with pagedlab's" in " ".join(report.tables["chat"].notes)


def test_vllm_joins_the_prefix_table_with_its_prefix_caching_on(tmp_path, stand_in_vllm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder(tmp_path))
    report = run_benchmark("prefix", model=model, progress=False, compare=("vllm",),
                           **{**TINY, "num_requests": 4, "max_num_batched_tokens": 64, "repeats": 2})
    rows = report.tables["prefix"].rows
    assert [(r["system"], r["prefix_caching"]) for r in rows] == [("pagedlab", False), ("pagedlab", True),
                                                                  ("vllm", True)]
    assert rows[2]["output_tok_s"] > 0 and rows[2]["outputs_identical"] is False  # the stand-in's made-up tokens
    assert json.loads(stand_in_vllm.read_text())["kwargs"]["enable_prefix_caching"] is True
    vllm = next(r for r in report.results if r.system == "vllm")
    assert len(vllm.elapsed_runs) == 2
    assert "alternating with pagedlab's with caching on" in " ".join(report.tables["prefix"].notes)


def test_vllm_refused_with_what_to_do(tmp_path, monkeypatch, stand_in_vllm):
    monkeypatch.setenv("PAGEDLAB_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(ValueError, match="make vllm-env"):
        systems.vllm_python()
    monkeypatch.delenv("PAGEDLAB_VLLM_PYTHON")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"\.venv-vllm/bin/python does not exist"):
        systems.vllm_python()
    with pytest.raises(ValueError, match="loads the model from its folder"):
        run_benchmark("chat", model=tiny_model(), progress=False, compare=("vllm",), **TINY)


def test_a_failing_vllm_runner_is_an_error_with_its_output(tmp_path, monkeypatch, stand_in_vllm):
    from pagedlab.bench import workloads

    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    workload = workloads.chat(None, 128, 2, 0, (5, 10), 4, (2, 6))
    with pytest.raises(RuntimeError, match="(?s)vLLM's runner failed.*the stand-in refuses to start"):
        systems.run_vllm(str(tiny_folder(tmp_path)), workload, dtype="float32", threads=1, max_num_seqs=8,
                         max_num_batched_tokens=64, max_model_len=32, kv_cache_memory_bytes=1 << 20)


def test_a_runner_that_does_not_answer_is_stopped_with_an_error(tmp_path, monkeypatch, stand_in_vllm):
    from pagedlab.bench import workloads

    monkeypatch.setenv("FAKE_VLLM_HANG", "1")
    workload = workloads.chat(None, 128, 2, 0, (5, 10), 4, (2, 6))
    with pytest.raises(RuntimeError, match=r"vLLM's runner failed \(no answer within 2 s\)"):
        systems.VLLMSession(str(tiny_folder(tmp_path)), workload, dtype="float32", threads=1, max_num_seqs=8,
                            max_num_batched_tokens=64, max_model_len=32, kv_cache_memory_bytes=1 << 20, timeout_s=2)


def test_the_session_names_its_runners_process(tmp_path, stand_in_vllm):
    """`pid` is the runner's process (a profiler attaches to it and its children), alive until the session closes."""
    from pagedlab.bench import workloads

    workload = workloads.chat(None, 128, 2, 0, (5, 10), 4, (2, 6))
    with systems.VLLMSession(str(tiny_folder(tmp_path)), workload, dtype="float32", threads=1, max_num_seqs=8,
                             max_num_batched_tokens=64, max_model_len=32, kv_cache_memory_bytes=1 << 20) as session:
        os.kill(session.pid, 0)  # alive: no error
        session.run_once()
    with pytest.raises(ProcessLookupError):
        os.kill(session.pid, 0)


@pytest.mark.slow
@pytest.mark.skipif(not (Path.cwd() / systems.VLLM_VENV / ".vllm-installed").exists()
                    and not os.environ.get("PAGEDLAB_VLLM_PYTHON"), reason="no vLLM environment (make vllm-env)")
def test_real_vllm_gives_hugging_faces_tokens(tmp_path):
    """The real vLLM on a tiny model folder: its greedy tokens are Hugging Face's, as pagedlab's are. (Head dim 64:
    vLLM's CPU attention refuses the usual tiny model's 16.)"""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedlab.bench import workloads
    from tests.helpers import hf_greedy

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                         initializer_range=0.1)).eval()
    model.save_pretrained(tmp_path / "tiny-llama-64")
    workload = workloads.chat(None, 128, 4, 0, (5, 20), 6, (2, 10))
    result = systems.run_vllm(str(tmp_path / "tiny-llama-64"), workload, dtype="float32", threads=1, max_num_seqs=8,
                              max_num_batched_tokens=256, max_model_len=64, kv_cache_memory_bytes=1 << 26)
    with torch.inference_mode():
        expected = [hf_greedy(model, [list(r.prompt_token_ids)], r.max_tokens)[0] for r in workload.requests]
    assert result.token_ids == expected and result.extra["load_s"] > 0
