"""The replica-group plan and the ledger of uncommitted slices. Pure: no I/O, no clocks.

An epoch's order (the same :class:`~streamcache.plan.EpochOrder` as the plain loader) is cut
into *slices* of ``global_batch / num_groups`` consecutive positions; slice ``i`` covers
positions ``[i * S, (i + 1) * S)``. At every step each replica group is handed exactly one
slice, or a padding slice when the epoch has nothing left for it; a group's ranks split
their slice contiguously. After the step the training loop reports which groups committed
it, and the :class:`Ledger` moves on:

- a slice handed to a group that committed is done;
- a slice handed to a group that did not commit (down, failed, or the step was discarded)
  becomes *pending*, and pending slices are handed out first at the next step, to the groups
  that committed the previous step before the others (a group that is down is still handed
  a slice, so that it has a batch the moment it is back; served last, it mostly gets a
  fresh one);
- the epoch ends after the step at which no fresh slice is left and nothing is pending.

So every slice, hence every sample, is committed exactly once per epoch; every group gets the
same number of samples a step (collectives keep working); at most one slice per group that
did not commit is ever pending (they are all re-issued at the next step), so the ledger grows
with the failures of the last step only, never with their history. With no failures, step
``t`` hands group ``g`` slice ``t * G + g``: the plain loader's global batch ``t``, split the
same way.

The ledger is a function of the committed-groups history only, so every live rank computes
the same one without talking; a rejoining group copies it from a live peer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan import CursorMismatchError, PlanError, TailPolicy
from ..plan._util import check_int, check_state, malformed

PAD_SLICE = -1
"""The slice a group gets when the epoch has no work left for it (flagged as padding)."""

LEDGER_VERSION = 1
KEY_VERSION = "version"
KEY_EPOCH = "epoch"
KEY_STEP = "step"
KEY_NEXT_FRESH = "next_fresh"
KEY_PENDING = "pending"
KEY_BEHIND = "behind"
_KEYS = frozenset({KEY_VERSION, KEY_EPOCH, KEY_STEP, KEY_NEXT_FRESH, KEY_PENDING,
                   KEY_BEHIND})


@dataclass(frozen=True)
class ReplicaPlan:
    """How a global batch is split across replica groups and their ranks.

    Attributes:
        num_samples: samples in an epoch.
        global_batch: samples per step over all groups (``B``).
        num_groups: replica groups (``G``); each takes ``B / G`` samples a step.
        group_size: ranks in a group (``R``); each takes ``B / (G * R)`` samples a step.
        tail: ``"drop"``: an epoch has ``floor(N / B) * G`` slices, as many steps as the plain
            loader without failures; ``"pad"``: ``ceil(N / S)`` slices, the last one filled
            up with wrapped, padding-flagged positions.

    Raises:
        PlanError: ``B`` is not a multiple of ``G * R``, or an option is impossible.
    """

    num_samples: int
    global_batch: int
    num_groups: int
    group_size: int = 1
    tail: TailPolicy = TailPolicy.DROP

    def __post_init__(self) -> None:
        check_int("num_samples", self.num_samples, minimum=1)
        check_int("global batch", self.global_batch, minimum=1)
        check_int("num_groups", self.num_groups, minimum=1)
        check_int("group_size", self.group_size, minimum=1)
        ranks = self.num_groups * self.group_size
        if self.global_batch % ranks:
            raise PlanError(f"global batch {self.global_batch} is not a multiple of "
                            f"num_groups * group_size = {ranks}: every rank of every group "
                            "must take the same number of samples a step")
        tail = TailPolicy(self.tail)
        if tail is TailPolicy.SPLIT:
            raise PlanError("replica groups need a fixed batch size every step: use tail "
                            "'drop' or 'pad', not 'split'")
        object.__setattr__(self, "tail", tail)

    @property
    def slice_size(self) -> int:
        """Samples a group takes a step (``B / G``)."""
        return self.global_batch // self.num_groups

    @property
    def per_rank(self) -> int:
        """Samples a rank takes a step (``B / (G * R)``)."""
        return self.slice_size // self.group_size

    @property
    def num_slices(self) -> int:
        """Slices in an epoch."""
        if self.tail is TailPolicy.DROP:
            return self.num_samples // self.global_batch * self.num_groups
        return -(-self.num_samples // self.slice_size)

    def virtual_positions(self, slice_index: int, group: int) -> np.ndarray:
        """The positions of a slice as handed to ``group``; a value ``>= num_samples`` is
        padding and reads position ``value % num_samples``."""
        size = self.slice_size
        if slice_index == PAD_SLICE:
            first = self.num_samples + group * size
        else:
            check_int("slice", slice_index, minimum=0, maximum=self.num_slices - 1)
            first = slice_index * size
        return np.arange(first, first + size, dtype=np.int64)

    def rank_positions(self, slice_index: int, group: int,
                       group_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, is_padding) of rank ``group_rank``'s contiguous part of the slice."""
        check_int("group_rank", group_rank, minimum=0, maximum=self.group_size - 1)
        virtual = self.virtual_positions(slice_index, group)
        part = virtual[group_rank * self.per_rank:(group_rank + 1) * self.per_rank]
        return part % self.num_samples, part >= self.num_samples

    def to_dict(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "global_batch": self.global_batch,
                "num_groups": self.num_groups, "tail": self.tail.value}


