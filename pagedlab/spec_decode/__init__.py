"""Speculative decoding: proposers that draft tokens for the running decodes (n-gram prompt lookup, or a smaller
draft model on its own paged KV cache), which the target model verifies in its next forward pass.

The core decides how many drafts each decode verifies and rolls back the rejected ones
(`pagedlab.core.speculation`); the worker scores and accepts them (`pagedlab.worker.rejection_sampler`).

# Explained in chapters/11_speculative_decoding.ipynb
"""

from pagedlab.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
