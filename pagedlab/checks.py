"""The type checks that the settings objects (`EngineConfig`, `SamplingParams`) share: Python's bool is an int,
and a float can be NaN or infinite, so `isinstance(x, int)` and `x >= 0` alone let through values that fail later
(`True` taken as 1, NaN passing every `not x < low` test)."""

from __future__ import annotations

import math

SEED_RANGE = (-(2**63), 2**64 - 1)  # the seeds torch.Generator.manual_seed takes


def is_int(value) -> bool:
    """An int, not a bool (True would pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite int or float, not a bool (an int beyond the float range is not finite either)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # float(10**400)
        return False


def is_seed(value) -> bool:
    """An int that torch's generators take as a seed."""
    return is_int(value) and SEED_RANGE[0] <= value <= SEED_RANGE[1]
