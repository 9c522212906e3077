"""The steps of one pass: a rank's schedule from a cursor on, and a reference to one step.

A :class:`Schedule` is made when a pass starts (with the topology resolved then): the rest of
the cursor's epoch, then, for an infinite loader, whole epochs. Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..plan import Cursor, EpochSegment, PlanError, TailPolicy
from ..plan.mixture_cursor import MixtureCursor


@dataclass(frozen=True)
class StepRef:
    """One global step: its epoch, the segment it belongs to and its index there."""

    epoch: int
    segment: EpochSegment
    step: int
    number: int  # global step number counted from the schedule's start


class Schedule:
    """The steps of one rank from a cursor on: the rest of its epoch, then (infinite) whole
    epochs. Made when a pass starts, with the topology resolved then.

    Raises:
        PlanError: impossible batch and world sizes, or an epoch that holds no step at all
            (fewer samples than a global batch with tail "drop"): it would yield nothing,
            every epoch, without a word.
    """

    def __init__(self, cursor: Cursor | MixtureCursor, global_batch: int, rank: int,
                 world_size: int, tail: TailPolicy, infinite: bool) -> None:
        self.cursor = cursor
        self.rank = rank
        self.first = cursor.segment(global_batch, world_size, tail)
        self.full = EpochSegment(later_epoch_samples(cursor), 0, global_batch, world_size,
                                 tail)
        self.infinite = infinite
        if self.full.num_steps == 0:
            raise PlanError(
                f"an epoch of {self.full.num_samples} samples holds no step of a global batch of "
                f"{global_batch} with tail=\"drop\": no step can ever be formed. Use a global "
                f"batch of at most {self.full.num_samples} samples, or tail=\"pad\" or "
                "tail=\"split\" to read the short epoch as one step"
            )

    def segments(self) -> Iterator[tuple[int, EpochSegment, int]]:
        """(epoch, segment, number of its first step): the first, then (infinite) full ones."""
        number, epoch, segment = 0, self.cursor.epoch, self.first
        while True:
            yield epoch, segment, number
            if not self.infinite:
                return
            number += segment.num_steps
            epoch, segment = epoch + 1, self.full

    def cursor_after(self, steps_done: int) -> Cursor | MixtureCursor:
        """The cursor once ``steps_done`` global steps of this schedule are consumed."""
        cursor: Cursor | MixtureCursor = self.cursor
        segment = self.first
        if not self.infinite:
            return cursor.advanced(segment, steps_done)
        while steps_done >= segment.num_steps:
            steps_done -= segment.num_steps
            cursor = cursor.advanced(segment, segment.num_steps)
            segment = self.full
        return cursor.advanced(segment, steps_done)


def later_epoch_samples(cursor: Cursor | MixtureCursor) -> int:
    """Positions in every epoch after the cursor's (a mixture's current epoch may be cut
    short or long by a change of weights; a dataset's epochs are all alike)."""
    return cursor.next_num_samples if isinstance(cursor, MixtureCursor) else cursor.num_samples


__all__ = ["Schedule", "StepRef", "later_epoch_samples"]
