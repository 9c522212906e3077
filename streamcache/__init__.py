"""streamcache: fast, exactly-once, resumable data streaming and checkpointing for PyTorch."""

from __future__ import annotations

from .errors import (
    ChecksumMismatchError,
    CorruptDataError,
    DestinationError,
    EmptyDatasetError,
    IndexFormatError,
    IndexNotFoundError,
    SchemaError,
    ShardCorruptError,
    SourceError,
    StreamcacheError,
)

__version__ = "0.1.0"

__all__ = [
    "ChecksumMismatchError",
    "CorruptDataError",
    "DestinationError",
    "EmptyDatasetError",
    "IndexFormatError",
    "IndexNotFoundError",
    "SchemaError",
    "ShardCorruptError",
    "SourceError",
    "StreamcacheError",
    "__version__",
]
