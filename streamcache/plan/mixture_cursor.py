"""The cursor of a mixture: where the mixture stands, the same on every rank, strict on load.

A mixture epoch is a run of positions of the mixture's global sequence (see mixture.py);
``(epoch, samples_consumed)`` moves exactly as a single dataset's cursor does, so segments,
steps and the loader treat it alike. What the cursor adds is what fixes the sequence: the
sources (fingerprint, sample count, epoch size), the phases in force (the weights, as integer
shares, since the position where they last changed, and every source's count there), and
whether the mixture is finite (an epoch ends when the first source finishes its epoch, and the
next epoch starts every source's next epoch) or infinite (sources roll over on their own).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ._util import CursorMismatchError, PlanError, check_int, check_seed, malformed
from .cursor import (
    CURSOR_VERSION,
    EPOCH_LIMIT,
    IDENTITY_HINT,
    DataIdentity,
    ResumeCheck,
    check_versioned_state,
    identity_problems,
    moved_within_epoch,
)
from .mixture import EpochPlan, Phase
from .quota import quota
from .shares import MAX_PERIOD
from .shuffle import ShuffleOptions
from .steps import EpochSegment, TailPolicy, tail_policy

#: Version 2 adds each source's ``data`` (its DataIdentity, or null where its index has
#: checksums); version 1 states load where that is unambiguous (docs/mixtures.md).
MIXTURE_CURSOR_VERSION = CURSOR_VERSION
_KEYS = frozenset({"version", "kind", "sources", "seed", "shuffle", "infinite", "epoch",
                   "epoch_start", "num_samples", "samples_consumed", "phases",
                   "source_cursors"})
_SOURCE_KEYS_ORDER = ("dataset_fingerprint", "num_samples", "epoch_samples")
_SOURCE_KEYS = {1: frozenset(_SOURCE_KEYS_ORDER),
                MIXTURE_CURSOR_VERSION: frozenset({*_SOURCE_KEYS_ORDER, "data"})}
_PHASE_KEYS = frozenset({"start", "counts", "shares"})
KIND = "mixture"
#: Positions and counts in a saved state stay below this (int64 arithmetic never overflows:
#: the sum of two of them is below 2**63).
POSITION_LIMIT = 1 << 62
_LARGEST = POSITION_LIMIT - 1
#: Phases a saved state may hold (one is added per change of weights within an epoch).
MAX_PHASES = 1024


@dataclass(frozen=True)
class SourceKey:
    """What a saved mixture cursor checks of each source: its fingerprint, sample count and
    epoch size, and for an index without checksums its :class:`DataIdentity`."""

    dataset_fingerprint: str
    num_samples: int
    epoch_samples: int
    data: DataIdentity | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dataset_fingerprint, str) or not self.dataset_fingerprint:
            raise PlanError(f"dataset_fingerprint must be a non-empty string, got "
                            f"{self.dataset_fingerprint!r}")
        check_int("num_samples", self.num_samples, minimum=1, maximum=_LARGEST)
        check_int("epoch_samples", self.epoch_samples, minimum=1, maximum=_LARGEST)
        if self.data is not None and not isinstance(self.data, DataIdentity):
            raise PlanError(f"data must be a DataIdentity or None, got {self.data!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"dataset_fingerprint": self.dataset_fingerprint,
                "num_samples": self.num_samples, "epoch_samples": self.epoch_samples,
                "data": None if self.data is None else self.data.to_dict()}

    @classmethod
    def from_dict(cls, value: Any, version: int) -> SourceKey:
        entry = _strict(value, _SOURCE_KEYS[version], "source")
        return cls(entry["dataset_fingerprint"], entry["num_samples"], entry["epoch_samples"],
                   DataIdentity.from_dict(entry.get("data")))

    def differences(self, current: SourceKey, saved_version: int,
                    check: ResumeCheck) -> list[str]:
        """What makes this saved source another than ``current``."""
        shape = [f"{name.replace('_', ' ')}: saved {getattr(self, name)!r}, now "
                 f"{getattr(current, name)!r}" for name in _SOURCE_KEYS_ORDER
                 if getattr(self, name) != getattr(current, name)]
        return shape or identity_problems(self.data, saved_version, current.data, check)


@dataclass(frozen=True)
class MixtureCursor:
    """Progress through the epochs of a mixture.

    Attributes:
        sources: each source's :class:`SourceKey`, in the order the run began with (the
            order of its list then; a resume with the sources listed in another order keeps
            it, see :meth:`load`).
        seed, shuffle: the order's seed and shuffle options (each source's own order
            derives its seed from ``seed`` and its index).
        infinite: how epochs follow each other (see the module docstring).
        phases: the phases that cover the epoch (the first begins at or before its start).
        epoch, samples_consumed: as a single dataset's cursor.
        num_samples: positions in this epoch.
        epoch_start: the epoch's first global position.
        saved_version: the state version it was read from (1: no data identities).

    Thread safety: immutable.
    """

    sources: tuple[SourceKey, ...]
    seed: int
    shuffle: ShuffleOptions
    infinite: bool
    phases: tuple[Phase, ...]
    num_samples: int
    epoch: int = 0
    epoch_start: int = 0
    samples_consumed: int = 0
    saved_version: int = dataclasses.field(default=MIXTURE_CURSOR_VERSION, compare=False,
                                           repr=False)

    def __post_init__(self) -> None:
        check_seed(self.seed)
        check_int("epoch", self.epoch, minimum=0, maximum=EPOCH_LIMIT - 1)
        check_int("epoch_start", self.epoch_start, minimum=0, maximum=_LARGEST)
        check_int("num_samples", self.num_samples, minimum=1, maximum=_LARGEST)
        check_int("samples_consumed", self.samples_consumed, minimum=0,
                  maximum=self.num_samples)
        if not self.phases or self.phases[0].start > self.epoch_start or any(
                a.start >= b.start for a, b in zip(self.phases, self.phases[1:], strict=False)):
            raise PlanError("the phases must be in order, the first at or before the epoch")

    @classmethod
    def start(cls, sources: tuple[SourceKey, ...], shares: tuple[int, ...], seed: int,
              shuffle: ShuffleOptions, infinite: bool) -> MixtureCursor:
        """The cursor at the start of the run."""
        phase = Phase(0, (0,) * len(sources), shares)
        return cls(sources, seed, shuffle, infinite, (phase,),
                   _epoch_length(sources, phase, 0, 0))

    # ------------------------------------------------------------ positions

    @property
    def shares(self) -> tuple[int, ...]:
        return self.phases[-1].shares

    @property
    def position(self) -> int:
        """The next global position to read."""
        return self.epoch_start + self.samples_consumed

    def counts_at(self, position: int) -> tuple[int, ...]:
        """Every source's samples read (over the run) before global ``position``."""
        phase = [p for p in self.phases if p.start <= position][-1]
        return phase.counts_at(position)

    def source_cursors(self) -> list[tuple[int, int]]:
        """Every source's own (epoch, samples consumed) at the cursor."""
        return [divmod(k, s.epoch_samples)
                for k, s in zip(self.counts_at(self.position), self.sources, strict=True)]

    @property
    def next_num_samples(self) -> int:
        """Positions in every epoch after this one (they start afresh with today's shares)."""
        return _epoch_length(self.sources, Phase(0, (0,) * len(self.sources), self.shares),
                             0, 0)

    def epoch_plan(self, epoch: int) -> EpochPlan:
        """What fixes epoch ``epoch`` (this one or a later one). A later epoch is reached by
        reading every position of the epochs between; where an infinite mixture's epoch
        starts depends on the global batch (:meth:`at_epoch`), so a schedule takes it from its
        own cursors instead."""
        if epoch < self.epoch:
            raise PlanError(f"a mixture's order is known from the cursor's epoch "
                            f"({self.epoch}) on, not for epoch {epoch}")
        cursor = self
        while cursor.epoch < epoch:
            cursor = cursor._next_epoch()
        return EpochPlan(cursor.epoch, cursor.num_samples, cursor.epoch_start, cursor.phases)

    # ------------------------------------------------------------ moving

    def segment(self, global_batch: int, world_size: int,
                tail: TailPolicy | str = TailPolicy.DROP) -> EpochSegment:
        """The rest of the epoch as steps of ``global_batch`` on ``world_size`` ranks."""
        return EpochSegment(self.num_samples, self.samples_consumed, global_batch, world_size,
                            tail_policy(tail))

    def advanced(self, segment: EpochSegment, steps_done: int) -> MixtureCursor:
        """As :meth:`Cursor.advanced`: after the segment's last step, the next epoch."""
        if segment.start != self.samples_consumed or segment.num_samples != self.num_samples:
            raise PlanError("the segment was not begun at this cursor")
        consumed = segment.samples_consumed_after(steps_done)
        if steps_done == segment.num_steps:
            return self._next_epoch(consumed)
        return moved_within_epoch(self, consumed)

    def _next_epoch(self, consumed: int | None = None) -> MixtureCursor:
        """The next epoch's start once ``consumed`` positions of this one are read (default:
        all). Infinite, the sequence goes on from there, so a tail that a global batch
        "drop" left unread is read next, not skipped."""
        start = self.epoch_start + (self.num_samples if consumed is None else consumed)
        if self.infinite:  # only the phase in force is needed
            phase = [p for p in self.phases if p.start <= start][-1]
        else:  # every source starts its next epoch
            phase = Phase(start, tuple((self.epoch + 1) * s.epoch_samples
                                       for s in self.sources), self.shares)
        return dataclasses.replace(self, epoch=self.epoch + 1, epoch_start=start,
                                   samples_consumed=0, phases=(phase,),
                                   num_samples=self.next_num_samples)

    def at_epoch(self, epoch: int, global_batch: int | None = None,
                 tail: TailPolicy | str = TailPolicy.DROP) -> MixtureCursor:
        """The start of ``epoch``: this epoch's start, a later epoch as reached from here,
        an earlier one as a fresh run with today's shares would reach it.

        An infinite mixture's epoch is the steps of one epoch length read in global batches
        of ``global_batch`` (required for it) with ``tail``: with ``"drop"`` the positions a
        global batch does not fill are read first in the next epoch, so where an epoch
        starts depends on the global batch (docs/mixtures.md, "Epochs").
        """
        if self.infinite:
            if global_batch is None:
                raise PlanError("where an infinite mixture's epoch starts depends on the "
                                "global batch; give it")
            return self._infinite_epoch(epoch, global_batch, tail)
        if epoch >= self.epoch:
            plan = self.epoch_plan(epoch)
            return dataclasses.replace(self, epoch=epoch, epoch_start=plan.start,
                                       num_samples=plan.num_samples, phases=plan.phases,
                                       samples_consumed=0)
        fresh = MixtureCursor.start(self.sources, self.shares, self.seed, self.shuffle,
                                    self.infinite)
        return fresh.at_epoch(epoch)

    def _infinite_epoch(self, epoch: int, global_batch: int,
                        tail: TailPolicy | str) -> MixtureCursor:
        """:meth:`at_epoch` of an infinite mixture: the rest of this epoch in steps of
        ``global_batch``, then whole epochs of the same steps, as a schedule reads them."""
        if epoch < self.epoch:
            fresh = MixtureCursor.start(self.sources, self.shares, self.seed, self.shuffle,
                                        self.infinite)
            return fresh._infinite_epoch(epoch, global_batch, tail)
        if epoch == self.epoch:
            return dataclasses.replace(self, samples_consumed=0)
        rest = self.segment(global_batch, 1, tail)
        after = self.advanced(rest, rest.num_steps)
        whole = EpochSegment(after.num_samples, 0, global_batch, 1, tail_policy(tail))
        read = whole.samples_consumed_after(whole.num_steps)  # positions an epoch reads
        return dataclasses.replace(after, epoch=epoch,
                                   epoch_start=after.epoch_start + (epoch - after.epoch) * read)

    def with_shares(self, shares: tuple[int, ...]) -> MixtureCursor:
        """New weights from the cursor on: a phase starts here with every source's count, so
        no source repeats or skips a sample of its epoch. A finite epoch is cut again where
        the first source now finishes its epoch."""
        if shares == self.shares:
            return self
        if len(shares) != len(self.sources):
            raise PlanError(f"{len(shares)} shares for {len(self.sources)} sources")
        here = self.position
        phase = Phase(here, self.counts_at(here), shares)
        phases = (*(p for p in self.phases if p.start < here), phase)
        covering = [i for i, p in enumerate(phases) if p.start <= self.epoch_start]
        phases = phases[covering[-1]:]
        num_samples = self.num_samples if self.infinite else \
            _epoch_length(self.sources, phase, self.epoch, self.epoch_start)
        return dataclasses.replace(self, phases=phases, num_samples=max(
            num_samples, self.samples_consumed, 1))

    # ------------------------------------------------------------ state

    def to_dict(self) -> dict[str, Any]:
        """A small, JSON-able, versioned dict (the loader's state)."""
        return {
            "version": MIXTURE_CURSOR_VERSION, "kind": KIND,
            "sources": [s.to_dict() for s in self.sources],
            "seed": self.seed, "shuffle": self.shuffle.to_dict(), "infinite": self.infinite,
            "epoch": self.epoch, "epoch_start": self.epoch_start,
            "num_samples": self.num_samples, "samples_consumed": self.samples_consumed,
            "phases": [{"start": p.start, "counts": list(p.counts), "shares": list(p.shares)}
                       for p in self.phases],
            "source_cursors": [list(c) for c in self.source_cursors()],
        }

    @classmethod
    def from_dict(cls, data: Any) -> MixtureCursor:
        """Read :meth:`to_dict`'s output (or a version 1 state) back; anything else, or a
        state that does not hold together (positions past the limits, phases whose shares
        pass :data:`~streamcache.plan.mixture.MAX_PERIOD`, a finite epoch of another length
        than its sources give, counts that do not follow), raises CursorMismatchError."""
        if isinstance(data, dict) and data.get("kind") != KIND:
            raise CursorMismatchError(
                "the saved loader state is of a single dataset, not of a mixture of sources; "
                "resume it with the StreamDataset it was saved from")
        _, version = check_versioned_state(data, "mixture cursor",
                                           dict.fromkeys(_SOURCE_KEYS, _KEYS),
                                           MIXTURE_CURSOR_VERSION)
        with malformed("mixture cursor"):
            sources = tuple(SourceKey.from_dict(s, version) for s in _list(data["sources"]))
            phases = tuple(_phase(p, len(sources)) for p in _list(data["phases"], MAX_PHASES))
            if not isinstance(data["infinite"], bool):
                raise PlanError(f"infinite must be a bool, got {data['infinite']!r}")
            cursor = cls(sources, data["seed"], ShuffleOptions.from_dict(data["shuffle"]),
                         data["infinite"], phases, data["num_samples"], data["epoch"],
                         data["epoch_start"], data["samples_consumed"], version)
            cursor._check_finite_epoch()
        if [list(c) for c in cursor.source_cursors()] != data["source_cursors"]:
            raise CursorMismatchError(
                f"malformed mixture cursor: the sources' cursors {data['source_cursors']} do "
                f"not follow from its phases ({[list(c) for c in cursor.source_cursors()]})")
        return cursor

    def _check_finite_epoch(self) -> None:
        """A finite epoch starts every source's epoch and ends where the first finishes it."""
        if self.infinite:
            return
        expected = tuple(self.epoch * s.epoch_samples for s in self.sources)
        if self.counts_at(self.epoch_start) != expected:
            raise PlanError(f"a finite epoch {self.epoch} starts every source at its epoch's "
                            f"start ({list(expected)}), the phases say "
                            f"{list(self.counts_at(self.epoch_start))}")
        length = max(_epoch_length(self.sources, self.phases[-1], self.epoch,
                                   self.epoch_start), self.samples_consumed, 1)
        if self.num_samples != length:
            raise PlanError(f"num_samples is {self.num_samples}, the sources and weights "
                            f"give an epoch of {length}")

    def source_order(self, current: MixtureCursor, check: ResumeCheck = "identity",
                     ) -> tuple[int, ...]:
        """Where each saved source is in ``current``'s list: the same index, or, when the
        sources are listed in another order, the one current source with the same data
        (fingerprint, sample count, epoch size and identity).

        Raises:
            CursorMismatchError: another number of sources, a saved source that is not in
                the list, or one that matches several (the same data listed twice).
        """
        saved, now = self.sources, current.sources
        if len(saved) != len(now):
            raise _mismatch([f"number of sources: saved {len(saved)}, now {len(now)}"])
        differences = [s.differences(c, self.saved_version, check)
                       for s, c in zip(saved, now, strict=True)]
        if not any(differences):
            return tuple(range(len(now)))
        candidates = [[j for j, c in enumerate(now)
                       if not s.differences(c, self.saved_version, check)] for s in saved]
        order = tuple(found[0] for found in candidates if len(found) == 1)
        if len(order) == len(now) and len(set(order)) == len(now):
            return order
        problems = [f"source {i} {d}" for i, found in enumerate(differences) for d in found]
        identity = any(p for s, c in zip(saved, now, strict=True)
                       for p in identity_problems(s.data, self.saved_version, c.data, check))
        raise _mismatch(problems, identity=identity,
                        unmatched=[i for i, found in enumerate(candidates) if len(found) != 1])

    def check_matches(self, current: MixtureCursor, check: ResumeCheck = "identity") -> None:
        """Raise CursorMismatchError unless the cursor belongs to ``current``'s mixture (its
        sources in this order or in another: :meth:`source_order`)."""
        self.source_order(current, check)
        problems = [f"{name}: saved {getattr(self, name)!r}, now {getattr(current, name)!r}"
                    for name in ("seed", "shuffle", "infinite")
                    if getattr(self, name) != getattr(current, name)]
        if problems:
            raise _mismatch(problems)

    @classmethod
    def load(cls, data: Any, current: MixtureCursor, check: ResumeCheck = "identity",
             ) -> tuple[MixtureCursor, tuple[int, ...]]:
        """The strict way to resume: :meth:`from_dict`, :meth:`check_matches`, then the
        current weights from the saved position on (:meth:`with_shares`).

        Returns:
            ``(cursor, order)``: saved source ``i`` is source ``order[i]`` of ``current``.
            The cursor keeps the saved order of the sources (the mixture's sequence depends
            on it), bound to the current sources' data; a mixture whose sources are listed
            in another order reads in the saved order and labels each sample with its
            source's index in the current list.
        """
        cursor = cls.from_dict(data)
        cursor.check_matches(current, check)
        order = cursor.source_order(current, check)
        shares = tuple(current.shares[j] for j in order)
        resumed = cursor.with_shares(shares)
        return dataclasses.replace(
            resumed, sources=tuple(current.sources[j] for j in order),
            saved_version=MIXTURE_CURSOR_VERSION), order


