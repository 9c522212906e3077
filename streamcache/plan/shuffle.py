"""How an epoch is shuffled: the options an order is made with (part of every cursor)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ._util import PlanError, check_int

DEFAULT_WINDOW = 1 << 18
WINDOW_UNITS = ("samples", "shards")
#: At most this many canonical partitions (a node count must divide it: 4,096 = 2**12 covers
#: every power of two a job runs, and 3 * 2**k up to 3,072).
MAX_PARTITIONS = 1 << 12


@dataclass(frozen=True)
class ShuffleOptions:
    """How an epoch is shuffled. Part of a cursor: a resume with other options is refused.

    Attributes:
        enabled: ``False`` gives index order (shard 0's rows, then shard 1's, ...).
        window: shuffle window size, in ``window_unit`` units. Samples are permuted inside a
            window of the shard-permuted stream; larger windows mix better but need more
            shards cached at once. A window at least as large as the dataset is a full shuffle.
        window_unit: ``"samples"`` (windows of exactly ``window`` samples, cutting through
            shards) or ``"shards"`` (windows of ``window`` whole shards).
        stagger: add a second shuffle inside windows offset by half a window, so that samples
            near a window boundary mix with both neighbours (no seam).
        partitions: 0 (the default): one order over the whole dataset, the same for any node
            count. ``P > 0``: *canonical partitions* (:mod:`streamcache.plan.partitions`): the
            dataset is cut into ``P`` contiguous runs of samples of equal size, each shuffled
            on its own (windows of ``window // P`` samples), and the epoch takes one sample
            of each partition in turn, so any ``P`` consecutive positions from a multiple of
            ``P`` hold one sample of every partition. On ``N`` nodes with ``N`` dividing
            ``P`` and global batches that are multiples of ``P``, every node then reads
            only its own partitions (docs/multinode.md, "Canonical partitions").
    """

    enabled: bool = True
    window: int = DEFAULT_WINDOW
    window_unit: str = "samples"
    stagger: bool = True
    partitions: int = 0

    def __post_init__(self) -> None:
        for name in ("enabled", "stagger"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"ShuffleOptions.{name} must be a bool, got "
                                f"{getattr(self, name)!r}")
        check_int("ShuffleOptions.window", self.window, minimum=1)
        check_int("ShuffleOptions.partitions", self.partitions, minimum=0,
                  maximum=MAX_PARTITIONS)
        if self.window_unit not in WINDOW_UNITS:
            raise PlanError(f"ShuffleOptions.window_unit must be one of {WINDOW_UNITS}, got "
                            f"{self.window_unit!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_dict` reads it back. ``partitions`` is written only
        when set, so a state without partitions reads the same as before they existed."""
        data = asdict(self)
        if not self.partitions:
            del data["partitions"]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> ShuffleOptions:
        """Strict inverse of :meth:`to_dict`: unknown or missing keys raise :class:`PlanError`
        (``partitions`` may be absent: 0)."""
        expected = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or not (set(data) == expected or
                                              set(data) == expected - {"partitions"}):
            raise PlanError(f"shuffle options must be a dict with keys {sorted(expected)}, "
                            f"got {data!r}")
        if data.get("partitions", 1) == 0:  # (written only when set)
            raise PlanError(f"shuffle options {data!r}: partitions is written only when it is "
                            "above 0")
        return cls(**data)


NO_SHUFFLE = ShuffleOptions(enabled=False)
#: The default options (shuffled, 2**18-sample staggered windows); frozen, so shared.
DEFAULT_SHUFFLE = ShuffleOptions()


__all__ = ["DEFAULT_SHUFFLE", "DEFAULT_WINDOW", "MAX_PARTITIONS", "NO_SHUFFLE", "WINDOW_UNITS",
           "ShuffleOptions"]
