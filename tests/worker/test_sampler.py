"""The sampler (`pagedlab.worker.sampler`): the filters keep what their definitions keep, even at extreme values."""

from __future__ import annotations

import torch

from pagedlab import SamplingParams
from pagedlab.worker.sampler import filtered_probs


def test_a_tiny_top_p_keeps_the_most_likely_token():
    """top_p = 1e-46 is 0.0 in float32: the nucleus must still hold its first token (issue 31: every token was
    dropped, the probabilities went NaN and token 0 came out whatever the logits)."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    for top_p in (1e-46, 1e-30, 1e-8):
        probs = filtered_probs(logits, [SamplingParams(top_p=top_p)])
        assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0]], top_p
