"""Random interleavings of the whole public API over combinations of features: the engine's promises hold whatever
the order, and odd input is refused by name or served.

A Hypothesis state machine builds an engine from a random combination: a model family, a block size from 1 to
16, a tiny pool, budgets down to one token, every preemption mode (whole or partial, forced at random), chunked
prefill, prefix caching, an fp8 cache and every speculative method (n-gram lookup; a draft model: a random one,
the target itself, the target's first layer). It adds requests (greedy, seeded samples with n > 1, beam search;
prompts as token ids, dicts or text, sharing prefixes, ending inside a character; stop strings, some taken from
the request's own output so that they end on its min_tokens-th token or in its last halves of characters;
min_tokens, stop token ids, logprobs), odd input (a value from a pool of odd values for one field of
SamplingParams, BeamSearchParams or EngineConfig; odd token ids, cache salts and request ids), aborts and steps,
checking the invariants after every step.

Odd input is refused before anything changes, with a ValueError naming the field (a TypeError for an id that is
no string), or it is well typed (what a field declares: a bool is no int, NaN no number) and served. At the end
the engine drains within a bounded number of steps (no livelock) and nothing leaked. Every finished request has
no error, the tokens it gets when run alone with ample memory, the text a plain decode of its tokens gives (not
the incremental one: the reference below), and what its settings promise (no stop token before min_tokens, a
nucleus of one token is greedy, logprobs of the asked size). The model is a tiny random model with
`ByteTokenizer`, so text, split characters and stop strings are real.

The default run is a few minutes (marked slow); PAGEDLAB_FUZZ_EXAMPLES=N runs N examples instead (issue 31's
fuzzer ran thousands of trials).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import types
import typing

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedlab import LLMEngine, SamplingParams
from pagedlab.config import EngineConfig
from pagedlab.sampling_params import BeamSearchParams
from pagedlab.spec_decode.self_draft import self_draft
from pagedlab.worker.worker import Worker
from tests.helpers import TINY_CONFIG, ByteTokenizer, InOrderPipeline, tiny_model

pytestmark = pytest.mark.slow  # a few minutes: `make test-fast` leaves it out
FAMILIES = ("llama", "qwen2", "qwen3", "mistral-window8", "llama-gqa3-hd80")
MODELS = {family: tiny_model(family) for family in FAMILIES}
RANDOM_DRAFT = tiny_model("llama", seed=1)  # its drafts are mostly rejected
TOKENIZER = ByteTokenizer()
VOCAB_SIZE = TINY_CONFIG["vocab_size"]
PREFIXES = ([5, 17, 33, 2, 9, 41, 7, 12], [60, 61, 62, 63, 64, 65], [90, 3])
ODD = (True, False, None, 0, 1, -1, 2, 1.5, 1e-46, math.nan, math.inf, -math.inf, VOCAB_SIZE, VOCAB_SIZE + 1,
       2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**400, "1", "", "\ud800", "delta", [1], ["a"], [1.5])
KINDS = ("greedy", "samples", "beams")
FIXED_STOPS = (("e",), ("5",), ("\ufffd",), ("e", "ab"))
ODD_TOKEN_IDS = (1.5, True, -1, VOCAB_SIZE, 2**64, "a", None)
ODD_SALTS = ("tenant", 123, ["a"], "", "\ud800")
ODD_REQUEST_IDS = (None, None, "0", "1", "2", 5, b"q")
_ALONE: dict = {}  # (family, kv_cache_dtype, prompt, params, max_model_len) -> each completion's tokens


# -- what a finished request must be -------------------------------------------------------------------------


def run_alone(family: str, kv_cache_dtype: str, prompt: tuple[int, ...], params, max_model_len: int):
    """The request alone in an engine with ample memory (and the same max_model_len, which caps max_tokens): the
    token ids of each completion."""
    key = (family, kv_cache_dtype, prompt, repr(params), max_model_len)
    if key not in _ALONE:
        config = EngineConfig(block_size=4, num_kv_blocks=512, max_model_len=max_model_len, preemption_mode="recompute",
                              kv_cache_dtype=kv_cache_dtype, record_trace=False)
        engine = LLMEngine(MODELS[family], TOKENIZER, config)
        if isinstance(params, BeamSearchParams):
            engine.add_beam_request("alone", list(prompt), params)
        else:
            engine.add_request("alone", list(prompt), params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        _ALONE[key] = [c.token_ids for c in outputs[0].outputs]
    return _ALONE[key]


def reference_text(prompt, tokens, stop=(), min_tokens: int = 0) -> tuple[str, int, str | None]:
    """A finished sequence's text by plain decoding, from the prompt each time: the text past the prompt's (a
    character the prompt begins and the output completes is output text), held back while it ends inside a
    character; a stop string is looked for once min_tokens tokens exist, from where it could begin in the new
    text; when the sequence has finished, the tokens held back are decoded one at a time. Returns the text, the
    tokens up to the one that completed the stop string (all of them if none did) and the stop string."""
    head = TOKENIZER.decode(prompt)
    text, num_read = "", 0

    def read(k: int, flush: bool) -> str | None:
        nonlocal text, num_read
        full = TOKENIZER.decode([*prompt, *tokens[:k]])
        new = full[len(head) if full.startswith(head) else len(head.rstrip("\ufffd")) :]
        if (new.endswith("\ufffd") and not flush) or len(new) <= len(text):
            return None
        start, text, num_read = len(text), new, k
        for s in stop if k >= min_tokens else ():
            index = text.find(s, max(0, start - len(s) + 1))
            if index != -1:
                text = text[:index]
                return s
        return None

    for k in range(1, len(tokens) + 1):
        if hit := read(k, flush=False):
            return text, k, hit
    for k in range(num_read + 1, len(tokens) + 1):
        if hit := read(k, flush=True):
            return text, k, hit
    return text, len(tokens), None


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite number (NaN compares false; an int may lie beyond the float range)."""
    limit = sys.float_info.max
    return isinstance(value, int | float) and not isinstance(value, bool) and -limit <= value <= limit


