"""The contiguous baseline: first-fit allocator, fragmentation accounting, and static batching vs HF generate()."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedlab.contiguous import ContiguousAllocator, ContiguousEngine, FragmentationReport
from pagedlab.sampling_params import SamplingParams

# -- allocator ------------------------------------------------------------------------------------------


def test_first_fit_merging_and_external_fragmentation():
    arena = ContiguousAllocator(10)
    assert [arena.allocate(rid, 3) for rid in "abc"] == [0, 3, 6]
    arena.check_invariants()
    assert arena.holes() == [(9, 1)]

    assert arena.free("b") == (3, 3)
    arena.check_invariants()
    # [ a a a . . . c c c . ]: 4 slots free, but no hole of 4
    assert arena.holes() == [(3, 3), (9, 1)]
    assert arena.num_free_slots == 4 and arena.largest_hole == 3
    assert arena.allocate("d", 4) is None
    assert "d" not in arena.reservations
    arena.check_invariants()

    # First fit: a 1-slot request takes the first hole (3), not the snug one at 9.
    assert arena.allocate("e", 1) == 3
    arena.check_invariants()
    assert arena.holes() == [(4, 2), (9, 1)]

    # Freeing c merges it with both neighbouring holes: (4, 2) + (6, 3) + (9, 1) -> (4, 6).
    arena.free("c")
    arena.check_invariants()
    assert arena.holes() == [(4, 6)]
    assert arena.allocate("d", 4) == 4
    arena.check_invariants()

    assert arena.free("nobody") is None
    with pytest.raises(ValueError, match="already"):
        arena.allocate("a", 1)
    with pytest.raises(ValueError):
        arena.allocate("z", 0)


def test_allocator_against_a_slot_list():
    rng = random.Random(0)
    arena = ContiguousAllocator(64)
    owner = [None] * 64  # the brute-force model: who holds each slot
    for step in range(400):
        live = list(arena.reservations)
        if live and rng.random() < 0.45:
            rid = rng.choice(live)
            start, length = arena.free(rid)
            assert owner[start : start + length] == [rid] * length
            owner[start : start + length] = [None] * length
        else:
            rid, size = f"r{step}", rng.randint(1, 12)
            expected = next((s for s in range(64 - size + 1) if owner[s : s + size] == [None] * size), None)
            assert arena.allocate(rid, size) == expected  # the lowest address that fits = first fit
            if expected is not None:
                owner[expected : expected + size] = [rid] * size
        arena.check_invariants()
        assert arena.num_free_slots == owner.count(None)


# -- fragmentation accounting ---------------------------------------------------------------------------


def test_fragmentation_report_by_hand():
    # Arena 32, max_model_len 8: each request reserves 8 slots. Final lengths 5, 8 and 4; at this moment they
    # have 3, 4 and 4 tokens, so c (4 of 4) has finished and holds its slots until the batch ends.
    arena = ContiguousAllocator(32)
    for rid in "abc":
        arena.allocate(rid, 8)
    report = FragmentationReport.measure(arena, {"a": (3, 5), "b": (4, 8), "c": (4, 4)}, want=8)
    # reserved = 3 x 8 = 24; used = 3 + 4 = 7 (a and b run); held after finish = 4 (c)
    # reservation waste = (5-3) + (8-4) = 2 + 4 = 6 (running requests only)
    # internal = (8-5) + (8-8) + (8-4) = 3 + 0 + 4 = 7        (7 + 4 + 6 + 7 = 24)
    # external: the 8 free slots are one hole (24, 8), big enough for 8 -> 0
    assert report == FragmentationReport(32, 24, 7, 4, 6, 7, 0)
    assert report.free == 8
    assert report.utilization == pytest.approx(7 / 24)


def test_fragmentation_report_with_holes_too_small():
    # reserve="max_tokens": a = 3 + 4 = 7 slots, b = 2 + 3 = 5, c = 4 + 2 = 6, in an arena of 20.
    arena = ContiguousAllocator(20)
    assert [arena.allocate("a", 7), arena.allocate("b", 5), arena.allocate("c", 6)] == [0, 7, 12]
    arena.free("b")  # [ a*7 | .*5 | c*6 | .*2 ]
    assert arena.holes() == [(7, 5), (18, 2)]
    # a: 5 tokens, will end at 7; c: 6 tokens, ended at 6 (its max_tokens = 2, so final length = reserve).
    report = FragmentationReport.measure(arena, {"a": (5, 7), "c": (6, 6)}, want=6)
    # reserved = 7 + 6 = 13; used = 5 (a); held after finish = 6 (c); waste = 2; internal = 0 + 0 = 0
    # external: the next request wants 6; holes of 5 and 2 are both too small -> 5 + 2 = 7 (all 7 free slots)
    assert report == FragmentationReport(20, 13, 5, 6, 2, 0, 7)
    # A 5-slot request would fit in the first hole: only the 2-slot hole is too small for it.
    assert FragmentationReport.measure(arena, {"a": (5, 7), "c": (6, 6)}, want=5).external_fragmentation == 2
    assert FragmentationReport.measure(arena, {"a": (5, 7), "c": (6, 6)}, want=0).external_fragmentation == 0

    total = FragmentationReport.total([report, FragmentationReport(20, 7, 7, 0, 0, 0, 0)])
    assert total == FragmentationReport(40, 20, 12, 6, 2, 0, 7)
    assert total.utilization == pytest.approx(12 / 20)
    assert FragmentationReport.total([]).utilization == 0.0

    with pytest.raises(ValueError, match="usage covers"):
        FragmentationReport.measure(arena, {"a": (5, 7)}, want=6)
    with pytest.raises(ValueError, match="used 8"):
        FragmentationReport.measure(arena, {"a": (8, 7), "c": (6, 6)}, want=6)


# -- static batching through the model runner -----------------------------------------------------------

PROMPT_LENS = (5, 17, 1, 9)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt, max_new_tokens, eos_token_id):
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos_token_id, pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_static_batches_match_hf_generate(model, prompts):
    engine = ContiguousEngine(model, num_slots=64, max_model_len=32, max_batch_size=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = engine.generate(prompts, params)
    assert out.token_ids == [hf_greedy(model, p, MAX_TOKENS, eos_token_id=None) for p in prompts]
    assert out.finish_reasons == ["length"] * 4
    assert out.peak_num_seqs == 2 and out.num_running == out.num_in_batch == (2,) * 16  # two batches of 8 steps
    assert engine.allocator.reservations == {}

    # Two batches x 8 steps, each with 2 x 32 slots reserved. Batch 1 holds prompts of 5 and 17 tokens, batch
    # 2 prompts of 1 and 9; at step k (1..8) each request has prompt + k tokens, and at step 8 all have finished.
    # reserved = 16 x 64 = 1024; used = sum_{k<8} (22 + 2k) + (10 + 2k) = 7 x 32 + 4 x 28 = 336
    # held after finish (step 8 of each batch) = 13 + 25 + 9 + 17 = 64
    # final lengths 13 + 25 and 9 + 17: internal = 8 x (64 - 38) + 8 x (64 - 26) = 208 + 304 = 512
    # reservation waste = 1024 - 336 - 64 - 512 = 112; external: the free hole (64 - 64 = none) -> 0
    assert out.summary == FragmentationReport(16 * 64, 1024, 336, 64, 112, 512, 0)
    assert out.summary.utilization == pytest.approx(336 / 1024)  # ~33%: a third of reserved KV holds live tokens

    assert engine.generate(prompts, params).token_ids == out.token_ids  # the engine is reusable


def test_reserve_max_tokens_leaves_holes_too_small(model, prompts):
    # Reservations are prompt + 8: 13, 25, 9, 17. Arena 40: batch 1 = 13 + 25 = 38 and request 2 (9) waits,
    # though max_batch_size is 4; the free hole (38, 2) is too small for it: 2 slots of external fragmentation.
    engine = ContiguousEngine(model, num_slots=40, max_model_len=32, max_batch_size=4, reserve="max_tokens")
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert out.token_ids == [hf_greedy(model, p, MAX_TOKENS, eos_token_id=None) for p in prompts]
    assert out.num_running == (2,) * 16
    assert [r.external_fragmentation for r in out.reports] == [2] * 8 + [0] * 8  # nothing waits in batch 2
    assert [r.reserved for r in out.reports] == [38] * 8 + [26] * 8
    # reserved = 8 x 38 + 8 x 26 = 512; used = 336 and held after finish = 64 (as above); every request reaches
    # its reservation, so internal = 0 and reservation waste = 512 - 400 = 112; external = 8 x 2 = 16
    assert out.summary == FragmentationReport(16 * 40, 512, 336, 64, 112, 0, 16)


def test_stopped_requests_keep_their_slots_until_the_batch_ends(model, prompts):
    # Stop on a token that request 0 generates third, so it finishes early while request 1 runs on.
    free_run = ContiguousEngine(model, num_slots=64, max_model_len=32, max_batch_size=2).generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    stop = free_run.token_ids[0][2]
    engine = ContiguousEngine(model, num_slots=64, max_model_len=32, max_batch_size=2)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=(stop,)))
    for prompt, tokens in zip(prompts, out.token_ids):
        expected = hf_greedy(model, prompt, MAX_TOKENS, eos_token_id=stop)
        if stop in expected:  # HF pads after the stop token
            expected = expected[: expected.index(stop) + 1]
        assert tokens == expected
    assert out.finish_reasons[0] == "stop" and len(out.token_ids[0]) <= 3
    batch_1 = out.num_running[: max(len(out.token_ids[0]), len(out.token_ids[1]))]
    assert batch_1[0] == 2 and min(batch_1) == 1  # request 0 stopped computing...
    assert all(r.reserved == 64 for r in out.reports[: len(batch_1)])  # ...but kept its 32 slots
    assert out.summary.reserved == 64 * out.num_steps
    # From the step it stopped until its batch ends, its row is idle and its tokens are held, not used.
    stopped_at = len(out.token_ids[0]) - 1  # index of the step that sampled its last token
    final_0 = len(prompts[0]) + len(out.token_ids[0])
    for k, report in enumerate(out.reports[: len(batch_1)]):
        idle = out.num_in_batch[k] - out.num_running[k]
        running_1 = len(prompts[1]) + k + 1  # request 1 runs the whole batch
        if k < stopped_at:
            assert (idle, report.held_after_finish, report.used) == (0, 0, len(prompts[0]) + k + 1 + running_1)
        elif k < len(batch_1) - 1:
            assert (idle, report.held_after_finish, report.used) == (int(k > stopped_at), final_0, running_1)
        assert report.reserved == report.used + report.held_after_finish + report.reservation_waste + (
            report.internal_fragmentation
        )


def test_a_reservation_that_can_never_fit_is_refused(model):
    with pytest.raises(ValueError, match="reserves 32 slots but the arena holds only 16"):
        ContiguousEngine(model, num_slots=16, max_model_len=32, max_batch_size=2).generate([[1, 2, 3]])
    engine = ContiguousEngine(model, num_slots=16, max_model_len=32, max_batch_size=2, reserve="max_tokens")
    with pytest.raises(ValueError, match="reserves 18 slots"):
        engine.generate([[1, 2], [1] * 10], SamplingParams(max_tokens=8))  # 2 + 8 fits, 10 + 8 does not
    assert engine.allocator.reservations == {}  # refused before anything ran
    with pytest.raises(ValueError, match="reserve"):
        ContiguousEngine(model, num_slots=16, max_model_len=8, max_batch_size=2, reserve="lazy")
