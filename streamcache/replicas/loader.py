"""ReplicaLoader: this rank's part of its replica group's slice, step by step, exactly once.

The training loop drives it one step at a time, because the next step's slices depend on
who committed this one::

    loader = ReplicaLoader(dataset, num_groups=4, group=replica_group_id)
    while True:
        batch = loader.next_batch()          # None once the epoch is over
        if batch is None:
            break
        ...forward, backward, gradient all-reduce across the live groups...
        loader.commit(committed_groups)     # the quorum's verdict for this step

A rejoining group calls ``load_state_dict(peer_state)`` with the state of a live peer (sent
through the process group or the fault-tolerance library's state transfer) and continues at
the current step: no checkpoint is read and the epoch is not restarted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..loading.batching import PADDING_KEY
from ..loading.dataset import StepRef, StreamDataset
from ..plan import Cursor, CursorMismatchError, EpochSegment, PlanError, RankBatch, TailPolicy
from ..plan._util import check_int, check_state
from ..plan.cursor import CURSOR_VERSION, KEY_DATA
from .ledger import PAD_SLICE, Ledger, ReplicaPlan

STATE_VERSION = 1
KEY_VERSION = "version"
KEY_DATASET = "dataset"
KEY_PLAN = "plan"
KEY_LEDGER = "ledger"
_KEYS = frozenset({KEY_VERSION, KEY_DATASET, KEY_PLAN, KEY_LEDGER})
_CURSOR_ONLY = ("version", "epoch", "samples_consumed")  # cursor keys the ledger replaces


class ReplicaError(PlanError):
    """The replica loader was driven out of order (a step read but never reported, or
    reported twice)."""


class ReplicaLoader:
    """Batches of a :class:`StreamDataset` for one rank of one replica group.

    Args:
        dataset: the dataset (its order, reader, transform and per-rank batch are used; its
            tail must be ``"drop"`` or ``"pad"``).
        num_groups: replica groups ``G`` (the most that can ever be live at once).
        group: this process's replica group, in ``[0, G)``.
        group_rank, group_size: this rank within its group and the group's size ``R``
            (default: the dataset's rank and world size, which is right when every group has
            its own default process group, as with torchft; pass both when one
            torch.distributed world holds every group).
        global_batch: samples per step over all groups (default: the dataset's per-rank
            batch times ``G * R``); each rank reads ``global_batch / (G * R)`` a step.
        prefetch: read the next step's batch on a background thread while the loop works,
            on the guess that the groups that committed this step commit the next one too
            (the next slice depends on who commits; a wrong guess is read again).

    Every batch has ``__id__`` (sample ids) and ``__padding__`` (True for samples that only
    pad a step at the end of an epoch: mask them out of the loss).

    Thread safety: one training loop drives a loader (the prefetch thread only reads).
    """

    # The state is global (JSON-able, the same on every live rank): saved once.
    global_state = True

    def __init__(self, dataset: StreamDataset, *, num_groups: int, group: int,
                 group_rank: int | None = None, group_size: int | None = None,
                 global_batch: int | None = None, prefetch: bool = True) -> None:
        if not isinstance(dataset, StreamDataset):
            raise TypeError("ReplicaLoader takes a StreamDataset")
        if getattr(dataset, "index", None) is None:
            raise ConfigError("ReplicaLoader reads a StreamDataset of one dataset; a mixture "
                              "of Sources is not supported by replica groups: use StreamLoader "
                              "for a mixture, or one dataset with ReplicaLoader")
        group_size = dataset.world_size if group_size is None else group_size
        group_rank = dataset.rank if group_rank is None else group_rank
        per_rank = dataset.global_batch // dataset.world_size
        if global_batch is None:
            global_batch = per_rank * num_groups * group_size
        self.dataset = dataset
        self.plan = ReplicaPlan(dataset.index.num_samples, global_batch, num_groups,
                                group_size, dataset.tail)
        self.group = check_int("group", group, minimum=0, maximum=num_groups - 1)
        self.group_rank = check_int("group_rank", group_rank, minimum=0,
                                    maximum=group_size - 1)
        cursor = dataset.cursor
        if cursor.samples_consumed:
            raise PlanError(f"the dataset's cursor is {cursor.samples_consumed} samples into "
                            f"epoch {cursor.epoch}: a ReplicaLoader starts at an epoch "
                            "boundary, or from a ReplicaLoader state (load_state_dict)")
        self._ledger = Ledger(cursor.epoch)
        self._read_at: Ledger | None = None  # the ledger whose step has been handed out
        # One step read ahead, on a guess of the next step's slice (see _prefetch_next).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="streamcache-replica") \
            if prefetch else None
        self._ahead: tuple[tuple[int, int], Future[Any]] | None = None
        self.prefetch_hits = 0

    # ------------------------------------------------------------ stepping

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def epoch(self) -> int:
        return self._ledger.epoch

    def assignment(self) -> tuple[int, ...]:
        """The slice every group takes at the current step (``PAD_SLICE``: padding)."""
        return self._ledger.assignment(self.plan)

    def current_slice(self) -> int:
        """The slice this group takes at the current step."""
        return self.assignment()[self.group]

    def epoch_done(self) -> bool:
        """Whether the epoch has no step left (only an epoch of no slice at its start)."""
        return self._ledger.exhausted(self.plan)

    def rank_batch(self) -> RankBatch:
        """The plan of this rank's part of the current step (no I/O)."""
        return self._part(self._ledger)

    def _part(self, ledger: Ledger) -> RankBatch:
        slice_index = ledger.assignment(self.plan)[self.group]
        positions, padding = self.plan.rank_positions(slice_index, self.group, self.group_rank)
        ids, shards, rows = self.dataset.order(ledger.epoch).samples_at(positions)
        return RankBatch(ledger.step, positions, ids, shards, rows, padding)

    def next_batch(self) -> Any:
        """This rank's batch of the current step (the same batch again until ``commit``),
        or None when the epoch has no step at all (an epoch of fewer samples than a global
        batch with tail "drop"; the loader then moves on to the next epoch)."""
        if self.epoch_done():
            self._ledger = Ledger(self._ledger.epoch + 1)
            self.dataset.set_epoch(self._ledger.epoch)
            return None
        key = (self.epoch, self.current_slice())
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == key:
            arrays = ahead[1].result()
            self.prefetch_hits += 1
        else:
            if ahead is not None:
                ahead[1].cancel()
            arrays = self._read(self._ledger)
        self._read_at = self._ledger
        self._prefetch_next()
        return self.dataset.finish_step(self._step_ref(key[1]), arrays)

    def _read(self, ledger: Ledger) -> dict[str, Any]:
        """This rank's raw arrays at ``ledger``'s step (any thread: reads only)."""
        part = self._part(ledger)
        ref = StepRef(ledger.epoch, self._step_ref(0).segment, 0, ledger.step)  # epoch only
        arrays = self.dataset.read_step(ref, part)
        arrays[PADDING_KEY] = part.is_padding
        return arrays

    def _prefetch_next(self) -> None:
        """Start reading the slice this group gets next if the groups that committed the
        last step commit this one too (the common case); a wrong guess is dropped."""
        if self._pool is None:
            return
        everyone = range(self.plan.num_groups)
        guess = self._ledger.committed(self.plan, [g for g in everyone
                                                   if g not in self._ledger.behind])
        if guess.exhausted(self.plan):
            return
        key = (guess.epoch, guess.assignment(self.plan)[self.group])
        self._ahead = (key, self._pool.submit(self._read, guess))

    def _step_ref(self, slice_index: int) -> StepRef:
        # Transforms are seeded from the first position of the "step": a one-group segment of
        # slice-sized steps makes that the slice's first position, so a re-issued slice is
        # transformed the same way whichever group reads it, whenever.
        slices = EpochSegment(self.plan.num_samples, 0, self.plan.slice_size, 1, TailPolicy.PAD)
        step = 0 if slice_index == PAD_SLICE else slice_index
        return StepRef(self.epoch, slices, step, self._ledger.step)

    def commit(self, groups: Iterable[int]) -> bool:
        """Report the groups that committed the current step (empty: the step was discarded).

        Every live rank must report the same set; a group that was down reports nothing and
        copies a peer's state when it rejoins. Returns True when this step ended the epoch.

        Raises:
            ReplicaError: the current step's batch was not read by :meth:`next_batch` (a
                step must be read before it is reported: call ``skip()`` to report a step
                this rank did not take part in).
        """
        if self._read_at != self._ledger:
            raise ReplicaError("commit() without next_batch() for this step: read the step "
                               "first, or report steps this rank missed with skip()")
        return self._advance(groups)

    def skip(self, groups: Iterable[int]) -> bool:
        """Advance past the current step without reading it (a rank that stayed up but sat
        the step out, or a replay); the same ledger move as :meth:`commit`."""
        return self._advance(groups)

    def _advance(self, groups: Iterable[int]) -> bool:
        epoch = self._ledger.epoch
        self._ledger = self._ledger.committed(self.plan, groups)
        self._read_at = None
        self.dataset.set_epoch(self._ledger.epoch)
        return self._ledger.epoch != epoch

    def batches(self, committed: Callable[[], Iterable[int]]) -> Iterator[Any]:
        """The rest of the epoch as an iterator: ``committed()`` is called when the loop asks
        for the next batch (the previous one has been used) and returns the groups that
        committed that step."""
        while (batch := self.next_batch()) is not None:
            yield batch
            if self.commit(committed()):
                return

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "dataset", "plan", "ledger"}``: small, JSON-able, the same on every
        live rank. What a rejoining group copies from a peer."""
        cursor = self.dataset.cursor.to_dict()
        dataset = {k: v for k, v in cursor.items() if k not in _CURSOR_ONLY}
        return {KEY_VERSION: STATE_VERSION, KEY_DATASET: dataset,
                KEY_PLAN: self.plan.to_dict(), KEY_LEDGER: self._ledger.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a peer's, or a checkpoint's) at its current step.

        The group size may differ from the saver's; the number of groups, the global batch,
        the tail, the dataset, seed and shuffle must not.

        Raises:
            CursorMismatchError: another version, dataset, order or plan, or malformed.
        """
        check_state(state, "replica loader state", _KEYS, STATE_VERSION,
                    hint="; it was not written by a ReplicaLoader")
        mine = self.plan.to_dict()
        if state[KEY_PLAN] != mine:
            raise CursorMismatchError(f"the state was saved for the replica plan "
                                      f"{state[KEY_PLAN]}, this loader has {mine}: use the "
                                      "same number of groups, global batch and tail")
        ledger = Ledger.from_dict(state[KEY_LEDGER], self.plan)
        dataset = state[KEY_DATASET]
        if not isinstance(dataset, dict):
            raise CursorMismatchError(f"malformed replica loader state: dataset {dataset!r}")
        current = self.dataset.cursor
        # a state written before cursor version 2 has no "data" (the data's identity)
        version = CURSOR_VERSION if KEY_DATA in dataset else 1
        Cursor.load({**dataset, "version": version, "epoch": ledger.epoch,
                     "samples_consumed": 0},
                    dataset_fingerprint=current.dataset_fingerprint,
                    num_samples=current.num_samples, seed=current.seed,
                    shuffle=current.shuffle, identity=current.data,
                    check=self.dataset.options.resume_check)
        self._ledger = ledger
        self._read_at = None
        self.dataset.set_epoch(ledger.epoch)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.dataset.close()

    def __enter__(self) -> ReplicaLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def positions_of(plan: ReplicaPlan, ledger: Ledger, group: int) -> np.ndarray:
    """Every position group ``group`` reads at the ledger's step, over its ranks (for tests
    and tools)."""
    return np.concatenate([plan.rank_positions(ledger.assignment(plan)[group], group, r)[0]
                           for r in range(plan.group_size)])


__all__ = ["STATE_VERSION", "ReplicaError", "ReplicaLoader", "positions_of"]
