"""Source: one dataset of a weighted mixture (``StreamDataset([Source(...), ...])``), and
what binds a loader state to a dataset's data (:func:`data_identity`)."""

from __future__ import annotations

import math
import numbers
import os
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..cache.identity import canonical_location
from ..errors import ConfigError
from ..format.index import DatasetIndex
from ..plan.cursor import DataIdentity
from ..plan.mixture_cursor import POSITION_LIMIT
from .batching import SOURCE_KEY

#: The largest ``weight`` or ``repeat`` a Source takes. Weights are relative, so no mixture
#: needs more; under it the weights of up to 10**8 sources add up to a finite float (two
#: weights of 1e308 overflowed that sum), and every repeat above 2**62 is refused anyway.
LARGEST_FACTOR = 1e300


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture and how much of it to read.

    Args:
        url: dataset folder or index.json (any fsspec URL), or a loaded :class:`DatasetIndex`.
        weight: the source's share of every global batch, relative to the other sources'
            (> 0 and at most :data:`LARGEST_FACTOR`; normalized over the sources).
            0.7/0.2/0.1 or 7/2/1 mean the same.
        repeat: the source's epoch is ``repeat`` times its sample count (rounded; > 0 and at
            most :data:`LARGEST_FACTOR`):
            2.0 upsamples (every sample twice per source epoch, in two passes), 0.5 caps
            (a fresh half of its samples each epoch). Default 1.
        samples: the source's epoch size in samples (>= 1), instead of ``repeat``.
        fields: the fields to read from this source (default: the dataset's ``fields``, else
            all); every source must yield the same field names and kinds.
        transform: per-sample callable for this source's samples (default: the dataset's).
        storage_options: fsspec options of this source's filesystem (default: the dataset's).

    Raises:
        ConfigError: a value out of range, or both ``repeat`` and ``samples``.
    """

    url: str | DatasetIndex
    weight: float = 1.0
    repeat: float | None = None
    samples: int | None = None
    fields: Sequence[str] | None = None
    transform: Callable[[dict[str, Any]], Any] | None = None
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.url, os.PathLike):  # a local folder as a pathlib.Path
            object.__setattr__(self, "url", os.fspath(self.url))
        if not isinstance(self.url, (str, DatasetIndex)):
            raise ConfigError(f"Source url must be a URL string or a DatasetIndex, got "
                              f"{type(self.url).__name__}")
        if not _in_range(self.weight):
            raise ConfigError(f"Source weight must be a finite number in (0, "
                              f"{LARGEST_FACTOR:g}], got {reprlib.repr(self.weight)} (weights "
                              "are relative: scale them all down alike)")
        if self.repeat is not None and self.samples is not None:
            raise ConfigError("give a Source repeat= or samples=, not both")
        if self.repeat is not None and not _in_range(self.repeat):
            raise ConfigError(f"Source repeat must be a finite number in (0, "
                              f"{LARGEST_FACTOR:g}], got {reprlib.repr(self.repeat)}")
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(
                self.samples, numbers.Integral) or self.samples < 1):
            raise ConfigError(f"Source samples must be an integer >= 1, got {self.samples!r}")
        if self.transform is not None and not callable(self.transform):
            raise ConfigError(f"Source transform must be callable, got "
                              f"{type(self.transform).__name__}")
        if isinstance(self.fields, str):
            raise ConfigError(f"Source fields must be a sequence of field names, not the "
                              f"string {self.fields!r}")
        if self.fields is not None:
            object.__setattr__(self, "fields", tuple(self.fields))

    def epoch_samples(self, num_samples: int) -> int:
        """The source's epoch size, given its sample count.

        Raises:
            ConfigError: ``repeat`` or ``samples`` asks for an epoch longer than a mixture
                counts (:data:`~streamcache.plan.mixture_cursor.POSITION_LIMIT` samples).
        """
        if self.samples is not None:
            size: float = int(self.samples)
        elif self.repeat is None:
            size = num_samples
        else:  # (a float, inf where the product passes one: refused below, never rounded)
            size = num_samples * float(self.repeat)
        if size >= POSITION_LIMIT:
            asked = f"samples={reprlib.repr(self.samples)}" if self.samples is not None else \
                f"repeat={self.repeat!r} of its {num_samples:,} samples"
            raise ConfigError(
                f"Source {self.url if isinstance(self.url, str) else 'DatasetIndex'}: {asked} "
                f"asks for an epoch of {_rough(size)} samples, more than a mixture counts "
                f"(below {POSITION_LIMIT:.3g}); for a source that never ends, use infinite=True "
                "with its natural epoch")
        return max(1, round(size))


def data_identity(index: DatasetIndex, storage_options: Mapping[str, Any] | None,
                  ) -> DataIdentity | None:
    """What a loader state of ``index``'s data is bound to besides the fingerprint: nothing
    where every shard has a checksum (the fingerprint then fixes the content, and a state
    resumes on any copy), else where the data lives and the index's ``created`` time."""
    if index.shard_table.all_checksummed:
        return None
    location = canonical_location(index.root, storage_options) if index.url else ""
    return DataIdentity(location, index.created)


def _rough(count: float) -> str:
    """``count`` to three digits, for a message (an int beyond any float too)."""
    try:
        as_float = float(count)
    except OverflowError:
        as_float = math.inf
    return f"{as_float:.3g}" if math.isfinite(as_float) else "over 1e308"


def _in_range(value: Any) -> bool:
    """Whether ``value`` is a real number (no bool) in ``(0, LARGEST_FACTOR]``; one too large
    for a float (an int or a Fraction of hundreds of digits) is not."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Fraction)):
        return False
    try:
        as_float = float(value)
    except OverflowError:
        return False
    return math.isfinite(as_float) and 0 < as_float <= LARGEST_FACTOR


class SourceTransforms:
    """The per-sample transform of a mixture: each sample's source's own, else the dataset's;
    a sample of a source with neither passes unchanged (the batch gets ``__source__`` back
    from :func:`~streamcache.loading.batching.apply_sample_transform`, as ``__id__``).
    Picklable (for worker processes) when the transforms are."""

    def __init__(self, transforms: Sequence[Callable[[dict[str, Any]], Any] | None],
                 default: Callable[[dict[str, Any]], Any] | None) -> None:
        self.transforms = [t or default for t in transforms]

    def __call__(self, sample: dict[str, Any]) -> Any:
        transform = self.transforms[int(sample[SOURCE_KEY])]
        return sample if transform is None else transform(sample)

__all__ = ["SOURCE_KEY", "Source", "SourceTransforms", "data_identity"]
