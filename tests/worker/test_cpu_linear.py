"""oneDNN's packed linear layers (`pagedlab.worker.cpu_linear`): close to `nn.Linear`, installed for the engine's
calls only, repacked when a weight changes, hooks kept, the smallest products left to MKL; greedy tokens equal
Hugging Face's with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pagedlab.config import EngineConfig
from pagedlab.engine import LLMEngine
from pagedlab.worker import cpu_linear
from pagedlab.worker.cpu_linear import PackedLinears
from tests.helpers import hf_greedy, random_prompts, run_engine, tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def test_packed_linears_compute_what_the_modules_compute_and_leave_them_as_they_were(linear_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))
    x = torch.randn(7, 24)
    expected = model(x)
    packed = PackedLinears(model)
    assert len(packed.modules) == 2 and packed.num_packs == 2
    with torch.inference_mode(), packed.installed():
        assert all("forward" in m.__dict__ for m in packed.modules)
        got = model(x)
        got_3d = model(x[None])[0]  # the engine's flat batch: [1, tokens, features]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_3d, expected)
    assert not any("forward" in m.__dict__ for m in packed.modules), "a module kept the packed forward"
    assert torch.equal(model(x), expected)


def test_a_weight_changed_in_place_or_replaced_is_packed_again(monkeypatch):
    monkeypatch.setattr(cpu_linear, "UNPACKED_ROWS", -1)  # every product on the packed copy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    packed, x = PackedLinears(model), torch.randn(3, 16)
    with torch.no_grad():
        model[0].weight.mul_(2)  # a training step between two engine calls
    with torch.inference_mode(), packed.installed():
        torch.testing.assert_close(model(x), nn.functional.linear(x, model[0].weight, model[0].bias))
    model[0].weight = nn.Parameter(torch.randn(8, 16))  # a tensor-parallel shard
    model[0].bias = None
    with torch.inference_mode(), packed.installed():
        torch.testing.assert_close(model(x), nn.functional.linear(x, model[0].weight))
    assert packed.num_packs == 3


def test_hooks_still_run_and_other_dtypes_keep_their_own_forward():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.float16))
    model[0].register_forward_hook(lambda _m, _a, out: out * 0)  # e.g. tensor parallelism's all-reduce
    packed = PackedLinears(model)
    assert packed.modules == [model[0]]
    with torch.inference_mode(), packed.installed():
        assert torch.equal(model[0](torch.randn(2, 8)), torch.zeros(2, 8))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tokens_with_packed_linears_equal_hugging_face(family, linear_path):
    model = tiny_model(family)
    prompts = random_prompts([5, 17, 9, 30])
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64, linear_backend="onednn",
                                                 enable_chunked_prefill=True, max_num_batched_tokens=16))
    assert engine.worker.linear_backend == "onednn"
    assert run_engine(engine, prompts, 12) == hf_greedy(model, prompts, 12)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_few_float32_rows_go_to_mkl_on_the_modules_own_weight_and_more_to_the_packed_copy(monkeypatch):
    """On an Intel CPU, up to 3 rows MKL's own kernel is faster than oneDNN's packed one: a decode step of a few
    sequences goes through `nn.Linear` (SmolLM2's shapes on a 2-core Xeon, `scripts/bench_cpu_linear.py`)."""
    monkeypatch.setattr(cpu_linear, "UNPACKED_ROWS", cpu_linear.unpacked_rows("GenuineIntel"))
    torch.manual_seed(0)
    layer = nn.Linear(576, 576)  # SmolLM2's q_proj
    packed = PackedLinears(layer)
    with torch.inference_mode(), packed.installed():
        for rows in (1, 3, 4, 32):
            x = torch.randn(1, rows, 576)  # the engine's flat batch
            expected = (F.linear(x, layer.weight, layer.bias) if rows <= 3
                        else cpu_linear.packed_linear(x, cpu_linear.pack(layer.weight), layer.bias))
            assert torch.equal(layer(x), expected), f"{rows} rows took the other path"
    assert cpu_linear.unpacked_wins(3, layer.weight) and not cpu_linear.unpacked_wins(4, layer.weight)
    assert not cpu_linear.unpacked_wins(1, layer.weight.bfloat16()), "bfloat16 was not measured: it stays packed"


def test_auto_packs_float32_and_native_bfloat16_on_cpu_and_onednn_refuses_what_it_cannot_run():
    from pagedlab.worker.worker import resolve_linear_backend

    cpu = torch.device("cpu")
    assert resolve_linear_backend("auto", cpu, torch.float32) == "onednn"
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert resolve_linear_backend("auto", cpu, torch.bfloat16) == ("onednn" if native_bf16 else "torch")
    assert resolve_linear_backend("onednn", cpu, torch.bfloat16) == "onednn"
    with pytest.raises(ValueError, match="linear_backend='onednn' runs float32 or bfloat16 weights on CPU"):
        resolve_linear_backend("onednn", cpu, torch.float16)
    with pytest.raises(ValueError, match="linear_backend must be 'auto', 'torch' or 'onednn', got 'mkl'"):
        EngineConfig(linear_backend="mkl")
    assert cpu_linear.supported(cpu, torch.float32) and not cpu_linear.supported(cpu, torch.float16)


def test_a_forward_the_user_set_on_a_module_is_restored_after_the_call():
    model = nn.Sequential(nn.Linear(8, 8))
    own = model[0].forward = lambda x: x * 2  # an instance attribute, like a user's patch
    packed = PackedLinears(model)
    with packed.installed():
        assert model[0].forward is not own
    assert model[0].forward is own


def test_only_an_intel_cpu_sends_a_few_rows_to_mkl():
    """MKL picks its fast kernels on Intel CPUs only; on an AMD EPYC it runs its generic code
    (`mkl_blas_def_xsgemv`), and a decode step of 1 to 3 sequences took 1.5-3x as long as on the packed copy
    (2-core AMD EPYC with AVX-512, 2 threads: 3 sequences 114 against 36 ms, `scripts/bench_unpacked_rows.py`)."""
    assert cpu_linear.unpacked_rows("GenuineIntel") == 3
    assert cpu_linear.unpacked_rows("AuthenticAMD") == 0
    assert cpu_linear.unpacked_rows(None) == 0, "a CPU whose vendor is unknown keeps every product packed"
    assert cpu_linear.UNPACKED_ROWS == cpu_linear.unpacked_rows(cpu_linear.cpu_vendor())
    layer = nn.Linear(576, 576)
    assert cpu_linear.unpacked_wins(1, layer.weight) == (cpu_linear.cpu_vendor() == "GenuineIntel")