def conforms(value, hint) -> bool:
    """`value` is of the type a field declares: a bool is no int, NaN and the infinities are no float."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, h) for h in args)
    if origin is typing.Literal:
        return value in args and type(value) in {type(a) for a in args}
    if origin is tuple:
        return isinstance(value, tuple) and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return is_int(value)
    if hint is float:
        return is_real(value)
    return isinstance(value, hint) if isinstance(hint, type) else True


def assert_well_typed(settings_object) -> None:
    hints = typing.get_type_hints(type(settings_object))
    for f in dataclasses.fields(settings_object):
        value = getattr(settings_object, f.name)
        assert conforms(value, hints[f.name]), f"{type(settings_object).__name__}.{f.name}={value!r} was accepted"


def made_or_refused(cls, field: str, **kwargs):
    """`cls(**kwargs)`, well typed; or None where it refused the value with a ValueError naming `field`."""
    try:
        made = cls(**kwargs)
    except ValueError as error:
        assert field in str(error), f"{cls.__name__}({field}={kwargs[field]!r}): the error names another field: {error}"
        return None
    assert_well_typed(made)
    return made


@functools.cache
def mid_character_prompts(family: str) -> tuple[tuple[int, ...], ...]:
    """Prompts ending with the first piece of a character that the model's greedy next token completes."""
    pieces = range(96, 104)  # ByteTokenizer's halves and thirds of characters (104-111 repeat them)
    completions = {a: {b for b in range(96, 112) if "\ufffd" not in TOKENIZER.decode([a, b])} for a in pieces}
    bodies = torch.randint(0, 95, (64, 5), generator=torch.Generator().manual_seed(0))
    found = []
    for first, seconds in completions.items():
        if seconds:
            prompts = torch.cat([bodies, torch.full((len(bodies), 1), first)], dim=1)
            with torch.inference_mode():
                greedy = MODELS[family](prompts).logits[:, -1].argmax(-1).tolist()
            found += [tuple(p) for p, token in zip(prompts.tolist(), greedy) if token in seconds]
    return tuple(found)


