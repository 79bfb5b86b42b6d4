"""Bad input gets a clear error naming the problem; the engine keeps serving and no block leaks."""

from __future__ import annotations

import logging

import pytest

from pagedlab import LLM, BeamSearchParams, LLMEngine, SamplingParams
from pagedlab.config import EngineConfig
from tests.helpers import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture
def engine():
    return LLMEngine(tiny_model(), None, EngineConfig(block_size=4, num_kv_blocks=16, max_model_len=48,
                                                      max_num_batched_tokens=32))


def assert_still_serves(engine: LLMEngine) -> None:
    """A request submitted after the error completes, and every block is free again."""
    engine.add_request("after", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
        engine.check_invariants()
    assert [o.request_id for o in outputs] == ["after"] and len(outputs[0].outputs[0].token_ids) == 4
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt_token_ids": []}, "prompt is empty"),
        ([], "prompt is empty"),
        ({"prompt_token_ids": [1, 128, 5]}, "outside the vocabulary"),
        ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
        ({"prompt_token_ids": [1] * 48}, "exceeds max_model_len=48"),
        ({"prompt_token_ids": [1] * 40}, "more than max_num_batched_tokens=32"),
        ("text without a tokenizer", "no tokenizer"),
        ({"text": "x"}, "needs 'prompt' or 'prompt_token_ids'"),
    ],
)
def test_bad_prompt_is_rejected_and_engine_goes_on(engine, prompt, message):
    engine.add_request("running", {"prompt_token_ids": [4, 5, 6]}, GREEDY)
    engine.step()  # something is in flight when the bad request arrives
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, GREEDY)
    assert "bad" not in engine.scheduler.requests
    while engine.has_unfinished_requests():
        engine.step()
    assert_still_serves(engine)


def test_prompt_of_wrong_type(engine):
    with pytest.raises(TypeError, match="a prompt is a string, a list of token ids or a dict"):
        engine.add_request("bad", 3.5, GREEDY)
    assert_still_serves(engine)


def test_request_that_can_never_fit_is_rejected_at_once():
    """4 blocks of 4 tokens: a 20-token prompt could never be held, even alone."""
    engine = LLMEngine(tiny_model(), None, EngineConfig(block_size=4, num_kv_blocks=4))
    assert engine.max_model_len == 16  # capped by the KV capacity
    with pytest.raises(ValueError, match="exceeds max_model_len=16"):
        engine.add_request("huge", {"prompt_token_ids": [1] * 20}, GREEDY)
    assert_still_serves(engine)


def test_max_model_len_beyond_the_kv_cache_is_rejected_at_start():
    with pytest.raises(ValueError, match="max_model_len=64 can never fit: the KV cache holds 4 blocks"):
        LLMEngine(tiny_model(), None, EngineConfig(block_size=4, num_kv_blocks=4, max_model_len=64))
    with pytest.raises(ValueError, match="exceeds the model's limit of 512 positions"):
        LLMEngine(tiny_model(), None, EngineConfig(max_model_len=4096))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(seed="x"), "seed"),
        (dict(n=0), "n"),
        (dict(n=2, temperature=0), "n"),
        # issue 31: values that were accepted and failed or misbehaved later
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(seed=2**64 - 1, n=2), "seed"),  # sample 1 would draw with seed 2**64
        (dict(seed=True), "seed"),
        (dict(logprobs=True), "logprobs"),
        (dict(n=True), "n"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(min_tokens=True), "min_tokens"),
        (dict(top_k=True), "top_k"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(output_kind="delta"), "output_kind"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(stop=123), "stop"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(skip_special_tokens=None), "skip_special_tokens"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "length_penalty"])
def test_an_int_beyond_the_float_range_is_refused_by_name(field):
    cls = BeamSearchParams if field == "length_penalty" else SamplingParams
    kwargs = dict(beam_width=2, max_tokens=2) if cls is BeamSearchParams else {}
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field} must be a (finite )?number"):
        cls(**kwargs, **{field: 10**400})  # float(10**400) raises OverflowError


def test_a_huge_int_temperature_samples_as_a_float(engine):
    """temperature=2**63 (found by the interleavings fuzzer): the sampler's tensor of temperatures overflowed int64
    ('Overflow when unpacking long long') and the request failed."""
    params = SamplingParams(temperature=2**63, seed=0, max_tokens=3)
    assert isinstance(params.temperature, float)
    engine.add_request("hot", [1, 2, 3], params)
    while engine.has_unfinished_requests():
        assert all(c.finish_reason != "error" for o in engine.step() for c in o.outputs)
    assert_still_serves(engine)


def test_seeds_the_generator_takes_are_accepted(engine):
    """torch's generators take seeds from -2**63 to 2**64 - 1; every sample's seed (seed + i) must be one."""
    for params in (SamplingParams(seed=-(2**63)), SamplingParams(seed=2**64 - 2, n=2, max_tokens=2)):
        engine.add_request(None, [1, 2, 3], params)
    while engine.has_unfinished_requests():
        assert all(c.finish_reason != "error" for o in engine.step() for c in o.outputs)
    assert_still_serves(engine)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("logprobs", [129, 1000])
