"""The cursor: where an epoch stands, the same number on every rank, strict on load.

``(epoch, samples_consumed)`` says everything about progress, because the epoch order does
not depend on ranks or workers and steps are consecutive runs of positions. What must match
for a resume to be exact (dataset, sample count, seed, shuffle options) travels with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._util import CursorMismatchError, PlanError, check_int, check_seed, check_state, malformed
from .order import EpochOrder, ShuffleOptions
from .steps import EpochSegment, TailPolicy, tail_policy

CURSOR_VERSION = 1
KEY_VERSION = "version"
KEY_FINGERPRINT = "dataset_fingerprint"
KEY_NUM_SAMPLES = "num_samples"
KEY_SEED = "seed"
KEY_SHUFFLE = "shuffle"
KEY_EPOCH = "epoch"
KEY_SAMPLES_CONSUMED = "samples_consumed"
_KEYS = frozenset({KEY_VERSION, KEY_FINGERPRINT, KEY_NUM_SAMPLES, KEY_SEED, KEY_SHUFFLE,
                   KEY_EPOCH, KEY_SAMPLES_CONSUMED})


@dataclass(frozen=True)
class Cursor:
    """Progress through the epochs of one dataset with one seed and shuffle.

    Attributes:
        dataset_fingerprint: the index's fingerprint; a cursor only resumes its own dataset.
        num_samples: samples in an epoch (a second check on the dataset).
        seed: the order's seed, ``0 <= seed < 2**64``.
        shuffle: the order's shuffle options.
        epoch: the current epoch.
        samples_consumed: positions of the epoch the training loop has received, in
            ``[0, num_samples]``.

    Thread safety: immutable.
    """

    dataset_fingerprint: str
    num_samples: int
    seed: int
    shuffle: ShuffleOptions
    epoch: int = 0
    samples_consumed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dataset_fingerprint, str) or not self.dataset_fingerprint:
            raise PlanError(f"dataset_fingerprint must be a non-empty string, got "
                            f"{self.dataset_fingerprint!r}")
        check_int("num_samples", self.num_samples, minimum=1)
        check_seed(self.seed)
        if not isinstance(self.shuffle, ShuffleOptions):
            raise PlanError(f"shuffle must be a ShuffleOptions, got {self.shuffle!r}")
        check_int("epoch", self.epoch, minimum=0)
        check_int("samples_consumed", self.samples_consumed, minimum=0,
                  maximum=self.num_samples)

    def order(self, shard_rows: Any, **options: Any) -> EpochOrder:
        """The :class:`EpochOrder` of the cursor's epoch for these shard row counts."""
        order = EpochOrder(shard_rows, self.seed, self.epoch, self.shuffle, **options)
        if order.num_samples != self.num_samples:
            raise CursorMismatchError(
                f"the shards hold {order.num_samples} samples but the cursor was saved for "
                f"{self.num_samples}; resume with the dataset the cursor belongs to")
        return order

    def segment(self, global_batch: int, world_size: int,
                tail: TailPolicy | str = TailPolicy.DROP) -> EpochSegment:
        """The rest of the cursor's epoch as steps of ``global_batch`` on ``world_size`` ranks."""
        return EpochSegment(self.num_samples, self.samples_consumed, global_batch, world_size,
                            tail_policy(tail))

    def advanced(self, segment: EpochSegment, steps_done: int) -> Cursor:
        """The cursor once ``steps_done`` steps of ``segment`` (begun at this cursor) are
        consumed; after the segment's last step, the start of the next epoch."""
        if segment.start != self.samples_consumed or segment.num_samples != self.num_samples:
            raise PlanError("the segment was not begun at this cursor")
        if steps_done == segment.num_steps:
            return self._replace(epoch=self.epoch + 1, samples_consumed=0)
        return self._replace(samples_consumed=segment.samples_consumed_after(steps_done))

    def to_dict(self) -> dict[str, Any]:
        """A small, JSON-able, versioned dict (the loader's state)."""
        return {
            KEY_VERSION: CURSOR_VERSION,
            KEY_FINGERPRINT: self.dataset_fingerprint,
            KEY_NUM_SAMPLES: self.num_samples,
            KEY_SEED: self.seed,
            KEY_SHUFFLE: self.shuffle.to_dict(),
            KEY_EPOCH: self.epoch,
            KEY_SAMPLES_CONSUMED: self.samples_consumed,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Cursor:
        """Read :meth:`to_dict`'s output back; anything else raises CursorMismatchError."""
        check_state(data, "cursor", _KEYS, CURSOR_VERSION)
        with malformed("cursor"):
            return cls(
                dataset_fingerprint=data[KEY_FINGERPRINT],
                num_samples=data[KEY_NUM_SAMPLES],
                seed=data[KEY_SEED],
                shuffle=ShuffleOptions.from_dict(data[KEY_SHUFFLE]),
                epoch=data[KEY_EPOCH],
                samples_consumed=data[KEY_SAMPLES_CONSUMED],
            )

    def check_matches(self, *, dataset_fingerprint: str, num_samples: int, seed: int,
                      shuffle: ShuffleOptions) -> None:
        """Raise CursorMismatchError unless the cursor belongs to this dataset and order."""
        mismatches = [
            (name, saved, current) for name, saved, current in (
                ("dataset fingerprint", self.dataset_fingerprint, dataset_fingerprint),
                ("number of samples", self.num_samples, num_samples),
                ("seed", self.seed, seed),
                ("shuffle options", self.shuffle, shuffle),
            ) if saved != current
        ]
        if mismatches:
            details = "; ".join(f"{name}: saved {saved!r}, now {current!r}"
                                for name, saved, current in mismatches)
            raise CursorMismatchError(
                f"the saved cursor does not belong to this dataset and order ({details}); "
                "resume with the same dataset, seed and shuffle options, or start fresh "
                "without loading the loader state")

    @classmethod
    def load(cls, data: Any, *, dataset_fingerprint: str, num_samples: int, seed: int,
             shuffle: ShuffleOptions) -> Cursor:
        """:meth:`from_dict` then :meth:`check_matches`: the strict way to resume."""
        cursor = cls.from_dict(data)
        cursor.check_matches(dataset_fingerprint=dataset_fingerprint,
                             num_samples=num_samples, seed=seed, shuffle=shuffle)
        return cursor

    def _replace(self, **changes: Any) -> Cursor:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        fields.update(changes)
        return Cursor(**fields)
