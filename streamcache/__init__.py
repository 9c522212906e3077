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
from .format.convert import convert
from .format.index import DatasetIndex, build_index, load_index
from .format.reader import Ragged
from .format.schema import Field, Schema
from .format.writer import ShardWriter, write_dataset
from .goodput import GoodputError
from .loading.dataset_reader import DatasetReader
from .plan import CursorMismatchError, PlanError, PositionOutOfRangeError

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
    from .loading.dataset import StreamDataset
    from .loading.loader import StreamLoader
    from .loading.options import StreamOptions
    from .loading.source import Source
    from .remote.options import FetchOptions
    from .remote.retry import FetchError
    from .replicas.loader import ReplicaError

# The torch-facing parts (and the fetcher, which imports aiohttp) are imported on first use,
# so that `import streamcache` (the CLI's convert/index/inspect, writers in data pipelines)
# does not pay for importing torch. Every error class is importable from here all the same.
_LAZY = {
    "StreamDataset": "streamcache.loading.dataset",
    "StreamOptions": "streamcache.loading.options",
    "StreamLoader": "streamcache.loading.loader",
    "Source": "streamcache.loading.source",
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
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'streamcache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