def test_more_logprobs_than_the_vocabulary_is_refused(engine, field, logprobs):
    """issue 31 (prompt_logprobs: found by the interleavings fuzzer): the step failed with 'selected index k out of
    range'."""
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}={logprobs} is more than the vocabulary"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(**{field: logprobs}))
    engine.add_request("all", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, **{field: 128}))
    while engine.has_unfinished_requests():
        engine.step()
    assert_still_serves(engine)


@pytest.mark.parametrize("token_ids", [[1, 2.0, 3], [1, True], ["a"], [None]])
def test_token_ids_that_are_not_integers_are_refused(engine, token_ids):
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        engine.add_request("bad", {"prompt_token_ids": token_ids}, GREEDY)
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        engine.add_request("bad", token_ids, GREEDY)
    assert_still_serves(engine)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=3), "block_size"),
        (dict(block_size=512), "block_size"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
        # issue 31: types as well as ranges (these gave a torch error naming no field, or were accepted)
        (dict(block_size=True), "block_size"),
        (dict(num_kv_blocks=2.5), "num_kv_blocks"),
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(num_cpu_blocks=2.0), "num_cpu_blocks"),
        (dict(max_num_seqs=2.5), "max_num_seqs"),
        (dict(max_num_seqs=float("nan")), "max_num_seqs"),
        (dict(max_num_batched_tokens=True), "max_num_batched_tokens"),
        (dict(max_model_len=100.0), "max_model_len"),
        (dict(kv_cache_memory=1.5e6), "kv_cache_memory"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization"),
        (dict(swap_space=float("nan")), "swap_space"),
        (dict(swap_space="4"), "swap_space"),
        (dict(force_preemption_rate=float("nan")), "force_preemption_rate"),
        (dict(seed=None), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(max_trace_steps=1.5), "max_trace_steps"),
        (dict(tensor_parallel_size=True), "tensor_parallel_size"),
        (dict(distributed_timeout="30"), "distributed_timeout"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(record_trace=None), "record_trace"),
    ],
)
def test_invalid_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must .*, got "):
        EngineConfig(**kwargs)


def test_duplicate_request_id(engine):
    engine.add_request("a", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="request id 'a' is already in the engine"):
        engine.add_request("a", [3, 4], GREEDY)
    engine.abort_request("a")
    assert_still_serves(engine)


@pytest.mark.parametrize("request_id", [5, [5], None])
def test_ids_are_strings_in_abort_too(engine, request_id):
    """issue 31: add_request refuses a non-string id; abort_request raised "'int' object is not iterable"."""
    with pytest.raises(TypeError, match="request_id must be a string or an iterable of strings, got"):
        engine.abort_request(request_id)
    assert_still_serves(engine)


def test_abort_unknown_id_is_a_logged_no_op(engine, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedlab"):
        engine.abort_request("never-added")
    assert "no unfinished request has id 'never-added'" in caplog.text
    assert_still_serves(engine)


@pytest.mark.parametrize("when", ["waiting", "running", "after-finish"])
def test_abort_frees_blocks_at_once(engine, when):
    engine.add_request("a", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=20))
    if when != "waiting":
        engine.step()
        assert engine.kv_cache_manager.block_tables["a"].block_ids
    if when == "after-finish":
        engine.abort_request("a")
    engine.abort_request("a")
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert_still_serves(engine)


def test_generate_with_one_bad_prompt_leaves_nothing_behind():
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[1, 2, 3], [], [4, 5]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.stats().num_used_blocks == 0


def test_sampling_params_count_must_match_prompts():
    llm = LLM(tiny_model(), block_size=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate([[1], [2]], [GREEDY] * 3, use_tqdm=False)


def test_unsupported_model_is_refused_at_load():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="cannot run model type 'gpt2'.*llama, mistral, qwen2, qwen3"):
        LLM(model)


def test_encoder_model_is_refused_at_load():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="cannot run model type 'bert'"):
        LLM(model)


@pytest.mark.parametrize("dtype, device", [("float64", "cpu"), ("auto", "tpu")])
def test_bad_dtype_or_device(dtype, device):
    with pytest.raises(ValueError, match="dtype must be one of|device must be 'cpu', 'cuda' or 'auto'"):
        LLM(tiny_model(), dtype=dtype, device=device)


@pytest.mark.parametrize("salt", [123, ["a"], "", "\ud800"])
def test_a_bad_cache_salt_is_refused_and_nothing_else_breaks(salt):
    """issue 31: a non-string or unencodable salt was accepted, and with prefix caching every later step raised."""
    engine = LLMEngine(tiny_model(), None, EngineConfig(block_size=4, num_kv_blocks=16, enable_prefix_caching=True))
    engine.add_request("running", {"prompt_token_ids": [4, 5, 6, 7, 8], "cache_salt": "tenant"}, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=r"cache_salt must be a non-empty string that UTF-8 can encode, got"):
        engine.add_request("bad", {"prompt_token_ids": [1, 2, 3, 4, 5], "cache_salt": salt}, GREEDY)
    while engine.has_unfinished_requests():
        assert all(c.finish_reason != "error" for o in engine.step() for c in o.outputs)
    assert_still_serves(engine)
