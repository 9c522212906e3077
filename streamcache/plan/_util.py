"""The plan's exceptions, argument checks and the strict loader of saved states."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

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
    if type(value) is int:  # the common case, without the ABC check (a cursor per step)
        result = value
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PlanError(f"{name} must be an integer, got {value!r}")
    else:
        result = int(value)
    if minimum is not None and result < minimum:
        raise PlanError(f"{name} must be >= {minimum}, got {result}")
    if maximum is not None and result > maximum:
        raise PlanError(f"{name} must be <= {maximum}, got {result}")
    return result


def check_seed(seed: Any) -> int:
    """A seed in ``[0, 2**64)``."""
    return check_int("seed", seed, minimum=0, maximum=(1 << 64) - 1)


def check_state(data: Any, what: str, keys: frozenset[str], version: int, *,
                hint: str = "") -> dict[str, Any]:
    """``data`` if it is a dict with exactly ``keys`` and ``data["version"] == version``.

    Args:
        what: the state's name in messages ("cursor", "replica ledger").
        hint: appended to the key-set message (e.g. who writes such states).

    Raises:
        CursorMismatchError: not a dict, other keys, or another version.
    """
    if not isinstance(data, dict) or set(data) != keys:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise CursorMismatchError(f"a {what} must be a dict with keys {sorted(keys)}, got "
                                  f"{got}{hint}")
    if data["version"] != version:
        raise CursorMismatchError(f"{what} version {data['version']!r} is not supported "
                                  f"(this streamcache writes version {version})")
    return data


@contextlib.contextmanager
def malformed(what: str) -> Iterator[None]:
    """Turn a :class:`PlanError` about a field of a saved ``what`` into a
    :class:`CursorMismatchError` ("malformed <what>: ...")."""
    try:
        yield
    except CursorMismatchError:
        raise
    except PlanError as exc:
        raise CursorMismatchError(f"malformed {what}: {exc}") from exc


def check_span(start: int, stop: int, num_samples: int) -> None:
    """Raise :class:`PositionOutOfRangeError` unless ``0 <= start <= stop <= num_samples``
    (integers)."""
    check_int("start", start)
    check_int("stop", stop)
    if not 0 <= start <= stop <= num_samples:
        raise PositionOutOfRangeError(
            f"positions [{start}, {stop}) are outside the epoch's [0, {num_samples})")


def check_positions(positions: np.ndarray | Sequence[int], num_samples: int) -> np.ndarray:
    """``positions`` (or ids) as int64, each in ``[0, num_samples)``, or a clear error."""
    pos = np.asarray(positions)
    if pos.size == 0:
        return pos.astype(np.int64)
    if pos.dtype.kind not in "iu":
        raise PlanError(f"positions must be integers, got dtype {pos.dtype}")
    low, high = int(pos.min()), int(pos.max())
    if low < 0 or high >= num_samples:
        raise PositionOutOfRangeError(
            f"positions [{low}, {high}] are outside the epoch's [0, {num_samples})")
    return pos.astype(np.int64)
