"""A Llama decoder layer's decode step in one C++ call (`cpu_fused.FusedModules.decode_layer_inputs`,
csrc/llama_layer_cpu.cpp): it runs the Python forwards' kernels in their order, so its logits are theirs to the
bit; it takes only what it computes the same way (decodes alone, packed weights, no hooks), and the rest keeps the
Python layers."""

from __future__ import annotations

import pytest
import torch

from pagedlab.config import EngineConfig
from pagedlab.engine import LLMEngine
from pagedlab.sampling_params import SamplingParams
from pagedlab.worker import cpu_attention, cpu_linear
from tests.helpers import hf_greedy, random_prompts, run_engine, tiny_model

pytestmark = pytest.mark.skipif(cpu_attention.kernel() is None, reason="the C++ CPU kernels could not be built here")

PROMPTS = random_prompts([5, 17, 9, 30, 3])


def _engine(model, one_call: bool, **options) -> tuple[LLMEngine, list[int]]:
    """An engine whose decoder layers take the one-call path (`one_call`) or never do; the list counts the layer
    calls that took it."""
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64, linear_backend="onednn", **options))
    fused = engine.worker.model_runner.fused
    taken = []
    if one_call:
        inputs = fused.decode_layer_inputs

        def counted(*args):
            found = inputs(*args)
            taken.append(found is not None)
            return found

        fused.decode_layer_inputs = counted
    else:
        fused.layers = []
    return engine, taken


def _logprobs(engine, prompts, max_tokens=10) -> list:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3))
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
    return [(done[str(i)].token_ids, done[str(i)].logprobs) for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_call_layer_gives_the_python_layers_logprobs_to_the_bit(dtype, linear_path):
    model = tiny_model("llama").to(dtype)
    one_call, taken = _engine(model, True)
    python, _ = _engine(model, False)
    assert one_call.worker.model_runner.fused.layers, "tiny Llama's layers qualify"
    assert _logprobs(one_call, PROMPTS) == _logprobs(python, PROMPTS)
    assert any(taken), "no decode step took the one-call layer"
    assert not all(taken), "the prefill steps keep the Python layers"


def test_rows_that_go_to_mkl_keep_the_python_layer(monkeypatch):
    monkeypatch.setattr(cpu_linear, "UNPACKED_ROWS", len(PROMPTS))  # every decode step of float32 through MKL
    model = tiny_model("llama")
    one_call, taken = _engine(model, True)
    python, _ = _engine(model, False)
    assert _logprobs(one_call, PROMPTS) == _logprobs(python, PROMPTS)
    assert taken and not any(taken)


def test_greedy_tokens_with_the_one_call_layer_equal_hugging_face(linear_path):
    model = tiny_model("llama")
    engine, taken = _engine(model, True, enable_chunked_prefill=True, max_num_batched_tokens=16)
    assert run_engine(engine, PROMPTS, 12) == hf_greedy(model, PROMPTS, 12)
    assert any(taken) or linear_path != "every product packed"
    assert not any("forward" in m.__dict__ for m in model.modules()), "a layer kept the engine's forward"


def test_the_kernel_switched_off_keeps_the_python_layer(monkeypatch):
    model = tiny_model("llama")
    one_call, taken = _engine(model, True)
    python, _ = _engine(model, False)
    monkeypatch.setenv("PAGEDLAB_CPU_KERNEL", "0")  # the attention's torch path, which the one call is not
    assert _logprobs(one_call, PROMPTS[:2], 6) == _logprobs(python, PROMPTS[:2], 6)
    assert taken and not any(taken)


def test_a_hook_anywhere_in_the_layer_keeps_the_python_layer(monkeypatch):
    """Tensor parallelism's all-reduce and transformers' output recording are forward hooks: the one C++ call
    would skip them."""
    monkeypatch.setattr(cpu_linear, "UNPACKED_ROWS", 0)  # two rows packed on an Intel CPU too, as on any other
    model = tiny_model("llama")
    calls = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *_: calls.append(1))
    engine, taken = _engine(model, True)
    calls.clear()  # the forwards its swap-or-recompute cost model timed while the engine was built
    python, _ = _engine(tiny_model("llama"), False)
    assert _logprobs(engine, PROMPTS[:2], 6) == _logprobs(python, PROMPTS[:2], 6)
    layers = model.config.num_hidden_layers
    assert len(calls) == len(taken) // layers, "the hook ran on every step's layer 0"
    assert taken[::layers] == [False] * (len(taken) // layers), "layer 0 kept the Python path"
    assert any(taken), "the layers without hooks took the one call"


def test_packed_linears_give_a_weight_changed_in_place_packed_again():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    linears = cpu_linear.PackedLinears(model)
    first = linears.packed(model[0])
    assert linears.packed(model[0]) is first
    with torch.no_grad():
        model[0].weight.mul_(2)
    again = linears.packed(model[0])
    assert again is not first and linears.num_packs == 2
    assert linears.packed(torch.nn.Linear(8, 4)) is None, "a layer it does not hold"


def test_a_weight_changed_or_replaced_between_calls_is_the_one_computed_with():
    model = tiny_model("llama")
    one_call, taken = _engine(model, True)
    _logprobs(one_call, PROMPTS[:2], 4)  # the layers' weights packed for the one call
    with torch.no_grad():  # a training step between two engine calls; a tensor-parallel shard
        model.model.layers[1].self_attn.o_proj.weight.mul_(2)
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    q_proj = model.model.layers[1].self_attn.q_proj
    q_proj.weight = torch.nn.Parameter(torch.randn_like(q_proj.weight) * 0.1)
    python, _ = _engine(model, False)
    taken.clear()
    assert _logprobs(one_call, PROMPTS) == _logprobs(python, PROMPTS)
    assert any(taken)


def test_a_hook_added_or_removed_between_calls_is_seen():
    """The layers' plans are checked once a step, all together (`_LayerPlans.holds`): a hook that arrives after
    they were made, or leaves, changes which layers take the one call from the next step on."""
    model = tiny_model("llama")
    engine, taken = _engine(model, True)
    expected, _ = _engine(tiny_model("llama"), False)
    reference = _logprobs(expected, PROMPTS[:2], 6)
    assert _logprobs(engine, PROMPTS[:2], 6) == reference and all(taken[-2:])  # plans made, no hooks
    calls = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *_: calls.append(1))
    taken.clear()
    assert _logprobs(engine, PROMPTS[:2], 6) == reference
    layers = model.config.num_hidden_layers
    steps = len(taken) // layers  # the prefill's, then the decode steps'
    assert steps > 1 and len(calls) == steps, "the hook ran on every step"
    assert taken[1::layers] == [False] * steps, "layer 1 kept the Python path"
    assert taken[layers::layers] == [True] * (steps - 1), "layer 0 took the one call on every decode step"
    handle.remove()
    taken.clear()
    assert _logprobs(engine, PROMPTS[:2], 6) == reference and all(taken[layers:]), "every decode step one call again"
