"""streamcache: fast, exactly-once, resumable data streaming and checkpointing for PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .convert import convert
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
from .reader import Ragged
from .schema import Field, Schema
from .writer import ShardWriter, write_dataset

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time these load lazily
    from .checkpoint import Checkpointer
    from .dataset import StreamDataset, StreamOptions
    from .loader import StreamLoader

# The torch-facing parts are imported on first use, so that `import streamcache` (the CLI's
# convert/index/inspect, writers in data pipelines) does not pay for importing torch.
_LAZY = {
    "StreamDataset": "streamcache.dataset",
    "StreamOptions": "streamcache.dataset",
    "StreamLoader": "streamcache.loader",
    "Checkpointer": "streamcache.checkpoint",
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
    "Checkpointer",
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
