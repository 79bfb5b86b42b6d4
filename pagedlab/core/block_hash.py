"""Content hashes of full KV blocks, chained from the first block, for prefix caching.

A block's hash covers its parent's hash, its own token ids and any extra key that changes the KV (a cache
salt), so two blocks share a hash only if the whole prefix up to and including them is the same. SHA-256 is
stable across runs and processes (Python's `hash` is salted per process). The cache also compares the
block's own token ids on every hit, so a collision between blocks of different tokens can never hand back the
wrong KV; only a SHA-256 collision of two different prefixes ending in the same block tokens could, which is
not a practical concern.

# Explained in chapters/07_prefix_caching.ipynb
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def root_hash(extra_key: str | None = None) -> BlockHash:
    """The parent hash of a sequence's first block: empty, or derived from a cache salt."""
    return b"" if extra_key is None else hashlib.sha256(b"salt:" + extra_key.encode()).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()
