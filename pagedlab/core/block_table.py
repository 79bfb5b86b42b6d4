"""A block table: one sequence's map from logical KV blocks to physical blocks, and how full it is.

# Explained in chapters/02_paged_blocks.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` slots hold `a` tokens."""
    return -(-a // b)


@dataclass
class BlockTable:
    """The physical blocks of one sequence, in logical order, and how many token slots are in use.

    Token i of the sequence lives in block `block_ids[i // block_size]` at offset `i % block_size`:

        logical:   [ block 0 | block 1 | block 2 ]      num_tokens = 10, block_size = 4
        physical:  [   7     |   1     |   12    ]
        slots:     [x x x x  | x x x x | x x . . ]      last block filled 2/4
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def num_filled_in_last_block(self) -> int:
        if not self.block_ids:
            return 0
        return self.num_tokens - (len(self.block_ids) - 1) * self.block_size

    def slot(self, position: int) -> int:
        """The flat slot index (`block_id * block_size + offset`) of the token at `position`."""
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size
