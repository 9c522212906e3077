"""streamcache: fast, exactly-once, resumable data streaming and checkpointing for PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (
    CacheBudgetError,
    CacheError,
    ChecksumMismatchError,
    ConfigError,
    CorruptDataError,
    DestinationError,
    EmptyDatasetError,
    IndexFormatError,
    IndexNotFoundError,
    LoaderStateError,
    MissingDependencyError,
    NativeError,
    PrefetchError,
    RowOutOfRangeError,
    SchemaError,
    ShardCorruptError,
    ShardNotFoundError,
    SourceError,
    StorageError,
    StreamcacheError,
    TransformError,
    UnknownProtocolError,
    UsageError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time these load lazily
    from .cache.prefetch import PrefetchOptions
    from .checkpoint import Checkpointer
    from .checkpoint.errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointNotFoundError,
        CheckpointUnsafeError,
        CheckpointWriteError,
    )
    from .format.convert import convert
    from .format.index import DatasetIndex, build_index, load_index
    from .format.ragged import Ragged
    from .format.schema import Field, Schema
    from .format.writer import ShardWriter, write_dataset
    from .goodput import GoodputError
    from .loading.dataset import StreamDataset
    from .loading.dataset_reader import DatasetReader
    from .loading.loader import StreamLoader
    from .loading.options import StreamOptions
    from .loading.source import Source
    from .plan import CursorMismatchError, PlanError, PositionOutOfRangeError
    from .remote.options import FetchOptions
    from .remote.retry import FetchError
    from .replicas.loader import ReplicaError

# Only the exception family is imported with the package; every other public name is imported
# on first use (attribute access or `from streamcache import X`), so that `import streamcache`
# costs milliseconds on top of torch: every restarted training process pays it, and so do the
# CLI's convert/index/inspect and writers in data pipelines, which need no torch at all.
_LAZY = {
    "StreamDataset": "streamcache.loading.dataset",
    "StreamOptions": "streamcache.loading.options",
    "StreamLoader": "streamcache.loading.loader",
    "Source": "streamcache.loading.source",
    "DatasetReader": "streamcache.loading.dataset_reader",
    "Checkpointer": "streamcache.checkpoint",
    "CheckpointError": "streamcache.checkpoint.errors",
    "CheckpointWriteError": "streamcache.checkpoint.errors",
    "CheckpointNotFoundError": "streamcache.checkpoint.errors",
    "CheckpointCorruptError": "streamcache.checkpoint.errors",
    "CheckpointUnsafeError": "streamcache.checkpoint.errors",
    "FetchError": "streamcache.remote.retry",
    "FetchOptions": "streamcache.remote.options",
    "PrefetchOptions": "streamcache.cache.prefetch",
    "ReplicaError": "streamcache.replicas.loader",
    "convert": "streamcache.format.convert",
    "DatasetIndex": "streamcache.format.index",
    "build_index": "streamcache.format.index",
    "load_index": "streamcache.format.index",
    "Ragged": "streamcache.format.ragged",
    "Field": "streamcache.format.schema",
    "Schema": "streamcache.format.schema",
    "ShardWriter": "streamcache.format.writer",
    "write_dataset": "streamcache.format.writer",
    "GoodputError": "streamcache.goodput",
    "CursorMismatchError": "streamcache.plan",
    "PlanError": "streamcache.plan",
    "PositionOutOfRangeError": "streamcache.plan",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'streamcache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CacheBudgetError",
    "CacheError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointUnsafeError",
    "CheckpointWriteError",
    "Checkpointer",
    "ChecksumMismatchError",
    "ConfigError",
    "CorruptDataError",
    "CursorMismatchError",
    "DatasetIndex",
    "DatasetReader",
    "DestinationError",
    "EmptyDatasetError",
    "FetchError",
    "FetchOptions",
    "Field",
    "GoodputError",
    "IndexFormatError",
    "IndexNotFoundError",
    "LoaderStateError",
    "MissingDependencyError",
    "NativeError",
    "PlanError",
    "PositionOutOfRangeError",
    "PrefetchError",
    "PrefetchOptions",
    "Ragged",
    "ReplicaError",
    "RowOutOfRangeError",
    "Schema",
    "SchemaError",
    "ShardCorruptError",
    "ShardNotFoundError",
    "ShardWriter",
    "Source",
    "SourceError",
    "StorageError",
    "StreamDataset",
    "StreamLoader",
    "StreamOptions",
    "StreamcacheError",
    "TransformError",
    "UnknownProtocolError",
    "UsageError",
    "__version__",
    "build_index",
    "convert",
    "load_index",
    "write_dataset",
]
