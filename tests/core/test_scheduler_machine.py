"""A Hypothesis state machine for the scheduler, with groups: single requests, n > 1 samples and beam searches.

A fake model stands in for the worker: it draws tokens, and for beam groups it makes beam decisions (which beams
continue, which are forked, which are pruned). The machine keeps a shadow KV cache (which token prefix each slot
holds, on the device and in the CPU pool) and applies each step's block moves to it in exactly the worker's
order (swap-outs, clearing new blocks, swap-ins, copy-on-write copies), then the step's writes, then checks that
every sequence reads back the KV of its own tokens. So a block handed out while a copy still had to read it,
a shared block written in place, or a swap that lost sharing, is caught. It also checks the budgets, that the
victims of preemption are the newest requests, that nothing is admitted in a step that preempted, and at the
end that every request finishes within a bounded number of steps (liveness) and nothing leaks.
The speculative machines also hand the scheduler draft tokens for its running decodes, some right and some wrong;
the fake model verifies them, and the KV of rejected drafts, written into the shadow cache like any other, must
never be read back: the rollback gives their slots back exactly.
Settings are derandomized and database-free, so CI is reproducible.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedlab.config import EngineConfig
from pagedlab.core.block_table import cdiv
from pagedlab.core.kv_cache_manager import KVCacheManager
from pagedlab.core.preemption import PreemptionCostModel
from pagedlab.core.request import Request, RequestStatus
from pagedlab.core.sched_output import BeamDecision, ModelRunnerOutput
from pagedlab.core.scheduler import Scheduler
from pagedlab.core.swap_space import SwapSpace
from pagedlab.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # a few minutes: `make test-fast` leaves it out
EOS = 0


def machine_settings(max_examples: int, steps: int = 50) -> settings:
    return settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


@st.composite
def setups(draw, swap: bool, chunked=st.booleans()):  # noqa: B008 - a hypothesis strategy, not a value
    """A tight KV pool: max_model_len is at least half the pool, so two long requests already run it dry."""
    block_size = draw(st.sampled_from((1, 2, 4, 16)), "block_size")
    num_blocks = draw(st.integers(cdiv(4, block_size), max(2, 48 // block_size)), "num_blocks")
    capacity = num_blocks * block_size
    max_model_len = draw(st.integers(max(3, capacity // 2), capacity), "max_model_len")
    max_num_batched_tokens = draw(
        st.integers(1, 4) | st.integers(1, max_model_len) | st.integers(max_model_len, 2 * max_model_len), "budget"
    )
    mode, num_cpu_blocks, forced = "recompute", 0, 0.0
    if swap:
        mode = draw(st.sampled_from(["swap", "auto"]), "preemption_mode")
        num_cpu_blocks = draw(st.integers(0, 2 * num_blocks), "num_cpu_blocks")
        forced = draw(st.sampled_from([0.0, 0.1, 0.3]), "force_preemption_rate")
    config = EngineConfig(
        block_size=block_size, num_kv_blocks=num_blocks, max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(1, 8), "max_num_seqs"), max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=draw(chunked, "chunked"), preemption_mode=mode,
        enable_partial_preemption=draw(st.booleans(), "partial"), force_preemption_rate=forced,
    )
    return config, num_cpu_blocks


class SchedulerMachine(RuleBasedStateMachine):
    PREFIX_CACHING = False
    SPECULATE = False  # propose draft tokens for the running decodes (speculative decoding)
    MAX_TEARDOWN_STEPS = 5_000

    def _setup(self, setup) -> None:
        config, num_cpu_blocks = setup
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_kv_blocks, config.block_size, enable_prefix_caching=self.PREFIX_CACHING
        )
        self.swap = SwapSpace(self.kv_cache_manager, num_cpu_blocks) if config.preemption_mode != "recompute" else None
        # auto: with these speeds a victim is swapped when its blocks are on average more than 3/4 full
        copy_speed = 2 * 64 / (0.75 * config.block_size * 1e-3)
        cost_model = PreemptionCostModel(64, config.block_size, copy_bytes_per_s=copy_speed, prefill_tokens_per_s=1e3)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.swap, cost_model)
        self.max_prompt_len = config.max_model_len - 1
        if not config.enable_chunked_prefill:  # the engine refuses longer prompts without chunked prefill
            self.max_prompt_len = min(self.max_prompt_len, config.max_num_batched_tokens)
        self.num_arrivals = 0
        self.tokens: dict[str, list[int]] = {}  # live sequence -> its expected tokens (prompt + output)
        self.group_of: dict[str, str] = {}  # sequence -> its group, as the scheduler reported it
        self.num_prompt: dict[str, int] = {}
        self.eos_at: dict[str, int | None] = {}  # single requests: output index where the fake model says EOS
        self.beams: dict[str, dict] = {}  # beam group -> {"max_tokens": m, "ready": set of beams}
        self.finished: dict[str, str] = {}  # group -> how it ended
        self.added_at: dict[str, int] = {}  # group -> the step it arrived
        self.max_tokens: dict[str, int] = {}
        self.num_steps = 0
        self.device_kv: dict[int, tuple | None] = {}  # slot -> the token prefix whose KV it holds
        self.cpu_kv: dict[int, tuple | None] = {}

    # -- rules ----------------------------------------------------------------------------------------------

    @rule(data=st.data())
    def add_request(self, data) -> None:
        config = self.config
        kind = data.draw(st.sampled_from(["single", "single", "samples", "beams"]), "kind")
        width = data.draw(st.integers(2, 3), "width") if kind != "single" else 1
        if width > config.max_num_seqs:
            return  # the engine refuses it (a ValueError before anything changes)
        prompt_len = data.draw(st.integers(1, self.max_prompt_len), "prompt_len")
        max_tokens = data.draw(st.integers(1, min(8, config.max_model_len - prompt_len)), "max_tokens")
        family = data.draw(st.integers(0, 2), "family")  # same family, same prefix: prefix-cache hits
        prompt = [1 + (family * 31 + i) % 97 for i in range(prompt_len)]
        group_id = f"g{self.num_arrivals}"
        if kind == "samples":
            params = SamplingParams(n=width, temperature=1.0, max_tokens=max_tokens)
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens if kind == "single" else None)
        request = Request(group_id, prompt, params, self.num_arrivals, max_tokens, frozenset({EOS}),
                          beam_width=width if kind == "beams" else 0)
        self.num_arrivals += 1
        self.scheduler.add_request(request)
        self.tokens[group_id], self.num_prompt[group_id], self.group_of[group_id] = list(prompt), prompt_len, group_id
        eos_at = data.draw(st.none() | st.integers(0, max_tokens), "eos_at") if kind == "single" else None
        self.eos_at[group_id] = eos_at
        if kind == "beams":
            self.beams[group_id] = {"max_tokens": max_tokens, "ready": set()}
        self.added_at[group_id], self.max_tokens[group_id] = self.num_steps, max_tokens
        event(f"add {kind}")

    @rule(num_steps=st.integers(1, 4), data=st.data())
    def step(self, num_steps: int, data) -> None:
        for i in range(num_steps):
            self._step(data, abort_mid_step=i == num_steps - 1 and data.draw(st.integers(0, 5), "mid") == 0)
            self.check_state()

    @precondition(lambda self: self.scheduler.groups)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self._abort(data.draw(st.sampled_from(sorted(self.scheduler.groups)), "abort"))

    def _abort(self, group_id: str) -> None:
        members = [r.request_id for r in self.scheduler.groups[group_id]]
        finished, _ = self.scheduler.finish_groups([group_id], RequestStatus.FINISHED_ABORTED)
        assert sorted(r.request_id for r in finished) == sorted(members)
        for request_id in members:
            assert request_id not in self.kv_cache_manager.block_tables
            assert self.swap is None or request_id not in self.swap.block_tables
            del self.tokens[request_id]
        self.beams.pop(group_id, None)
        self.finished[group_id] = "abort"
        event("abort")

    # -- the fake model and beam search ---------------------------------------------------------------------

    def _next_token(self, request_id: str, group_id: str, drafts: tuple[int, ...] = ()) -> int:
        tokens = self.tokens[request_id] + list(drafts)
        num_output = len(tokens) - self.num_prompt[group_id]
        if request_id == group_id and self.eos_at.get(group_id) == num_output:
            return EOS
        return 1 + (sum(tokens) * 7 + len(tokens) + hash(request_id) % 5) % 90

    def _beam_decision(self, group_id: str, data) -> BeamDecision:
        """Which beams continue (a parent drawn twice is forked), with which tokens; the others are pruned.
        Without `data` (the drain at teardown) the first beam continues alone until the length limit."""
        group = self.scheduler.groups[group_id]
        live = [r.request_id for r in group]
        width = group[0].beam_width
        length = len(self.tokens[live[0]])
        at_end = length - self.num_prompt[group_id] >= self.beams[group_id]["max_tokens"]
        if at_end or length + 1 > self.config.max_model_len or (data and data.draw(st.integers(0, 6), "end") == 0):
            return BeamDecision(group_id, (), tuple(live))
        if data is None:
            return BeamDecision(group_id, ((live[0], 1),), tuple(live[1:]))
        parents = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=width), "parents")
        continuations = tuple((p, data.draw(st.integers(1, 90), "beam_token")) for p in parents)
        return BeamDecision(group_id, continuations, tuple(b for b in live if b not in parents))

    # -- one step, checked ----------------------------------------------------------------------------------

    def _step(self, data, abort_mid_step: bool = False) -> None:
        scheduler, config = self.scheduler, self.config
        running_before = list(scheduler.running)
        swapped_before = {r.request_id for r in scheduler.swapped}
        free_before = set(self.kv_cache_manager.pool.free_block_ids())

        drafts = self._propose(data) if self.SPECULATE and data is not None else {}
        out = scheduler.schedule(drafts or None)

        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), f"a sequence is scheduled twice: {ids}"
        assert out.num_batched_tokens <= config.max_num_batched_tokens
        if scheduler.requests or out.scheduled:
            assert out.scheduled or out.preempted or out.swapped_in or out.failed, (
                f"a step did nothing: waiting {list(scheduler.waiting)}, running {scheduler.running}, swapped "
                f"{scheduler.swapped}, {self.kv_cache_manager.num_free_blocks} free blocks, "
                f"{scheduler.num_running_seqs} seats used"
            )
        children = [child for _, child in out.forked]
        for parent, child in out.forked:
            self.tokens[child], self.group_of[child] = list(self.tokens[parent]), self.group_of[parent]
            assert scheduler.requests[child].parent_id == parent and parent in ids
        for group_id, root in out.restarted:  # a beam search starts again from its prompt
            event("beam search restarted")
            for request_id in [r for r in self.tokens if r != root and self.group_of[r] == group_id]:
                del self.tokens[request_id]
            del self.tokens[root][self.num_prompt[group_id] :]
            self.beams[group_id]["ready"].clear()
        for group_id, why in out.failed:
            event("a group too big to ever fit")
            assert group_id in self.beams and "even alone" in why
            self._forget_group(group_id, "error")

        if out.preempted:
            event("preempted")
            victims = set(out.preempted)
            before = sorted(running_before, key=lambda r: r.order, reverse=True)
            newest = {r.request_id for r in before[: len(victims)]}
            assert victims == newest, f"preempted {out.preempted}, expected the newest {newest}"
            running_ids = {r.request_id for r in running_before} | set(children)
            assert set(ids) <= running_ids, "a step that preempted admitted a new request"
            assert not out.swapped_in, "a step that preempted swapped a request in"
        if scheduler.swapped or swapped_before - {rid for rid, _ in out.swapped_in}:
            known = {r.request_id for r in running_before} | swapped_before | set(children)
            assert set(ids) <= known, "admitted a new request while requests were swapped out"
        if out.truncated:
            event("partial preemption")
            assert config.enable_partial_preemption

        # The block moves, in the worker's order, on the shadow KV.
        new_blocks = {b for _, blocks in out.allocated for b in blocks}
        for _, source, _copy in out.copies:
            event("copy-on-write")
            assert source not in new_blocks, f"copy source {source} was handed out in the same step"
        self._move(self.device_kv, self.cpu_kv, out.swapped_out)
        for block_id in new_blocks:
            self._set_block(self.device_kv, block_id, None)
        self._move(self.cpu_kv, self.device_kv, out.swapped_in)
        for _, source, copy in out.copies:
            for offset in range(config.block_size):
                size = config.block_size
                self.device_kv[copy * size + offset] = self.device_kv.get(source * size + offset)

        # The forward pass: every new token's KV is written, then every sequence reads its context.
        size = config.block_size
        for s in out.scheduled:
            if s.num_spec_tokens:
                event("speculated")
                assert s.num_spec_tokens <= len(drafts[s.request_id]) and s.num_new_tokens == 1 + s.num_spec_tokens
                assert s.spec_token_ids == drafts[s.request_id][: s.num_spec_tokens]
                assert not out.preempted, "speculated in a step that preempted"
            tokens = self.tokens[s.request_id] + list(s.spec_token_ids)
            assert s.token_ids == tuple(tokens[s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens])
            assert s.block_ids == tuple(self.kv_cache_manager.block_tables[s.request_id].block_ids)
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                self.device_kv[s.block_ids[p // size] * size + p % size] = tuple(tokens[: p + 1])
        for s in out.scheduled:
            tokens = self.tokens[s.request_id]
            for p in range(s.num_computed_tokens):
                slot = s.block_ids[p // size] * size + p % size
                assert self.device_kv.get(slot) == tuple(tokens[: p + 1]), (
                    f"{s.request_id} reads position {p} from slot {slot}, which holds other KV"
                )

        aborted = None
        if abort_mid_step and out.scheduled:
            aborted = data.draw(st.sampled_from([s.group_id for s in out.scheduled]), "abort_mid_step")
            self._abort(aborted)

        sampled, decisions, num_accepted, emitted = {}, [], {}, {}
        for s in out.scheduled:
            for target in s.sampling:
                if s.group_id == aborted:
                    continue
                if target.is_beam:
                    self.beams[s.group_id]["ready"].add(target.request_id)
                elif s.num_spec_tokens:  # verify: the longest agreeing prefix of the drafts, then the model's token
                    spec, accepted = s.spec_token_ids, 0
                    while (token := self._next_token(s.request_id, s.group_id, spec[:accepted])) == (
                        spec[accepted] if accepted < len(spec) else None
                    ):
                        accepted += 1
                    sampled[target.request_id], num_accepted[target.request_id] = token, accepted
                    emitted[target.request_id] = (*spec[:accepted], token)
                else:
                    sampled[target.request_id] = self._next_token(target.request_id, s.group_id)
                    emitted[target.request_id] = (sampled[target.request_id],)
        for group_id, beam in self.beams.items():
            live = {r.request_id for r in scheduler.groups.get(group_id, ())}
            if live and beam["ready"] >= live:
                decisions.append(self._beam_decision(group_id, data))
                beam["ready"].clear()

        update = scheduler.update_from_output(out, ModelRunnerOutput(emitted), decisions)

        appended = {u.request_id for u in update.sequences if u.new_token_ids and u.request_id in sampled}
        assert appended == set(sampled)
        for u in update.sequences:
            if u.request_id in sampled:
                # the emitted tokens, cut after the first that finishes the sequence
                n = len(u.new_token_ids)
                assert u.new_token_ids == emitted[u.request_id][:n]
                assert n == len(emitted[u.request_id]) or u.finish_reason
                self.tokens[u.request_id] += u.new_token_ids
        for (request_id, k, accepted), (rolled_id, slots) in zip(update.verified, update.rolled_back):
            assert request_id == rolled_id and accepted == num_accepted[request_id] and len(slots) == k - accepted
            if k > accepted:
                event("rolled back")
        for decision, (group_id, beam_ids) in zip(decisions, update.beam_ids):
            assert decision.group_id == group_id and len(beam_ids) == len(decision.continuations)
            parents = {p: list(self.tokens[p]) for p, _ in decision.continuations}
            for (parent, token), beam in zip(decision.continuations, beam_ids):
                self.tokens[beam], self.group_of[beam] = parents[parent] + [token], group_id
            for pruned in decision.pruned:
                del self.tokens[pruned]
            if not decision.continuations:
                assert group_id not in scheduler.groups
                self._forget_group(group_id, "done")
        for u in update.sequences:
            if u.finish_reason in ("stop", "length"):
                self._check_finish(u)
        for group_id in [g for g in self.added_at if g not in self.finished and g not in scheduler.groups]:
            self._forget_group(group_id, "done")
        freed = set(out.freed) | set(update.freed)
        free_now = set(self.kv_cache_manager.pool.free_block_ids())
        assert free_now <= free_before | freed or aborted, "a block became free without being reported"
        self.num_steps += 1

    def _propose(self, data) -> dict[str, tuple[int, ...]]:
        """Drafts for some running decodes: a few the fake model would produce, then perhaps wrong ones."""
        drafts = {}
        for request in self.scheduler.draft_requests(4):
            if data.draw(st.integers(0, 3), "drafts?") == 0:
                continue
            rid, right = request.request_id, []
            num_right = data.draw(st.integers(0, request.max_num_draft_tokens), "num_right")
            for _ in range(num_right):
                right.append(self._next_token(rid, self.group_of[rid], tuple(right)))
            wrong = data.draw(st.lists(st.integers(1, 90), max_size=request.max_num_draft_tokens - num_right), "wrong")
            if right or wrong:
                drafts[rid] = (*right, *wrong)
        return drafts

    def _check_finish(self, u) -> None:
        tokens = self.tokens.pop(u.request_id)
        num_output = len(tokens) - self.num_prompt[u.group_id]
        if u.finish_reason == "stop":
            assert tokens[-1] == EOS and u.request_id == u.group_id, "only the fake model's EOS stops a request"
        else:
            assert num_output == self.max_tokens[u.group_id] or len(tokens) == self.config.max_model_len
        assert u.request_id not in self.kv_cache_manager.block_tables

    def _forget_group(self, group_id: str, how: str) -> None:
        self.finished[group_id] = how
        self.beams.pop(group_id, None)
        for request_id in [r for r in self.tokens if self.group_of[r] == group_id]:
            del self.tokens[request_id]

    def _set_block(self, kv: dict, block_id: int, content) -> None:
        for offset in range(self.config.block_size):
            kv[block_id * self.config.block_size + offset] = content

    def _move(self, source_kv: dict, target_kv: dict, moves) -> None:
        size = self.config.block_size
        for _, pairs in moves:
            event("swap")
            for source, target in pairs:
                for offset in range(size):
                    target_kv[target * size + offset] = source_kv.get(source * size + offset)

    # -- invariants and liveness ----------------------------------------------------------------------------

    @invariant()
    def check_state(self) -> None:
        scheduler = self.scheduler
        scheduler.check_invariants()
        assert set(self.tokens) == set(scheduler.requests), "the machine and the scheduler disagree on who lives"
        for request_id, request in scheduler.requests.items():
            assert request.token_ids(0, request.num_tokens) == self.tokens[request_id], f"{request_id}: tokens differ"
            assert request.num_tokens <= self.config.max_model_len

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        self.scheduler.config = dataclasses.replace(self.scheduler.config, force_preemption_rate=0.0)
        # Liveness: the oldest request is never a victim and needs at most max_model_len steps (beams: once
        # per beam length); requests finish one by one, well within this bound.
        num_left = len(self.scheduler.groups)
        bound = min(self.MAX_TEARDOWN_STEPS, 10 + num_left * 4 * (self.config.max_model_len + 2))
        for _ in range(bound):
            if not self.scheduler.has_unfinished_requests():
                break
            self._step(None)  # beam searches keep their best beam until they end
            self.check_state()
        assert not self.scheduler.has_unfinished_requests(), f"livelock: not finished after {bound} steps"
        kv_cache_manager = self.kv_cache_manager
        assert kv_cache_manager.num_free_blocks == self.config.num_kv_blocks, "device blocks leaked"
        assert not kv_cache_manager.block_tables, "device blocks leaked"
        assert not self.kv_cache_manager.pending_copy_sources
        if self.swap is not None:
            assert not self.swap.block_tables and self.swap.pool.num_used_blocks == 0, "CPU blocks leaked"


class RecomputeMachine(SchedulerMachine):
    @initialize(setup=setups(swap=False))
    def setup(self, setup) -> None:
        self._setup(setup)


class SwapMachine(SchedulerMachine):
    """Preemption by swap (or auto) into a small CPU pool, forced preemptions, chunked prefill on or off."""

    @initialize(setup=setups(swap=True))
    def setup(self, setup) -> None:
        self._setup(setup)


class PrefixCachingMachine(RecomputeMachine):
    PREFIX_CACHING = True


class SwapPrefixCachingMachine(SwapMachine):
    PREFIX_CACHING = True


class SpeculativeMachine(RecomputeMachine):
    SPECULATE = True


class SpeculativeSwapPrefixCachingMachine(SwapMachine):
    SPECULATE = True
    PREFIX_CACHING = True


TestRecomputeMachine = RecomputeMachine.TestCase
TestRecomputeMachine.settings = machine_settings(200)
TestSwapMachine = SwapMachine.TestCase
TestSwapMachine.settings = machine_settings(250)
TestPrefixCachingMachine = PrefixCachingMachine.TestCase
TestPrefixCachingMachine.settings = machine_settings(150)
TestSwapPrefixCachingMachine = SwapPrefixCachingMachine.TestCase
TestSwapPrefixCachingMachine.settings = machine_settings(150)
TestSpeculativeMachine = SpeculativeMachine.TestCase
TestSpeculativeMachine.settings = machine_settings(150)
TestSpeculativeSwapPrefixCachingMachine = SpeculativeSwapPrefixCachingMachine.TestCase
TestSpeculativeSwapPrefixCachingMachine.settings = machine_settings(150)