def token_ids(prompt: list[int] | dict | str) -> tuple[int, ...]:
    if isinstance(prompt, str):
        return tuple(TOKENIZER.encode(prompt))
    return tuple(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)


def speculative_config(method: str | None, model) -> dict | None:
    if method is None:
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    draft = {"random draft": RANDOM_DRAFT, "itself": model, "first layer": self_draft(model, 1)}[method]
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}


# -- the machine -----------------------------------------------------------------------------------------------


class EngineMachine(RuleBasedStateMachine):
    SPECULATIVE = (None, "ngram", "random draft", "itself", "first layer")
    BATCHES_IN_FLIGHT = (1,)  # more: an in-process pipeline of as many stages (tests.helpers.InOrderPipeline)

    @initialize(
        family=st.sampled_from(FAMILIES),
        block_size=st.sampled_from([1, 2, 4, 8, 16]),
        pool_tokens=st.integers(8, 160),
        mode=st.sampled_from(["recompute", "swap", "auto"]),
        partial=st.booleans(),
        chunked=st.sampled_from([True, True, False]),
        prefix_caching=st.sampled_from([True, True, False]),
        max_num_seqs=st.integers(1, 8),
        max_num_batched_tokens=st.sampled_from([1, 2, 3, 8, 64]),
        forced=st.sampled_from([0.0, 0.0, 0.2, 0.5]),
        num_cpu_blocks=st.integers(0, 24),
        kv_cache_dtype=st.sampled_from(["auto", "auto", "fp8"]),
        odd_field=st.sampled_from([f.name for f in dataclasses.fields(EngineConfig)]),
        odd_value=st.sampled_from(ODD),
        first=st.lists(st.sampled_from(KINDS), min_size=1, max_size=4),
        data=st.data(),
    )
    def setup(self, family, block_size, pool_tokens, mode, partial, chunked, prefix_caching, max_num_seqs,
              max_num_batched_tokens, forced, num_cpu_blocks, kv_cache_dtype, odd_field, odd_value, first, data):
        made_or_refused(EngineConfig, odd_field, **{odd_field: odd_value})
        speculative = data.draw(st.sampled_from(self.SPECULATIVE), "speculative")
        num_kv_blocks = max(2, pool_tokens // block_size)
        self.family, self.kv_cache_dtype = family, kv_cache_dtype
        config = EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks, preemption_mode=mode, num_cpu_blocks=num_cpu_blocks,
            enable_partial_preemption=partial, enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, force_preemption_rate=forced,
            max_model_len=min(48, num_kv_blocks * block_size), kv_cache_dtype=kv_cache_dtype, record_trace=False,
            speculative_config=speculative_config(speculative, MODELS[family]),
        )
        depth = data.draw(st.sampled_from(self.BATCHES_IN_FLIGHT), "batches in flight")
        worker = Worker(MODELS[family], config)
        self.engine = LLMEngine(MODELS[family], TOKENIZER, config,
                                InOrderPipeline(worker, depth) if depth > 1 else worker)
        self.speculative = speculative
        self.requests: dict[str, object] = {}  # live request id -> its params
        self.num_added = self.num_checked = 0
        for kind in first:  # a few requests from the start, so that no example runs an empty engine
            self.add(data, kind)

    # -- adding requests -----------------------------------------------------------------------------------

    @rule(data=st.data(), kind=st.sampled_from(KINDS))
    def add(self, data, kind) -> None:
        prompt = self._prompt(data)
        if kind == "beams":
            params = BeamSearchParams(beam_width=data.draw(st.integers(2, 3)), max_tokens=data.draw(st.integers(1, 8)))
        else:
            params = self._sampling(data, kind, token_ids(prompt))
        self._submit(data, prompt, params)

    def _prompt(self, data) -> list[int] | dict | str:
        form = data.draw(st.sampled_from(["ids", "ids", "dict", "text", "mid-character"]))
        if form == "text":
            return data.draw(st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=12))
        if form == "mid-character" and mid_character_prompts(self.family):
            return list(data.draw(st.sampled_from(mid_character_prompts(self.family))))
        prompt = data.draw(st.sampled_from(PREFIXES)) + data.draw(st.lists(st.integers(1, 127), max_size=10))
        if form == "dict":
            return {"prompt_token_ids": prompt, "cache_salt": data.draw(st.sampled_from([None, "a", "b"]))}
        return prompt

    def _sampling(self, data, kind: str, prompt: tuple[int, ...]) -> SamplingParams:
        """Settings of a greedy or a seeded sampled request, with stop strings of one of three kinds: none, a
        fixed few, or taken from the request's own output (ending on its min_tokens-th token, or on its last two
        halves of characters, decoded only when it finishes)."""
        params = SamplingParams(
            n=data.draw(st.integers(2, 3)) if kind == "samples" else 1, temperature=1.0 if kind == "samples" else 0,
            seed=data.draw(st.integers(0, 3)), max_tokens=data.draw(st.integers(1, 8)),
            stop_token_ids=data.draw(st.sampled_from([(), (), (0,), (53, 67)])),
            logprobs=data.draw(st.sampled_from([None, None, 0, 2])),
        )
        params = dataclasses.replace(params, min_tokens=data.draw(st.integers(0, params.max_tokens)))
        stops = data.draw(st.sampled_from(["none", "fixed", "own"]))
        if stops == "fixed":
            return dataclasses.replace(params, stop=data.draw(st.sampled_from(FIXED_STOPS)))
        if stops == "own" and len(prompt) + 1 < self.engine.max_model_len:
            return self._own_stop(data, prompt, params)
        return params

    def _own_stop(self, data, prompt: tuple[int, ...], params: SamplingParams) -> SamplingParams:
        """A stop string from the request's first sample run alone: one its j-th token completes, with min_tokens j;
        or "\ufffd" where its j-1-th and j-th tokens end in halves of characters (and none came before), with
        max_tokens j, so that the stop string is found when the sequence finishes."""
        plain = dataclasses.replace(params, stop=(), min_tokens=0, max_tokens=8)
        tokens = run_alone(self.family, self.kv_cache_dtype, prompt, plain, self.engine.max_model_len)[0]
        pieces = [TOKENIZER.decode([t]) for t in tokens]
        if data.draw(st.sampled_from(["min_tokens", "final flush"])) == "min_tokens":
            ends = [dict(stop=(p,), min_tokens=j, max_tokens=max(j, params.max_tokens))
                    for j, p in enumerate(pieces, 1) if "\ufffd" not in p]
        else:
            ends = [dict(stop=("\ufffd",), min_tokens=0, max_tokens=j) for j in range(2, len(tokens) + 1)
                    if pieces[j - 2] == "\ufffd" and TOKENIZER.decode(tokens[j - 2 : j]).endswith("\ufffd")
                    and "\ufffd" not in TOKENIZER.decode(tokens[: j - 2])]
        return dataclasses.replace(params, **data.draw(st.sampled_from(ends))) if ends else params

    @rule(data=st.data(), what=st.sampled_from(["sampling", "sampling", "beam", "token id", "cache salt"]))
    def add_odd(self, data, what) -> None:
        """One odd value: for a field of SamplingParams or BeamSearchParams, a token id, or a cache salt."""
        prompt = data.draw(st.sampled_from(PREFIXES)) + data.draw(st.lists(st.integers(1, 127), max_size=4))
        value = data.draw(st.sampled_from(ODD))
        if what == "beam":
            field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(BeamSearchParams)]))
            params = made_or_refused(BeamSearchParams, field, **{"beam_width": 2, "max_tokens": 4, field: value})
        elif what == "sampling":
            field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(SamplingParams)]))
            greedy = data.draw(st.booleans())
            base = dict(temperature=0 if greedy else 1.0, seed=data.draw(st.integers(0, 3)), max_tokens=4)
            params = made_or_refused(SamplingParams, field, **{**base, field: value})
        elif what == "token id":
            prompt[data.draw(st.integers(0, len(prompt) - 1))] = data.draw(st.sampled_from(ODD_TOKEN_IDS))
            params = SamplingParams(temperature=0, max_tokens=4)
        else:
            prompt = {"prompt_token_ids": prompt, "cache_salt": data.draw(st.sampled_from(ODD_SALTS))}
            params = SamplingParams(temperature=0, max_tokens=4)
        if params is not None:
            self._submit(data, prompt, params)

    def _submit(self, data, prompt, params) -> None:
        """Add a request under an id that may be odd: refused before anything changed, or live."""
        request_id = data.draw(st.sampled_from((f"q{self.num_added}", *ODD_REQUEST_IDS)))
        self.num_added += 1
        before = self.engine.stats()
        try:
            if isinstance(params, BeamSearchParams):
                request_id = self.engine.add_beam_request(request_id, prompt, params)
            else:
                request_id = self.engine.add_request(request_id, prompt, params)
        except (ValueError, TypeError) as error:
            if isinstance(error, TypeError):  # only an id that is no string, named as such
                assert not isinstance(request_id, str | None) and "request_id must be a string" in str(error), error
            elif isinstance(request_id, str) and request_id in self.requests:
                assert "already in the engine" in str(error), error
            else:
                assert "already in the engine" not in str(error), f"a free id ({request_id!r}) was refused: {error}"
            after = self.engine.stats()
            assert (after.num_waiting, after.num_running, after.num_used_blocks) == (
                before.num_waiting, before.num_running, before.num_used_blocks), "a refused request changed the engine"
            return
        assert isinstance(request_id, str) and request_id not in self.requests, f"id {request_id!r} given twice"
        self.requests[request_id] = params

    @rule(data=st.data())
    def abort(self, data) -> None:
        request_id = data.draw(st.sampled_from([*sorted(self.requests), "never-added", 5, None, [7]]))
        if not isinstance(request_id, str):
            with pytest.raises(TypeError, match="request_id must be a string or an iterable of strings"):
                self.engine.abort_request(request_id)
            return
        self.engine.abort_request(request_id)
        self.requests.pop(request_id, None)

    # -- stepping ------------------------------------------------------------------------------------------

    @rule(num_steps=st.integers(1, 3))
    def step(self, num_steps) -> None:
        for _ in range(num_steps):
            self._step()

    def _step(self) -> None:
        lone = len(self.requests) == 1 and getattr(next(iter(self.requests.values())), "n", 0) == 1
        num_preemptions = self.engine.stats().num_preemptions
        for output in self.engine.step():
            if output.finished:
                assert output.request_id in self.requests, f"{output.request_id} finished twice or unknown"
                self._check_finished(output, self.requests.pop(output.request_id))
        if lone:  # the pool holds one sequence of max_model_len tokens: one alone is never preempted, even forced
            assert self.engine.stats().num_preemptions == num_preemptions, "the only sequence was preempted"

    def _check_finished(self, output, params) -> None:
        errors = [c.error for c in output.outputs if c.finish_reason == "error"]
        if errors:  # only a beam search that outgrows the whole cache may fail, and it must say so
            assert isinstance(params, BeamSearchParams) and "even alone" in errors[0], errors
            return
        self.num_checked += 1
        prompt = tuple(output.prompt_token_ids)
        tokens = [c.token_ids for c in output.outputs]
        if isinstance(params, BeamSearchParams) or params.greedy or params.seed is not None:
            alone = run_alone(self.family, self.kv_cache_dtype, prompt, params, self.engine.max_model_len)
            assert tokens == alone, f"{output.request_id} differs from its run alone"
        if isinstance(params, SamplingParams):
            for completion in output.outputs:
                self._check_completion(prompt, params, completion)

    def _check_completion(self, prompt, params: SamplingParams, completion) -> None:
        """What the settings promise, and the text of a plain decode."""
        tokens = completion.token_ids
        assert not set(tokens[: params.min_tokens]) & set(params.stop_token_ids), "a stop token before min_tokens"
        if params.top_p < 1 / VOCAB_SIZE:  # a nucleus smaller than any top token's mass: that token alone
            greedy = dataclasses.replace(params, n=1, temperature=0, top_p=1.0)
            assert [tokens] == run_alone(self.family, self.kv_cache_dtype, prompt, greedy, self.engine.max_model_len)
        if params.logprobs is not None:
            assert len(completion.logprobs) == len(tokens)
            for token, entry in zip(tokens, completion.logprobs):
                assert token in entry and len(entry) <= params.logprobs + 1
        text, num_tokens, stop = reference_text(prompt, tokens, params.stop, params.min_tokens)
        assert completion.text == text, f"text {completion.text!r}, a plain decode gives {text!r}"
        if stop is not None:
            assert (completion.finish_reason, completion.stop_reason, num_tokens) == ("stop", stop, len(tokens)), (
                f"stop string {stop!r} completed by token {num_tokens} of {len(tokens)}: {completion}")
        else:
            assert not isinstance(completion.stop_reason, str), f"stopped by {completion.stop_reason!r} unseen"

    @invariant()
    def check_state(self) -> None:
        if hasattr(self, "engine"):
            self.engine.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        engine = self.engine
        # Liveness: every request needs at most max_model_len steps (one token a step, or one chunk), once it is
        # the oldest, and no request can be refused forever; this bound is far above what a healthy run takes.
        bound = 50 + 12 * len(self.requests) * engine.max_model_len
        for _ in range(bound):
            if not engine.has_unfinished_requests():
                break
            self._step()
            engine.check_invariants()
        assert not engine.has_unfinished_requests(), f"livelock: unfinished after {bound} steps: {engine.stats()}"
        assert not self.requests, f"never reported as finished: {sorted(self.requests)}"
        stats = engine.stats()
        assert stats.num_used_blocks == 0, "device blocks leaked"
        if engine.swap_space is not None:
            assert engine.swap_space.pool.num_used_blocks == 0, "CPU blocks leaked"
        event(f"finished requests checked: {min(self.num_checked, 10)}")
        if self.speculative:
            event(f"{self.speculative}: drafts verified {stats.spec_num_drafts > 0}")
        if isinstance(engine.worker, InOrderPipeline):
            event(f"most batches in flight: {engine.worker.max_in_flight}")


