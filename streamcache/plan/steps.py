"""Steps: which positions of the epoch every rank and worker reads at every step.

A segment is the part of an epoch read with one (global batch, world size): it starts at the
cursor's ``samples_consumed`` and its step ``t`` covers positions ``[start + t*B, start +
(t+1)*B)``. Rank ``r`` takes its part of each step (chosen by a :class:`RankAssignment`),
worker ``k`` of ``K`` takes the steps ``t`` with ``t % K == k``. Everything is a pure
function of its arguments, so every rank computes the same answer without talking.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ._util import PlanError, check_int
from .order import EpochOrder


class TailPolicy(str, enum.Enum):
    """What the last, partial global batch of an epoch becomes.

    DROP: it is not read (every rank has ``floor(remaining / B)`` steps).
    PAD: it is filled up to ``B`` with the samples at the start of the epoch order, flagged
        ``is_padding`` (every sample is read at least once, padding exactly once per pad).
    SPLIT: it is split across ranks as evenly as possible, nothing dropped and nothing
        padded; ranks may get parts of different sizes (even empty) at that one step, but
        still the same number of steps. Meant for evaluation.
    """

    DROP = "drop"
    PAD = "pad"
    SPLIT = "split"


def tail_policy(value: TailPolicy | str) -> TailPolicy:
    """``value`` as a :class:`TailPolicy`, or a :class:`PlanError` listing the choices."""
    try:
        return TailPolicy(value)
    except ValueError:
        raise PlanError(f"unknown tail policy {value!r}; choose one of "
                        f"{[policy.value for policy in TailPolicy]}") from None


class RankAssignment(Protocol):
    """The hook that decides which slots of a global batch each rank reads.

    A global batch is a run of ``sum(part_sizes)`` consecutive positions; a slot is an offset
    into it. ``slots`` must be a pure function of its arguments (every rank calls it for
    itself), return ``part_sizes[rank]`` distinct slots, and the slots of all ranks must
    partition the batch. A locality-aware assignment may look up the shards of the batch with
    ``order.locate`` and give each node the samples of shards it caches (with PAD, positions
    past ``num_samples`` wrap to ``position % num_samples``).
    """

    def slots(self, order: EpochOrder, batch_start: int, part_sizes: Sequence[int],
              rank: int) -> np.ndarray: ...


class ContiguousAssignment:
    """Rank ``r`` takes the ``r``-th run of the batch: concatenating the ranks' parts in rank
    order gives the global batch in order."""

    def slots(self, order: EpochOrder, batch_start: int, part_sizes: Sequence[int],
              rank: int) -> np.ndarray:
        first = sum(part_sizes[:rank])
        return np.arange(first, first + part_sizes[rank], dtype=np.int64)


CONTIGUOUS = ContiguousAssignment()


@dataclass(frozen=True)
class RankBatch:
    """One rank's part of one step.

    Attributes:
        step: the step's index within its segment.
        positions: epoch positions read (int64); padding wraps to the start of the epoch.
        sample_ids: global sample id at each position (int64).
        shards: the shard holding each sample (int64, index order).
        rows: each sample's row within its shard (int64).
        is_padding: True where a position only pads the last batch (bool).

    The arrays of batches computed together may be views of one larger array; treat them as
    read-only.
    """

    step: int
    positions: np.ndarray
    sample_ids: np.ndarray
    shards: np.ndarray
    rows: np.ndarray
    is_padding: np.ndarray


@dataclass(frozen=True)
class EpochSegment:
    """The steps of an epoch from ``start`` on, for one global batch size and world size.

    Attributes:
        num_samples: samples in the epoch.
        start: the cursor's ``samples_consumed`` when the segment began; step ``t`` covers
            positions ``[start + t * global_batch, start + (t + 1) * global_batch)``.
        global_batch: samples per step over all ranks.
        world_size: number of ranks; each takes ``global_batch // world_size`` a step.
        tail: what the last, partial global batch becomes (:class:`TailPolicy`).

    Thread safety: immutable; every method is pure.

    Raises:
        PlanError: the global batch is not a multiple of the world size (or smaller than it),
            or ``start`` lies outside ``[0, num_samples]``.
    """

    num_samples: int
    start: int
    global_batch: int
    world_size: int
    tail: TailPolicy = TailPolicy.DROP

    def __post_init__(self) -> None:
        check_int("num_samples", self.num_samples, minimum=1)
        check_int("samples_consumed", self.start, minimum=0, maximum=self.num_samples)
        check_int("global batch size", self.global_batch, minimum=1)
        check_int("world size", self.world_size, minimum=1)
        if self.world_size > self.global_batch:
            raise PlanError(f"world size {self.world_size} is larger than the global batch "
                            f"{self.global_batch}: every rank needs at least one sample a step")
        if self.global_batch % self.world_size:
            raise PlanError(f"global batch {self.global_batch} is not divisible by world size "
                            f"{self.world_size}: every rank must take the same number of "
                            "samples a step; use a multiple of the world size")
        object.__setattr__(self, "tail", tail_policy(self.tail))

    @property
    def num_steps(self) -> int:
        """Steps in this segment; the same on every rank."""
        remaining = self.num_samples - self.start
        if self.tail is TailPolicy.DROP:
            return remaining // self.global_batch
        return -(-remaining // self.global_batch)

    @property
    def per_rank(self) -> int:
        """Samples per rank in a full step."""
        return self.global_batch // self.world_size

    def step_span(self, step: int) -> tuple[int, int]:
        """Positions ``[first, stop)`` of a step; ``stop`` passes ``num_samples`` only when
        PAD pads it."""
        check_int("step", step, minimum=0, maximum=self.num_steps - 1)
        first = self.start + step * self.global_batch
        stop = first + self.global_batch
        if self.tail is not TailPolicy.PAD:
            stop = min(stop, self.num_samples)
        return first, stop

    def part_sizes(self, step: int) -> list[int]:
        """How many slots of the step each rank takes (all equal except a SPLIT tail)."""
        first, stop = self.step_span(step)
        length = stop - first
        world = self.world_size
        return [length * (r + 1) // world - length * r // world for r in range(world)]

    def worker_steps(self, worker: int, num_workers: int) -> range:
        """The steps worker ``worker`` of ``num_workers`` produces, in order."""
        check_int("num_workers", num_workers, minimum=1)
        check_int("worker", worker, minimum=0, maximum=num_workers - 1)
        return range(worker, self.num_steps, num_workers)

    def samples_consumed_after(self, steps_done: int) -> int:
        """The cursor's ``samples_consumed`` once the first ``steps_done`` steps are consumed."""
        check_int("steps_done", steps_done, minimum=0, maximum=self.num_steps)
        return min(self.num_samples, self.start + steps_done * self.global_batch)

    def rank_batch(self, order: EpochOrder, step: int, rank: int,
                   assignment: RankAssignment = CONTIGUOUS) -> RankBatch:
        """Rank ``rank``'s part of step ``step``: positions, sample ids and padding flags."""
        check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        if order.num_samples != self.num_samples:
            raise PlanError(f"the order has {order.num_samples} samples but the segment "
                            f"{self.num_samples}")
        if isinstance(assignment, ContiguousAssignment):
            first, _ = self.step_span(step)
            sizes = self.part_sizes(step)
            lo = first + sum(sizes[:rank])
            return self._contiguous(order, step, lo, lo + sizes[rank])
        return self._batch(order, step, self._assigned(order, step, rank, assignment))

    def _assigned(self, order: EpochOrder, step: int, rank: int,
                  assignment: RankAssignment) -> np.ndarray:
        """The (virtual) positions ``assignment`` gives ``rank`` at ``step``, checked."""
        first, _ = self.step_span(step)
        sizes = self.part_sizes(step)
        slots = np.asarray(assignment.slots(order, first, sizes, rank), dtype=np.int64)
        if slots.shape != (sizes[rank],) or (slots.size and (
                slots.min() < 0 or slots.max() >= sum(sizes)
                or np.unique(slots).size != slots.size)):
            raise PlanError(f"rank assignment returned slots {slots!r} for rank {rank}; "
                            f"expected {sizes[rank]} distinct slots in [0, {sum(sizes)})")
        return first + slots

    def check_assignment(self, order: EpochOrder, step: int,
                         assignment: RankAssignment) -> None:
        """Raise :class:`PlanError` unless ``assignment`` partitions step ``step`` among the
        ranks (for testing an assignment; it calls the assignment for every rank)."""
        sizes = self.part_sizes(step)
        first, _ = self.step_span(step)
        taken = np.concatenate([np.asarray(assignment.slots(order, first, sizes, rank),
                                           dtype=np.int64) for rank in range(self.world_size)])
        if not np.array_equal(np.sort(taken), np.arange(sum(sizes))):
            raise PlanError(f"rank assignment does not partition step {step}: the ranks' "
                            f"slots must cover [0, {sum(sizes)}) once each")

    def _contiguous(self, order: EpochOrder, step: int, lo: int, hi: int) -> RankBatch:
        if hi > self.num_samples:
            return self._batch(order, step, np.arange(lo, hi, dtype=np.int64))
        return RankBatch(step, np.arange(lo, hi, dtype=np.int64), *order.samples(lo, hi),
                         np.zeros(hi - lo, dtype=bool))

    def _batch(self, order: EpochOrder, step: int, virtual: np.ndarray) -> RankBatch:
        """The batch of ``virtual`` positions (past ``num_samples``: padding, wrapped)."""
        positions = virtual % self.num_samples
        ids, shards, rows = order.samples_at(positions)
        return RankBatch(step, positions, ids, shards, rows, virtual >= self.num_samples)

    def rank_batches(self, order: EpochOrder, steps: Sequence[int], rank: int,
                     assignment: RankAssignment = CONTIGUOUS) -> list[RankBatch]:
        """:meth:`rank_batch` for several steps at once, in one vectorized pass.

        Cheaper per step than one call per step: the ids of all the steps' positions are
        computed together, and only the rank's own positions are computed at all.
        """
        steps = list(steps)
        full = [s for s in steps if self._is_full(s)]
        if len(full) < 2:
            return [self.rank_batch(order, step, rank, assignment) for step in steps]
        check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        if order.num_samples != self.num_samples:
            raise PlanError(f"the order has {order.num_samples} samples but the segment "
                            f"{self.num_samples}")
        if not isinstance(assignment, ContiguousAssignment):
            return self._assigned_batches(order, steps, full, rank, assignment)
        width = self.per_rank
        firsts = (self.start + rank * width
                  + np.asarray(full, dtype=np.int64) * self.global_batch)
        positions = (firsts[:, None] + np.arange(width, dtype=np.int64)).ravel()
        arrays = (positions, *order.samples_at(positions), np.zeros(positions.size, bool))
        batches = {step: RankBatch(step, *(a[i * width:(i + 1) * width] for a in arrays))
                   for i, step in enumerate(full)}
        return [batches[step] if step in batches else self.rank_batch(order, step, rank)
                for step in steps]

    def _assigned_batches(self, order: EpochOrder, steps: list[int], full: list[int],
                          rank: int, assignment: RankAssignment) -> list[RankBatch]:
        """:meth:`rank_batch` of several steps (``full``: those of them that are whole
        batches) with one lookup of all their samples (the assignment decides each step's
        slots on its own, or the whole steps together where it has ``batches_many``)."""
        together = self._assigned_together(order, full, rank, assignment)
        if together:  # (the whole steps came with their samples; the others, one by one)
            return [together[step] if step in together else
                    self.rank_batch(order, step, rank, assignment) for step in steps]
        virtual = [self._assigned(order, step, rank, assignment) for step in steps]
        bounds = np.cumsum([0] + [len(v) for v in virtual])
        joined = np.concatenate(virtual)
        arrays = (joined % self.num_samples, *order.samples_at(joined % self.num_samples),
                  joined >= self.num_samples)
        return [RankBatch(step, *(a[bounds[i]:bounds[i + 1]] for a in arrays))
                for i, step in enumerate(steps)]

    def _assigned_together(self, order: EpochOrder, full: list[int], rank: int,
                           assignment: RankAssignment) -> dict[int, RankBatch]:
        """The rank's batches of the whole steps ``full``, from the assignment's
        ``batches_many`` (one call for all of them: slots, and the ids, shards and rows the
        assignment read to choose them), checked; {} where it has none."""
        many = getattr(assignment, "batches_many", None)
        if many is None or len(full) < 2:
            return {}
        sizes = self.part_sizes(full[0])
        # (a whole step's span starts here: step_span's first, without a check per step)
        firsts = self.start + np.asarray(full, dtype=np.int64) * self.global_batch
        slots, ids, shards, rows = (np.asarray(a, dtype=np.int64) for a in many(
            order, firsts, sizes, rank))
        shape = (len(full), sizes[rank])
        if any(a.shape != shape for a in (slots, ids, shards, rows)) or (slots.size and (
                slots.min() < 0 or slots.max() >= sum(sizes)
                or (np.diff(slots, axis=1) <= 0).any())):
            raise PlanError(f"rank assignment returned slots of shape {slots.shape} for rank "
                            f"{rank}; expected {sizes[rank]} ascending distinct slots in "
                            f"[0, {sum(sizes)}) for each of {len(full)} steps")
        positions = firsts[:, None] + slots
        padding = np.zeros(sizes[rank], dtype=bool)
        return {step: RankBatch(step, positions[i], ids[i], shards[i], rows[i], padding)
                for i, step in enumerate(full)}

    def _is_full(self, step: int) -> bool:
        """Whether a step is a whole batch inside the epoch (only the last step may not be)."""
        check_int("step", step, minimum=0, maximum=self.num_steps - 1)
        return self.start + (step + 1) * self.global_batch <= self.num_samples

    def worker_batches(self, order: EpochOrder, rank: int, worker: int, num_workers: int,
                       assignment: RankAssignment = CONTIGUOUS,
                       positions_per_pass: int = 1 << 16) -> Iterator[RankBatch]:
        """The batches worker ``worker`` of rank ``rank`` produces, in step order.

        Ids are computed for up to ``positions_per_pass`` positions (whole steps) at a time,
        ahead of the step being yielded (pure, so that costs only memory). The first pass is
        one step, so the first batch of an epoch or a resume waits for its own ids only (an
        epoch of 10,000 samples cost ~1.3 ms of ids, with the GIL held, which each reader
        thread computed before its first read: 6 ms from an epoch's start to its first batch
        of 100 KB rows, 3.7 ms with one step first); the second is an eighth of a pass, so
        the next batch does not wait for a whole pass either (each pass costs ~0.4 ms of
        numpy calls beside its ids).
        """
        steps = self.worker_steps(worker, num_workers)
        per_pass = max(1, positions_per_pass // self.per_rank)
        first = 0
        sizes = iter((1, max(1, per_pass // 8)))
        while first < len(steps):
            size = next(sizes, per_pass)
            yield from self.rank_batches(order, steps[first:first + size], rank, assignment)
            first += size
