"""The plan's exceptions and argument checks."""

from __future__ import annotations

import numbers
from typing import Any

from ..errors import StreamcacheError


class PlanError(StreamcacheError, ValueError):
    """An impossible plan: a bad batch size, world size, rank, worker, seed or option."""


class PositionOutOfRangeError(PlanError, IndexError):
    """A position (or sample id) outside ``[0, num_samples)`` of the epoch."""


class CursorMismatchError(PlanError):
    """A saved cursor belongs to another dataset, seed or shuffle, or is malformed."""


def check_int(name: str, value: Any, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """``value`` as a Python int, or :class:`PlanError` naming ``name`` (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PlanError(f"{name} must be an integer, got {value!r}")
    result = int(value)
    if minimum is not None and result < minimum:
        raise PlanError(f"{name} must be >= {minimum}, got {result}")
    if maximum is not None and result > maximum:
        raise PlanError(f"{name} must be <= {maximum}, got {result}")
    return result


def check_seed(seed: Any) -> int:
    """A seed in ``[0, 2**64)``."""
    return check_int("seed", seed, minimum=0, maximum=(1 << 64) - 1)
