"""Random interleavings of the whole public API on tight pools: the engine's promises hold whatever the order.

A Hypothesis state machine builds an engine with a small KV pool (every preemption mode, partial preemption,
chunked prefill and prefix caching drawn at random), then adds requests (greedy, seeded samples with n > 1,
beam search; prompts that share prefixes; stop strings), aborts some and steps, checking after every step that
the invariants hold. At the end it drains the engine within a bounded number of steps (no livelock), checks that
nothing leaked, and that every request that finished has exactly the tokens it gets when run alone with ample
memory. The model is the tiny random Llama with `ByteTokenizer`, so stop strings and text are real. The
speculative machine does the same with speculative decoding on (the model drafting for itself: greedy drafts,
accepted deep into a chunk for greedy requests, often rejected for the sampled ones).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedlab import LLMEngine, SamplingParams
from pagedlab.beam_search import BeamSearchParams
from pagedlab.config import EngineConfig
from tests.helpers import ByteTokenizer, tiny_model

pytestmark = pytest.mark.slow  # a few minutes: `make test-fast` leaves it out
MODEL = tiny_model("llama")
TOKENIZER = ByteTokenizer()
PREFIXES = ([5, 17, 33, 2, 9, 41, 7, 12], [60, 61, 62, 63, 64, 65], [90, 3])
_ALONE: dict = {}  # (prompt, params, max_model_len) -> the tokens of each completion, alone with ample memory


def run_alone(prompt: tuple[int, ...], params, max_model_len: int) -> list[list[int]]:
    """The request alone in an engine with ample memory (and the same max_model_len, which caps max_tokens)."""
    key = (prompt, repr(params), max_model_len)
    if key not in _ALONE:
        config = EngineConfig(block_size=4, num_kv_blocks=512, max_model_len=max_model_len, record_trace=False)
        engine = LLMEngine(MODEL, TOKENIZER, config)
        if isinstance(params, BeamSearchParams):
            engine.add_beam_request("alone", list(prompt), params)
        else:
            engine.add_request("alone", list(prompt), params)
        outputs = [o for _ in range(1000) for o in engine.step() if o.finished]
        _ALONE[key] = [c.token_ids for c in outputs[0].outputs]
    return _ALONE[key]


class EngineMachine(RuleBasedStateMachine):
    SPECULATIVE_CONFIG = None
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_kv_blocks=st.integers(10, 40),
        mode=st.sampled_from(["recompute", "swap", "auto"]),
        partial=st.booleans(),
        chunked=st.booleans(),
        prefix_caching=st.booleans(),
        max_num_seqs=st.integers(2, 8),
        max_num_batched_tokens=st.sampled_from([8, 16, 64]),
        forced=st.sampled_from([0.0, 0.0, 0.2]),
        num_cpu_blocks=st.integers(0, 24),
    )
    def setup(self, block_size, num_kv_blocks, mode, partial, chunked, prefix_caching, max_num_seqs,
              max_num_batched_tokens, forced, num_cpu_blocks) -> None:
        self.engine = LLMEngine(MODEL, TOKENIZER, EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks, preemption_mode=mode, num_cpu_blocks=num_cpu_blocks,
            enable_partial_preemption=partial, enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, force_preemption_rate=forced,
            max_model_len=min(48, num_kv_blocks * block_size), record_trace=False,
            speculative_config=self.SPECULATIVE_CONFIG,
        ))
        self.requests: dict[str, tuple] = {}  # live request id -> (prompt, params)
        self.aborted: set[str] = set()
        self.num_added = 0
        self.num_steps = 0

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(1, 127), max_size=10),
        kind=st.sampled_from(["greedy", "greedy", "samples", "beams"]),
        width=st.integers(2, 3),
        max_tokens=st.integers(1, 8),
        seed=st.integers(0, 3),
        stop=st.sampled_from([(), (), ("e",), ("5",)]),
    )
    def add(self, prefix, suffix, kind, width, max_tokens, seed, stop) -> None:
        prompt = tuple(prefix + suffix)
        if kind == "beams":
            params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
        elif kind == "samples":
            params = SamplingParams(n=width, temperature=1.0, seed=seed, max_tokens=max_tokens, stop=stop)
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop)
        request_id = f"q{self.num_added}"
        self.num_added += 1
        before = self.engine.stats()
        try:
            if kind == "beams":
                self.engine.add_beam_request(request_id, list(prompt), params)
            else:
                self.engine.add_request(request_id, list(prompt), params)
        except ValueError:  # too big for this engine: refused before anything changed
            after = self.engine.stats()
            assert (after.num_waiting, after.num_running, after.num_used_blocks) == (
                before.num_waiting, before.num_running, before.num_used_blocks)
            return
        self.requests[request_id] = (prompt, params)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        self.engine.abort_request(request_id)
        del self.requests[request_id]
        self.aborted.add(request_id)

    @rule(num_steps=st.integers(1, 3))
    def step(self, num_steps) -> None:
        for _ in range(num_steps):
            self._step()

    def _step(self) -> None:
        for output in self.engine.step():
            if not output.finished:
                continue
            assert output.request_id in self.requests, f"{output.request_id} finished twice or unknown"
            prompt, params = self.requests.pop(output.request_id)
            errors = [c.error for c in output.outputs if c.finish_reason == "error"]
            if errors:  # only a beam search that outgrows the whole cache may fail, and it must say so
                assert isinstance(params, BeamSearchParams) and "even alone" in errors[0], errors
                continue
            alone = run_alone(prompt, params, self.engine.max_model_len)
            assert [c.token_ids for c in output.outputs] == alone, f"{output.request_id} differs from its run alone"
        self.num_steps += 1

    @invariant()
    def check_state(self) -> None:
        self.engine.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        engine = self.engine
        # Liveness: every request needs at most max_model_len steps (one token a step, or one chunk), once it is
        # the oldest, and no request can be refused forever; this bound is far above what a healthy run takes.
        bound = 20 + 3 * sum(len(p) + 8 for p, _ in self.requests.values()) * 4
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
        if self.SPECULATIVE_CONFIG:
            event(f"drafts verified: {stats.spec_num_drafts > 0}, some rejected: "
                  f"{stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens}")


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class SpeculativeEngineMachine(EngineMachine):
    SPECULATIVE_CONFIG = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 3}


TestSpeculativeEngineMachine = SpeculativeEngineMachine.TestCase
TestSpeculativeEngineMachine.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