def _mismatch(problems: list[str], *, identity: bool = False,
              unmatched: list[int] | None = None) -> CursorMismatchError:
    """The CursorMismatchError of a state of another mixture, naming what differs."""
    reorder = ("; no order of the listed sources matches the saved ones either (saved "
               f"source{'s' if len(unmatched) > 1 else ''} {', '.join(map(str, unmatched))} "
               "match no source, or more than one)") if unmatched else ""
    return CursorMismatchError(
        f"the saved cursor does not belong to this mixture ({'; '.join(problems)}{reorder}); "
        "resume with the same sources (in any order), seed, shuffle options and infinite "
        "mode, or start fresh without loading the loader state"
        + (f"; {IDENTITY_HINT}" if identity else ""))


def _phase(value: Any, sources: int) -> Phase:
    """A saved phase, checked: positions below the limit, shares within one period table."""
    entry = _strict(value, _PHASE_KEYS, "phase")
    shares = _ints(entry["shares"], sources, 1, MAX_PERIOD)
    if sum(shares) > MAX_PERIOD:
        raise PlanError(f"a phase's shares add up to {sum(shares)}, more than a mixture's "
                        f"longest period ({MAX_PERIOD})")
    return Phase(check_int("phase start", entry["start"], minimum=0, maximum=_LARGEST),
                 _ints(entry["counts"], sources, 0, _LARGEST), shares)


def _epoch_length(sources: tuple[SourceKey, ...], phase: Phase, epoch: int,
                  epoch_start: int) -> int:
    """Positions from ``epoch_start`` until the first source finishes its epoch ``epoch``."""
    table = quota(phase.shares)
    ends = [phase.start + table.positions_for(s, (epoch + 1) * source.epoch_samples - count)
            for s, (source, count) in enumerate(zip(sources, phase.counts, strict=True))]
    return max(1, min(ends) - epoch_start)


def _list(value: Any, limit: int | None = None) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise PlanError(f"expected a non-empty list, got {value!r}")
    if limit is not None and len(value) > limit:
        raise PlanError(f"expected at most {limit} items, got {len(value)}")
    return value


def _strict(value: Any, keys: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != keys:
        raise PlanError(f"a {what} must be a dict with keys {sorted(keys)}, got {value!r}")
    return value


def _ints(value: Any, length: int, minimum: int, maximum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != length:
        raise PlanError(f"expected a list of {length} integers, got {value!r}")
    return tuple(check_int("a count or share", v, minimum=minimum, maximum=maximum)
                 for v in value)


__all__ = ["MIXTURE_CURSOR_VERSION", "MixtureCursor", "SourceKey"]
