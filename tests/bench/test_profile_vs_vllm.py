"""`scripts/profile_vs_vllm.py` sorts py-spy's samples into parts by their stacks: each of pagedlab's C++ ops, which
share one library (and so its name in every frame of theirs), goes to the part it computes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SO = "(pagedlab_paged_decode_cpu_3bfb9b867b861564.so)"
LAYER = ("LLMEngine.step (pagedlab/engine.py:149);"
         "LlamaDecoderLayer.forward (transformers/models/llama/modeling_llama.py:312)")
PREFIXES = {"attention": "attention", "linear": "linear layers", "fused": "norms, RoPE, activations (fused",
            "eager": "norms, RoPE, activations (eager"}


@pytest.fixture(scope="module")
def profile():
    spec = importlib.util.spec_from_file_location("profile_vs_vllm", ROOT / "scripts" / "profile_vs_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("frames,part", [
    (["paged_attention_forward (pagedlab/worker/attention.py:311)",
      "paged_decode_cpu (pagedlab/worker/cpu_attention.py:194)", f"paged_decode {SO}",
      f"(anonymous namespace)::attend_one<c10::BFloat16, (long)4, (long)3> {SO}"], "attention"),
    (["_rms_norm (pagedlab/worker/cpu_fused.py:207)", f"rms_norm {SO}", "0x7f3cafe1ca9d (libgomp.so.1)"], "fused"),
    (["_mlp (pagedlab/worker/cpu_fused.py:219)", f"silu_and_mul {SO}"], "fused"),
    (["_attention (pagedlab/worker/cpu_fused.py:242)", f"rotary_embedding {SO}"], "fused"),
    (["LlamaRMSNorm.forward (transformers/models/llama/modeling_llama.py:60)", "at::native::rsqrt (libtorch_cpu.so)"],
     "eager"),
    (["cpu_attention::AttentionMainLoop<cpu_attention::AttentionImpl<c10::BFloat16> > (_C.abi3.so)"], "attention"),
    # oneDNN's JIT GEMM inside the one-call decoder layer: py-spy sees no native frame above it
    (["_decoder_layer (pagedlab/worker/cpu_fused.py:285)", "OpOverloadPacket.__call__ (torch/_ops.py:1279)",
      "0x7f624a300269 (?)"], "linear"),
])
def test_each_sample_goes_to_the_part_it_computes(profile, tmp_path, frames, part):
    raw = tmp_path / "raw.txt"
    raw.write_text(";".join([LAYER, *frames]) + " 3\n")
    parts = profile.classify(raw, lambda stack: True)
    (name,) = parts
    assert parts[name] == 3 and name.startswith(PREFIXES[part]), name


def test_building_the_engine_is_not_counted_as_its_run(profile):
    packing = ("run_pagedlab.<locals>.<lambda> (pagedlab/bench/systems.py:123);"
               "LLMEngine.__init__ (pagedlab/engine.py:80);PackedLinears.__init__ (pagedlab/worker/cpu_linear.py:84)")
    assert not profile.pagedlab_timed(packing)
    assert profile.pagedlab_timed(LAYER)
    assert not profile.pagedlab_timed("Thread._bootstrap (threading.py:1012);" + LAYER)