def fuzz_settings(num_examples: int) -> settings:
    """`num_examples`, or PAGEDLAB_FUZZ_EXAMPLES when it is set (a longer run, for a session that has the time)."""
    return settings(
        max_examples=int(os.environ.get("PAGEDLAB_FUZZ_EXAMPLES", num_examples)), stateful_step_count=40,
        deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = fuzz_settings(100)


class SpeculativeEngineMachine(EngineMachine):
    """Every engine speculates: the feature with the most state to keep in step gets more examples of its own."""

    SPECULATIVE = ("ngram", "random draft", "itself", "first layer")


TestSpeculativeEngineMachine = SpeculativeEngineMachine.TestCase
TestSpeculativeEngineMachine.settings = fuzz_settings(400)


class PipelinedEngineMachine(EngineMachine):
    """Two or three batches in flight (pipeline parallelism's micro-batches, in process): each is scheduled before
    the one before it has come back, with aborts and new requests in between. Draft models are refused under
    pipeline parallelism; n-gram lookup is not."""

    SPECULATIVE = (None, None, "ngram")
    BATCHES_IN_FLIGHT = (2, 3)


TestPipelinedEngineMachine = PipelinedEngineMachine.TestCase
TestPipelinedEngineMachine.settings = fuzz_settings(100)