@dataclass(frozen=True)
class Ledger:
    """Where an epoch stands under replica groups: the same on every live rank.

    Attributes:
        epoch: the current epoch.
        step: steps reported in this epoch (committed or not).
        next_fresh: slices ``[0, next_fresh)`` have been handed out at least once.
        pending: handed out but not committed, sorted; re-issued first at the next step.
        behind: the groups that did not commit the last step although another group did,
            sorted; they are served after the others (so pending slices go to groups that
            just committed). Empty when every group, or no group, committed: the state
            grows with failures only, by one group and at most one pending slice each.

    ``Ledger(epoch)`` is the start of ``epoch``: nothing handed out.

    Thread safety: immutable; every method is pure.
    """

    epoch: int = 0
    step: int = 0
    next_fresh: int = 0
    pending: tuple[int, ...] = ()
    behind: tuple[int, ...] = ()

    def exhausted(self, plan: ReplicaPlan) -> bool:
        """Whether nothing is left of the epoch (only an epoch of no slice starts so:
        :meth:`committed` moves to the next epoch after the last step)."""
        return not self.pending and self.next_fresh >= plan.num_slices

    def assignment(self, plan: ReplicaPlan) -> tuple[int, ...]:
        """The slice each group takes at the current step (``PAD_SLICE``: padding).

        Pending slices come first, then fresh ones in order; groups that committed the last
        step are served before those ``behind``, each set in group order.
        """
        behind = set(self.behind)
        groups = sorted(range(plan.num_groups), key=lambda g: (g in behind, g))
        fresh_stop = min(plan.num_slices, self.next_fresh + plan.num_groups)
        queue = [*self.pending, *range(self.next_fresh, fresh_stop)]
        slices = [PAD_SLICE] * plan.num_groups
        for group, slice_index in zip(groups, queue, strict=False):  # extra groups pad
            slices[group] = slice_index
        return tuple(slices)

    def committed(self, plan: ReplicaPlan, groups: Iterable[int]) -> Ledger:
        """The ledger after the current step, which ``groups`` committed (maybe none).

        After the epoch's last step this is the start of the next epoch.

        Raises:
            PlanError: a group outside ``[0, num_groups)``.
        """
        done = frozenset(check_int("committed group", g, minimum=0,
                                   maximum=plan.num_groups - 1) for g in groups)
        slices = self.assignment(plan)
        handed = {s for s in slices if s != PAD_SLICE}
        failed = {s for g, s in enumerate(slices) if s != PAD_SLICE and g not in done}
        pending = tuple(sorted({s for s in self.pending if s not in handed} | failed))
        next_fresh = max([self.next_fresh, *(s + 1 for s in handed)])
        behind = tuple(g for g in range(plan.num_groups) if g not in done) if done else ()
        if not pending and next_fresh >= plan.num_slices:
            return Ledger(self.epoch + 1, 0, 0, (), behind)
        return Ledger(self.epoch, self.step + 1, next_fresh, pending, behind)

    def check(self, plan: ReplicaPlan) -> Ledger:
        """Raise :class:`CursorMismatchError` unless the ledger can belong to ``plan``."""
        if not 0 <= self.next_fresh <= plan.num_slices:
            raise CursorMismatchError(f"ledger has handed out {self.next_fresh} slices but an "
                                      f"epoch of this plan has {plan.num_slices}")
        if any(not 0 <= s < self.next_fresh for s in self.pending) or \
                list(self.pending) != sorted(set(self.pending)):
            raise CursorMismatchError(f"ledger pending slices {list(self.pending)} are not "
                                      f"distinct, sorted slices below {self.next_fresh}")
        if len(self.pending) > plan.num_groups:
            raise CursorMismatchError(f"{len(self.pending)} pending slices for "
                                      f"{plan.num_groups} groups: at most one per group")
        if any(not 0 <= g < plan.num_groups for g in self.behind) or \
                list(self.behind) != sorted(set(self.behind)) or \
                len(self.behind) >= plan.num_groups:
            raise CursorMismatchError(f"ledger names groups {list(self.behind)} as behind: "
                                      f"expected distinct, sorted groups in "
                                      f"[0, {plan.num_groups}), not all of them")
        return self

    def to_dict(self) -> dict[str, Any]:
        """A small, JSON-able, versioned dict: five integers plus two per failed group at
        most (its group in ``behind``, its slice in ``pending``)."""
        return {KEY_VERSION: LEDGER_VERSION, KEY_EPOCH: self.epoch, KEY_STEP: self.step,
                KEY_NEXT_FRESH: self.next_fresh, KEY_PENDING: list(self.pending),
                KEY_BEHIND: list(self.behind)}

    @classmethod
    def from_dict(cls, data: Any, plan: ReplicaPlan) -> Ledger:
        """Read :meth:`to_dict`'s output back, strictly (CursorMismatchError otherwise)."""
        check_state(data, "replica ledger", _KEYS, LEDGER_VERSION)
        with malformed("replica ledger"):
            epoch, step, next_fresh = (check_int(k, data[k], minimum=0)
                                       for k in (KEY_EPOCH, KEY_STEP, KEY_NEXT_FRESH))
            pending, last = (tuple(check_int(k, v) for v in _list(data[k], k))
                             for k in (KEY_PENDING, KEY_BEHIND))
        return cls(epoch, step, next_fresh, pending, last).check(plan)


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise PlanError(f"{name} must be a list, got {value!r}")
    return value


def replay(plan: ReplicaPlan, history: Iterable[Iterable[int]],
           ledger: Ledger | None = None) -> Ledger:
    """The ledger after a history of committed-group sets (one per step), from ``ledger``
    (default: the start of epoch 0)."""
    ledger = Ledger() if ledger is None else ledger
    for groups in history:
        ledger = ledger.committed(plan, groups)
    return ledger


__all__ = ["LEDGER_VERSION", "PAD_SLICE", "Ledger", "ReplicaPlan", "replay"]
