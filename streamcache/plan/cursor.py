"""The cursor: where an epoch stands, the same number on every rank, strict on load.

``(epoch, samples_consumed)`` says everything about progress, because the epoch order does
not depend on ranks or workers and steps are consecutive runs of positions. What must match
for a resume to be exact (the data, sample count, seed, shuffle options) travels with it.

The data is named by the index's fingerprint (schema, shard names, rows, sizes and
checksums). Where the index records a checksum of every shard, that fixes the content, and a
state resumes on any copy of the data. Without checksums it fixes only the shape, and two
datasets alike in shape share it: such a state is also bound to a :class:`DataIdentity` (where
the data lives and which index describes it), unless the dataset is made with
``resume_check="fingerprint"`` (docs/trust.md, "Loader states").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, get_args

from ._util import CursorMismatchError, PlanError, check_int, check_seed, check_state, malformed
from .order import EpochOrder
from .shuffle import ShuffleOptions
from .steps import EpochSegment, TailPolicy, tail_policy

CURSOR_VERSION = 2
KEY_VERSION = "version"
KEY_FINGERPRINT = "dataset_fingerprint"
KEY_NUM_SAMPLES = "num_samples"
KEY_SEED = "seed"
KEY_SHUFFLE = "shuffle"
KEY_EPOCH = "epoch"
KEY_SAMPLES_CONSUMED = "samples_consumed"
KEY_DATA = "data"  # version 2: the DataIdentity, or None where the fingerprint fixes the content
KEY_LOCATION = "location"
KEY_INDEX_CREATED = "index_created"
_KEYS_V1 = frozenset({KEY_VERSION, KEY_FINGERPRINT, KEY_NUM_SAMPLES, KEY_SEED, KEY_SHUFFLE,
                      KEY_EPOCH, KEY_SAMPLES_CONSUMED})
_KEYS = {1: _KEYS_V1, CURSOR_VERSION: _KEYS_V1 | {KEY_DATA}}
_DATA_KEYS = frozenset({KEY_LOCATION, KEY_INDEX_CREATED})
MAX_LOCATION = 4096  # characters of a saved location (a URL; a longer one is no state of ours)
#: Epochs in a cursor (and a saved state) stay below this, as positions and counts do: the
#: order's keys fold the epoch into 64 bits (a larger one would repeat a smaller one's order),
#: and the next epoch's number never leaves int64 (docs/trust.md, "Loader states").
EPOCH_LIMIT = 1 << 62

#: How a saved state is matched with the data on load: ``"identity"`` (the default) the
#: fingerprint and, for an index without checksums, the :class:`DataIdentity`; ``"fingerprint"``
#: the fingerprint alone (the same files copied elsewhere or indexed again, on your word).
ResumeCheck = Literal["identity", "fingerprint"]
RESUME_CHECKS: tuple[ResumeCheck, ...] = get_args(ResumeCheck)


def check_versioned_state(data: Any, what: str, keys: dict[int, frozenset[str]],
                          current: int) -> tuple[dict[str, Any], int]:
    """:func:`check_state` for a state of one of several versions (``keys`` by version).

    Returns:
        ``(data, its version)``.

    Raises:
        CursorMismatchError: not a dict, an unknown version, or other keys than the version's.
    """
    version = data.get(KEY_VERSION) if isinstance(data, dict) else None
    chosen = version if isinstance(version, int) and not isinstance(version, bool) and \
        version in keys else current
    return check_state(data, what, keys[chosen], chosen), chosen


@dataclass(frozen=True)
class DataIdentity:
    """Which data a state of an index without checksums belongs to (its fingerprint fixes
    only the shape: schema, shard names, rows, sizes).

    Attributes:
        location: the index's canonical folder (``file://`` plus the real path, or the URL
            with the storage endpoint); "" for an index that was never stored.
        index_created: the ``created`` time recorded in the index (indexing the files again
            writes a new one).
    """

    location: str
    index_created: float

    def __post_init__(self) -> None:
        if not isinstance(self.location, str) or len(self.location) > MAX_LOCATION:
            raise PlanError(f"location must be a string of at most {MAX_LOCATION} "
                            f"characters, got {self.location!r:.200}")
        created = self.index_created
        if isinstance(created, bool) or not isinstance(created, (int, float)) or \
                not math.isfinite(created):
            raise PlanError(f"index_created must be a finite number, got {created!r}")

    def to_dict(self) -> dict[str, Any]:
        return {KEY_LOCATION: self.location, KEY_INDEX_CREATED: self.index_created}

    @classmethod
    def from_dict(cls, value: Any) -> DataIdentity | None:
        """``None`` or :meth:`to_dict`'s output (PlanError for anything else)."""
        if value is None:
            return None
        if not isinstance(value, dict) or set(value) != _DATA_KEYS:
            raise PlanError(f"data must be null or a dict with keys {sorted(_DATA_KEYS)}, got "
                            f"{value!r}")
        return cls(value[KEY_LOCATION], value[KEY_INDEX_CREATED])

    def differences(self, current: DataIdentity) -> list[str]:
        """What differs from ``current``, for a message."""
        return [f"{name}: saved {saved!r}, now {now!r}"
                for name, saved, now in (("location", self.location, current.location),
                                         ("index created", self.index_created,
                                          current.index_created)) if saved != now]


