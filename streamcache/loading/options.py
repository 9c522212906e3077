"""StreamOptions: everything that configures a :class:`~streamcache.StreamDataset`, and its
checks (a :class:`~streamcache.errors.ConfigError` that names the option when a value is wrong).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, get_args

from ..cache.prefetch import PrefetchOptions
from ..errors import ConfigError
from ..plan import TailPolicy
from ..plan.cursor import RESUME_CHECKS, ResumeCheck
from ..plan.shuffle import DEFAULT_WINDOW, MAX_PARTITIONS
from ..remote.options import FetchOptions
from .batching import RAGGED_MODES

TailMode = Literal["drop", "pad", "split"]
RaggedMode = Literal["padded", "offsets"]
WindowUnit = Literal["samples", "shards"]
#: How local uncompressed shards are read: where they lie (a local disk) or copied into the
#: node cache first (a slow shared mount: NFS, Lustre, a mounted bucket).
LocalData = Literal["in_place", "copy"]
TAIL_MODES: tuple[TailMode, ...] = get_args(TailMode)
WINDOW_UNITS: tuple[WindowUnit, ...] = get_args(WindowUnit)


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """Everything that configures a :class:`~streamcache.StreamDataset`, checked when it is
    made (the fields are the dataset's keyword arguments; see its docstring).

    Raises:
        ConfigError: a value an option cannot take, or two options that exclude each other;
            the message names the option and the values it accepts.
    """

    batch_size: int | None = None
    global_batch_size: int | None = None
    shuffle: bool = True
    shuffle_window: int = DEFAULT_WINDOW
    shuffle_window_unit: WindowUnit = "samples"
    seed: int = 0
    tail: TailMode = "drop"
    fields: Sequence[str] | None = None
    ragged: RaggedMode = "padded"
    pad_value: int | float = 0
    transform: Callable[[dict[str, Any]], Any] | None = None
    batch_transform: Callable[[dict[str, Any]], Any] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    with_seeds: bool = False
    infinite: bool = False
    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | None = None
    local_data: LocalData = "in_place"
    storage_options: Mapping[str, Any] | None = None
    fetch: FetchOptions | None = None  # timeouts, retries, requests in flight
    prefetch: PrefetchOptions | None = None  # download threads, shards kept ahead
    allow_external_paths: bool = False  # shards outside the index's folder (same protocol)
    rank: int | None = None
    world_size: int | None = None
    nodes: int | None = None  # nodes the ranks run on (None: from the launcher)
    resume_check: ResumeCheck = "identity"  # what a loaded state must match (plan/cursor.py)
    partitions: int = 0  # canonical partitions of the order (0: none; plan/partitions.py)

    def __post_init__(self) -> None:
        if (self.batch_size is None) == (self.global_batch_size is None):
            raise ConfigError("give exactly one of batch_size (per rank) and "
                              "global_batch_size (over all ranks)")
        for name, minimum in (("batch_size", 1), ("global_batch_size", 1),
                              ("shuffle_window", 1), ("cache_limit", 0), ("rank", 0),
                              ("world_size", 1), ("nodes", 1)):
            _check_int(name, getattr(self, name), minimum)
        _check_int("seed", self.seed, 0)
        if self.partitions is None:
            raise ConfigError("partitions must be an integer >= 0 (0: none), got None")
        _check_int("partitions", self.partitions, 0)
        if self.partitions > MAX_PARTITIONS:
            raise ConfigError(f"partitions must be at most {MAX_PARTITIONS}, got "
                              f"{self.partitions}")
        if self.partitions and self.global_batch_size is not None and \
                self.global_batch_size % self.partitions:
            raise ConfigError(f"global_batch_size={self.global_batch_size} is not a multiple "
                              f"of partitions={self.partitions}: every step takes as many "
                              "samples of every partition")
        if self.seed >= 1 << 64:
            raise ConfigError(f"seed must be below 2**64, got {self.seed}")
        for name, allowed in (("tail", TAIL_MODES), ("ragged", RAGGED_MODES),
                              ("shuffle_window_unit", WINDOW_UNITS),
                              ("local_data", get_args(LocalData)),
                              ("resume_check", RESUME_CHECKS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}; "
                                  f"got {getattr(self, name)!r}")
        for name in ("shuffle", "with_seeds", "infinite", "allow_external_paths"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.pad_value, bool) or not isinstance(self.pad_value, numbers.Real):
            raise ConfigError(f"pad_value must be a number (it fills the padding of "
                              f"variable-length fields), got {self.pad_value!r}")
        if self.cache_dir is not None:
            check_local_folder("cache_dir", self.cache_dir)
        self._check_callables()
        for name, kind in (("fetch", FetchOptions), ("prefetch", PrefetchOptions)):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name} must be a {kind.__name__} (from streamcache), got "
                                  f"{type(getattr(self, name)).__name__}")
        if self.fields is not None:
            if isinstance(self.fields, str):
                raise ConfigError(f"fields must be a sequence of field names, not the "
                                  f"string {self.fields!r} (write fields=[{self.fields!r}])")
            object.__setattr__(self, "fields", tuple(self.fields))
        object.__setattr__(self, "tail", TailPolicy(self.tail).value)

    def _check_callables(self) -> None:
        for name in ("transform", "batch_transform", "collate_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"{name} must be callable, got {type(value).__name__}")
        if self.transform is not None and self.batch_transform is not None:
            raise ConfigError("give a per-sample transform or a batch_transform, not both")
        if self.collate_fn is not None and self.transform is None:
            raise ConfigError("collate_fn batches the samples a per-sample transform returns: "
                              "give it with transform=")


def check_local_folder(name: str, path: str | os.PathLike[str]) -> None:
    """``path`` (a local folder, made later if missing) is or can become a folder: neither it
    nor a folder above it is a file.

    Raises:
        ConfigError: naming the option and the file in the way.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a folder path, got {type(path).__name__}")
    current = os.path.abspath(os.fspath(path))
    while True:
        if os.path.exists(current):
            if not os.path.isdir(current):
                where = "" if current == os.path.abspath(os.fspath(path)) else \
                    f" (it would be made under {current})"
                raise ConfigError(f"{name} must be a folder, but {current} is a file{where}")
            return
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def _check_int(name: str, value: Any, minimum: int) -> None:
    """``value`` is None or an int >= ``minimum``, else a :class:`ConfigError` naming ``name``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


__all__ = [
    "TAIL_MODES",
    "WINDOW_UNITS",
    "LocalData",
    "RaggedMode",
    "StreamOptions",
    "TailMode",
    "WindowUnit",
    "check_local_folder",
]
