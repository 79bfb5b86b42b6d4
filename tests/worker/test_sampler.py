"""The sampler (`pagedlab.worker.sampler`): the filters keep what their definitions keep, even at extreme values."""

from __future__ import annotations

import pytest
import torch

from pagedlab import SamplingParams
from pagedlab.worker.sampler import argmax, filtered_probs


def test_a_tiny_top_p_keeps_the_most_likely_token():
    """top_p = 1e-46 is 0.0 in float32: the nucleus must still hold its first token (issue 31: every token was
    dropped, the probabilities went NaN and token 0 came out whatever the logits)."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    for top_p in (1e-46, 1e-30, 1e-8):
        probs = filtered_probs(logits, [SamplingParams(top_p=top_p)])
        assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0]], top_p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_is_torchs_argmax_ties_infinities_and_nans_included(dtype):
    """The sampler's `argmax` (`max(dim=-1).indices`, the faster kernel on CPU) picks what `argmax(dim=-1)` picks:
    the first of tied maxima, a NaN wherever one is, and index 0 in a row that is all -inf."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        rows, vocab = (int(torch.randint(1, n, (1,), generator=generator)) for n in (40, 3000))
        logits = torch.randint(-3, 3, (rows, vocab), generator=generator).to(dtype)  # many ties
        logits[:, ::7] = -float("inf")
        if trial % 3 == 0:
            logits[0] = -float("inf")
        if trial % 4 == 0:
            logits[rows // 2, vocab // 2] = float("nan")
        if trial % 5 == 0:
            logits = logits.t().contiguous().t()  # rows not contiguous
        assert torch.equal(argmax(logits), logits.argmax(dim=-1))
        assert torch.equal(argmax(logits[0]), logits[0].argmax())
