"""The plan: which sample every rank and worker reads at every step. Pure, no I/O.

- :class:`EpochOrder`: the epoch's global sample order, random access at any position.
- :class:`EpochSegment`: the steps of an epoch from a cursor on, per rank and worker.
- :class:`Cursor`: ``(epoch, samples_consumed)`` plus what must match to resume.
- :func:`sample_seeds`: per-sample seeds that do not depend on who reads the sample.

See docs/plan.md for the design.
"""

from __future__ import annotations

from ._util import CursorMismatchError, PlanError, PositionOutOfRangeError
from .bijection import sample_seeds
from .cursor import CURSOR_VERSION, Cursor
from .order import EpochOrder
from .shuffle import DEFAULT_WINDOW, NO_SHUFFLE, ShuffleOptions
from .steps import (
    CONTIGUOUS,
    ContiguousAssignment,
    EpochSegment,
    RankAssignment,
    RankBatch,
    TailPolicy,
)

__all__ = [
    "CONTIGUOUS",
    "CURSOR_VERSION",
    "DEFAULT_WINDOW",
    "NO_SHUFFLE",
    "ContiguousAssignment",
    "Cursor",
    "CursorMismatchError",
    "EpochOrder",
    "EpochSegment",
    "PlanError",
    "PositionOutOfRangeError",
    "RankAssignment",
    "RankBatch",
    "ShuffleOptions",
    "TailPolicy",
    "sample_seeds",
]
