"""streamcache: fast, exactly-once, resumable data streaming and checkpointing for PyTorch."""

from __future__ import annotations

from .convert import convert
from .dataset import StreamDataset, StreamOptions
from .dataset_reader import DatasetReader
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
from .index import DatasetIndex, build_index, load_index
from .loader import StreamLoader
from .reader import Ragged
from .schema import Field, Schema
from .writer import ShardWriter, write_dataset

__version__ = "0.1.0"

__all__ = [
    "ChecksumMismatchError",
    "CorruptDataError",
    "DatasetIndex",
    "DatasetReader",
    "DestinationError",
    "EmptyDatasetError",
    "Field",
    "IndexFormatError",
    "IndexNotFoundError",
    "Ragged",
    "Schema",
    "SchemaError",
    "ShardCorruptError",
    "ShardWriter",
    "SourceError",
    "StreamDataset",
    "StreamLoader",
    "StreamOptions",
    "StreamcacheError",
    "__version__",
    "build_index",
    "convert",
    "load_index",
    "write_dataset",
]