def identity_problems(saved: DataIdentity | None, saved_version: int,
                      current: DataIdentity | None, check: ResumeCheck) -> list[str]:
    """Why a state saved for ``saved`` (in a state of ``saved_version``) does not belong to
    the data of ``current``; nothing where the fingerprint fixes the content (``current``
    None) or ``check`` is ``"fingerprint"``."""
    if current is None or check == "fingerprint":
        return []
    if saved_version < 2:
        return ["the state was saved by an older streamcache, which did not record where the "
                "data lives, and this index has no checksums, so its fingerprint (shape only) "
                "cannot tell these files from others"]
    if saved is None:
        return ["the state was saved for data with checksums, this index has none"]
    return saved.differences(current)


#: What a CursorMismatchError about the data's identity tells the user to do.
IDENTITY_HINT = ("if these are the same files (copied to another folder or bucket, or indexed "
                 "again), pass resume_check=\"fingerprint\" to StreamDataset; data indexed "
                 "with checksums (`streamcache index --checksum`) resumes on any copy")


@dataclass(frozen=True)
class Cursor:
    """Progress through the epochs of one dataset with one seed and shuffle.

    Attributes:
        dataset_fingerprint: the index's fingerprint; a cursor only resumes its own dataset.
        num_samples: samples in an epoch (a second check on the dataset).
        data: where the data lives and which index describes it, for an index without
            checksums (None: the fingerprint fixes the content).
        saved_version: the state version it was read from (1: no ``data`` recorded).
        seed: the order's seed, ``0 <= seed < 2**64``.
        shuffle: the order's shuffle options.
        epoch: the current epoch, in ``[0, EPOCH_LIMIT)``.
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
    data: DataIdentity | None = None
    saved_version: int = dataclasses.field(default=CURSOR_VERSION, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.dataset_fingerprint, str) or not self.dataset_fingerprint:
            raise PlanError(f"dataset_fingerprint must be a non-empty string, got "
                            f"{self.dataset_fingerprint!r}")
        check_int("num_samples", self.num_samples, minimum=1)
        check_seed(self.seed)
        if not isinstance(self.shuffle, ShuffleOptions):
            raise PlanError(f"shuffle must be a ShuffleOptions, got {self.shuffle!r}")
        check_int("epoch", self.epoch, minimum=0, maximum=EPOCH_LIMIT - 1)
        check_int("samples_consumed", self.samples_consumed, minimum=0,
                  maximum=self.num_samples)
        if self.data is not None and not isinstance(self.data, DataIdentity):
            raise PlanError(f"data must be a DataIdentity or None, got {self.data!r}")

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
        return moved_within_epoch(self, segment.samples_consumed_after(steps_done))

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
            KEY_DATA: None if self.data is None else self.data.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Cursor:
        """Read :meth:`to_dict`'s output (or a version 1 state) back; anything else raises
        CursorMismatchError."""
        _, version = check_versioned_state(data, "cursor", _KEYS, CURSOR_VERSION)
        with malformed("cursor"):
            return cls(
                dataset_fingerprint=data[KEY_FINGERPRINT],
                num_samples=data[KEY_NUM_SAMPLES],
                seed=data[KEY_SEED],
                shuffle=ShuffleOptions.from_dict(data[KEY_SHUFFLE]),
                epoch=data[KEY_EPOCH],
                samples_consumed=data[KEY_SAMPLES_CONSUMED],
                data=DataIdentity.from_dict(data.get(KEY_DATA)),
                saved_version=version,
            )

    def check_matches(self, *, dataset_fingerprint: str, num_samples: int, seed: int,
                      shuffle: ShuffleOptions, data: DataIdentity | None = None,
                      check: ResumeCheck = "identity") -> None:
        """Raise CursorMismatchError unless the cursor belongs to this dataset and order:
        the same fingerprint, sample count, seed and shuffle options, and, for ``data``
        without checksums (a :class:`DataIdentity`), the same data (``check``: see
        :data:`ResumeCheck`)."""
        mismatches = [
            f"{name}: saved {saved!r}, now {current!r}" for name, saved, current in (
                ("dataset fingerprint", self.dataset_fingerprint, dataset_fingerprint),
                ("number of samples", self.num_samples, num_samples),
                ("seed", self.seed, seed),
                ("shuffle options", self.shuffle, shuffle),
            ) if saved != current
        ]
        if mismatches:
            raise CursorMismatchError(
                f"the saved cursor does not belong to this dataset and order "
                f"({'; '.join(mismatches)}); resume with the same dataset, seed and shuffle "
                "options, or start fresh without loading the loader state")
        problems = identity_problems(self.data, self.saved_version, data, check)
        if problems:
            raise CursorMismatchError(
                f"the saved cursor may belong to other data of the same shape "
                f"({'; '.join(problems)}); {IDENTITY_HINT}")

    @classmethod
    def load(cls, data: Any, *, dataset_fingerprint: str, num_samples: int, seed: int,
             shuffle: ShuffleOptions, identity: DataIdentity | None = None,
             check: ResumeCheck = "identity") -> Cursor:
        """:meth:`from_dict` then :meth:`check_matches` (``identity`` is its ``data``): the
        strict way to resume. The cursor returned is bound to ``identity`` (it is saved with
        it from now on)."""
        cursor = cls.from_dict(data)
        cursor.check_matches(dataset_fingerprint=dataset_fingerprint, num_samples=num_samples,
                             seed=seed, shuffle=shuffle, data=identity, check=check)
        return cursor._replace(data=identity, saved_version=CURSOR_VERSION)

    def _replace(self, **changes: Any) -> Cursor:  # (checked as any new cursor is)
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        fields.update(changes)
        return Cursor(**fields)


class _Positioned(Protocol):
    @property
    def num_samples(self) -> int: ...
    @property
    def samples_consumed(self) -> int: ...


_C = TypeVar("_C", bound=_Positioned)  # Cursor or MixtureCursor (frozen dataclasses)


def moved_within_epoch(cursor: _C, samples_consumed: int) -> _C:
    """``cursor`` at another position of its epoch. The loader moves its cursor once per step,
    and building it anew re-checked every field (15 us a step on the loop's thread, a tenth of
    a warm step of 1 KB samples); only the position changes, so only it is checked."""
    if not 0 <= samples_consumed <= cursor.num_samples:
        raise PlanError(f"samples_consumed must be in [0, {cursor.num_samples}], got "
                        f"{samples_consumed}")
    moved = object.__new__(type(cursor))
    moved.__dict__.update(cursor.__dict__)
    moved.__dict__["samples_consumed"] = samples_consumed
    return moved
