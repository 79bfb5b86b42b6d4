"""The fused CPU norms, MLPs and attention projections (`pagedlab.worker.cpu_fused`, csrc/fused_cpu.cpp): the ops
compute what Hugging Face's modules compute (the rotary embedding to the bit), only Llama-style modules take them,
they are installed for the engine's calls only, a changed gate, up, q, k or v weight is packed again, and greedy
tokens equal Hugging Face's with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.mistral.modeling_mistral import MistralAttention

from pagedlab.config import EngineConfig
from pagedlab.engine import LLMEngine
from pagedlab.worker import cpu_attention, cpu_linear
from pagedlab.worker.cpu_fused import FusedModules, is_llama_attention, is_llama_mlp, is_llama_norm
from tests.helpers import hf_greedy, random_prompts, run_engine, tiny_model

kernel = cpu_attention.kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the C++ CPU kernels could not be built here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_hugging_faces(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    x = (torch.randn(37, 2 * 96) * 3).to(dtype)[:, ::2].contiguous()
    rows = torch.randn(37, 2 * 96).to(dtype)[:, :96]  # a row stride that is not the width
    for inp in (x, rows):
        out = torch.empty_like(inp, memory_format=torch.contiguous_format)
        kernel.rms_norm(out, inp, norm.weight, 1e-5)
        torch.testing.assert_close(out, norm(inp), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_is_silu_times_up_over_floats_whole_range(dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(29, 2 * 70) * 8).to(dtype)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 150.0, -150.0])
    gate_up[1, :4] = torch.tensor([3e38, -3e38, 1e-3, -1e-3])
    gate, up = gate_up[:, :70], gate_up[:, 70:]
    out = torch.empty(29, 70, dtype=dtype)
    kernel.silu_and_mul(out, gate, up)
    expected = F.silu(gate) * up
    assert torch.isfinite(out[2:]).all()
    torch.testing.assert_close(out, expected, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_rotary_embedding_is_hugging_faces_to_the_bit(dtype):
    """q and k as slices of one q/k/v product (9 query and 3 KV heads of 64, SmolLM2's), against transformers'
    `apply_rotary_pos_emb` on the same values: equal bit for bit, which a product fused into the sum (an FMA,
    as gcc emits unless told not to) is not in float32."""
    torch.manual_seed(0)
    tokens, q_heads, kv_heads, head_dim = 37, 9, 3, 64
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim) * 4).to(dtype)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cos, sin = (torch.randn(1, tokens, head_dim).to(dtype) for _ in range(2))
    expected_q, expected_k = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
    q_out, k_out = torch.empty(q.shape, dtype=dtype), torch.empty(k.shape, dtype=dtype)
    kernel.rotary_embedding(q_out, k_out, q, k, cos[0], sin[0])
    assert torch.equal(q_out, expected_q[0].transpose(0, 1))
    assert torch.equal(k_out, expected_k[0].transpose(0, 1))


def test_the_ops_name_what_they_refuse():
    with pytest.raises(RuntimeError, match="gate, up and out must share one shape"):
        kernel.silu_and_mul(torch.empty(3, 4), torch.empty(3, 4), torch.empty(3, 5))
    with pytest.raises(RuntimeError, match="weight must be \\[hidden\\]"):
        kernel.rms_norm(torch.empty(3, 4), torch.empty(3, 4), torch.empty(5), 1e-6)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 only"):
        kernel.rms_norm(*(torch.empty(3, 4, dtype=torch.float64),) * 2, torch.empty(4, dtype=torch.float64), 1e-6)
    q, k, cos = torch.empty(3, 2, 8), torch.empty(3, 1, 8), torch.empty(3, 8)
    with pytest.raises(RuntimeError, match="cos and sin must be \\[tokens, head_dim\\]"):
        kernel.rotary_embedding(q, k, q, k, cos, torch.empty(3, 6))
    with pytest.raises(RuntimeError, match="head_dim must be even, got 7"):
        kernel.rotary_embedding(*(torch.empty(3, 2, 7),) * 4, *(torch.empty(3, 7),) * 2)


def test_only_modules_whose_forward_is_llamas_qualify():
    class Shifted(LlamaRMSNorm):  # a forward of its own: not Llama's
        def forward(self, hidden_states):
            return super().forward(hidden_states) + 1

    class Documented(LlamaRMSNorm):  # the same statements under a docstring: Llama's
        def forward(self, hidden_states):
            """Documented."""
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    assert is_llama_norm(LlamaRMSNorm(8)) and is_llama_norm(Documented(8))
    assert not is_llama_norm(Shifted(8)) and not is_llama_norm(nn.LayerNorm(8)) and not is_llama_norm(GemmaRMSNorm(8))
    config = tiny_model("llama").config
    mlp = LlamaMLP(config)
    assert is_llama_mlp(mlp)
    mlp.act_fn = nn.GELU()
    assert not is_llama_mlp(mlp)
    assert is_llama_attention(LlamaAttention(config, 0))
    assert not is_llama_attention(MistralAttention(config, 0)), "it passes a sliding window: a forward of its own"


@pytest.mark.parametrize("pack_stacked", [True, False])
def test_fused_modules_compute_the_models_logits_and_leave_it_as_it_was(pack_stacked, linear_path):
    model = tiny_model("llama")
    ids = torch.tensor([random_prompts([23])[0]])
    with torch.inference_mode():
        expected = model(ids).logits
        fused = FusedModules(model, kernel, pack_stacked)
        assert len(fused.norms) == 2 * model.config.num_hidden_layers + 1
        assert len(fused.mlps) == len(fused.attentions) == model.config.num_hidden_layers
        assert len(fused.stacked_layers) == (5 * model.config.num_hidden_layers if pack_stacked else 0)
        with fused.installed():
            assert all("forward" in m.__dict__ for m in fused.norms + fused.mlps + fused.attentions)
            got = model(ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        assert not any("forward" in m.__dict__ for m in model.modules()), "a module kept the fused forward"
        assert torch.equal(model(ids).logits, expected)


def test_a_stacked_weight_changed_in_place_or_replaced_is_packed_again(monkeypatch):
    monkeypatch.setattr(cpu_linear, "UNPACKED_ROWS", -1)  # every product on the packed copies
    torch.manual_seed(0)
    config = tiny_model("llama").config
    mlp, attention = LlamaMLP(config), LlamaAttention(config, layer_idx=0).eval()  # in training: its own forward
    fused = FusedModules(nn.ModuleList([mlp, attention]), kernel, pack_stacked=True)
    x = torch.randn(1, 5, config.hidden_size)
    position_embeddings = LlamaRotaryEmbedding(config)(x, torch.arange(5)[None])

    def same_as_the_modules_own():
        with torch.inference_mode(), fused.installed():
            torch.testing.assert_close(mlp(x), LlamaMLP.forward(mlp, x), rtol=1e-4, atol=1e-5)
            expected = LlamaAttention.forward(attention, x, position_embeddings)[0]
            torch.testing.assert_close(attention(x, position_embeddings)[0], expected, rtol=1e-4, atol=1e-5)

    same_as_the_modules_own()
    with torch.no_grad():  # a training step between two engine calls
        mlp.up_proj.weight.mul_(2)
        attention.v_proj.weight.mul_(2)
    same_as_the_modules_own()
    mlp.gate_proj.weight = nn.Parameter(torch.randn_like(mlp.gate_proj.weight))  # a tensor-parallel shard
    attention.k_proj.weight = nn.Parameter(torch.randn_like(attention.k_proj.weight))
    same_as_the_modules_own()
    assert len(fused._stacked_cache) == 2, "the gate and up, and q, k and v, each packed as one"


def test_a_few_rows_take_the_stacked_layers_through_mkl_and_more_take_the_packed_stack(monkeypatch):
    monkeypatch.setattr(cpu_linear, "UNPACKED_ROWS", cpu_linear.MKL_ROWS)  # the rule on an Intel CPU
    torch.manual_seed(0)
    config = tiny_model("llama").config
    config.hidden_size, config.intermediate_size = 576, 1536  # SmolLM2's
    mlp = LlamaMLP(config)
    fused = FusedModules(mlp, kernel, pack_stacked=True)
    layers = (mlp.gate_proj, mlp.up_proj)
    packed = cpu_linear.pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    with torch.inference_mode():
        for rows in (1, 3, 4, 32):
            x = torch.randn(rows, 576)
            unpacked = cpu_linear.unpacked_wins(rows, mlp.gate_proj.weight)
            expected = (torch.cat([F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight)], dim=-1)
                        if unpacked else cpu_linear.packed_linear(x, packed, None))
            assert unpacked == (rows <= 3)
            got = torch.cat(fused.projections(mlp, layers, x), dim=-1)
            assert torch.equal(got, expected), f"{rows} rows took the other path"
            with fused.installed():
                torch.testing.assert_close(mlp(x), LlamaMLP.forward(mlp, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family,linear_backend", [("llama", "onednn"), ("qwen3", "torch"), ("qwen2", "onednn")])
def test_greedy_tokens_with_fused_modules_equal_hugging_face(family, linear_backend, linear_path):
    model = tiny_model(family)
    prompts = random_prompts([5, 17, 9, 30])
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64, linear_backend=linear_backend,
                                                 enable_chunked_prefill=True, max_num_batched_tokens=16))
    fused = engine.worker.model_runner.fused
    assert fused is not None and fused.mlps
    if linear_backend == "onednn":  # the gate and up weights, and q, k and v, packed once as one each
        assert not fused.stacked_layers & set(engine.worker.model_runner.linears.modules)
    assert run_engine(engine, prompts, 12) == hf_greedy(model, prompts, 12)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert bool(fused.attentions) == (family == "llama"), "Qwen2's and Qwen3's attention forwards are their own"
    if family == "llama" and linear_backend == "onednn":
        assert all(m in fused._stacked_cache for m in fused.attentions), "q, k and v were computed as one product"


def test_cpu_fused_ops_false_runs_the_modules_own_forward():
    engine = LLMEngine(tiny_model("llama"), None, EngineConfig(block_size=4, num_kv_blocks=16, cpu_fused_ops=False))
    assert engine.worker.model_runner.fused is None
