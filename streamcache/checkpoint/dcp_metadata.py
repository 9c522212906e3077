"""What a DCP ``.metadata`` may say before a load trusts it.

The metadata is read without running code (``unpickle.py``), but what it holds is still
untrusted: its storage entries tell DCP's reader which file to open and which bytes to read
for every value. Here every entry must name a data file that the step's commit marker lists
(a plain name in the step's directory: never an absolute path, ``..`` or another step's
file), with an offset and length inside that file's size, and the state's entries must be of
DCP's own types. Anything else is refused before DCP opens a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from . import layout
from .errors import CheckpointUnsafeError
from .layout import FileEntry

# files of a step that hold no values: DCP never reads values from them
_NOT_DATA = frozenset({layout.MARKER_NAME, layout.GLOBAL_NAME, layout.DCP_METADATA_NAME})


def check_metadata(metadata: Metadata, files: Mapping[str, FileEntry], where: str) -> None:
    """Raise :class:`CheckpointUnsafeError` unless ``metadata`` is confined to ``files``.

    Args:
        metadata: the unpickled ``.metadata`` of one checkpoint.
        files: the commit marker's files (name -> size and checksum).
        where: the checkpoint, for messages.
    """
    problem = _problem(metadata, files)
    if problem is not None:
        raise CheckpointUnsafeError(
            f"{where}: refusing DCP metadata: {problem}. A checkpoint reads only the files its "
            "commit marker lists; this one was not written by streamcache or was tampered with"
        )


def _problem(metadata: Metadata, files: Mapping[str, FileEntry]) -> str | None:
    # attributes are read with getattr: an unpickled object may lack any of them
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        return f"state_dict_metadata is a {type(entries).__name__}"
    for fqn, entry in entries.items():
        problem = _entry_problem(fqn, entry)
        if problem is not None:
            return problem
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return f"storage_data is a {type(storage).__name__}"
    for index, info in storage.items():
        problem = _storage_problem(index, info, files)
        if problem is not None:
            return problem
    planner_data = getattr(metadata, "planner_data", None)
    if planner_data is not None and not isinstance(planner_data, dict):
        return f"planner_data is a {type(planner_data).__name__}"
    return None


def _entry_problem(fqn: Any, entry: Any) -> str | None:
    if not isinstance(fqn, str):
        return f"a state key is a {type(fqn).__name__}"
    if isinstance(entry, BytesStorageMetadata):
        return None
    if not isinstance(entry, TensorStorageMetadata):
        return f"{fqn!r} is described by a {type(entry).__name__}"
    size: Any = getattr(entry, "size", None)
    chunks: Any = getattr(entry, "chunks", None)
    properties: Any = getattr(entry, "properties", None)
    if not _is_shape(size) or not isinstance(chunks, list) or not isinstance(
            properties, TensorProperties) or not isinstance(
                getattr(properties, "dtype", None), torch.dtype):
        return f"{fqn!r} has a malformed shape, dtype or chunk list"
    for chunk in chunks:
        if not _chunk_inside(chunk, size):
            return f"{fqn!r} has a chunk outside its shape {list(size)}"
    return None


def _chunk_inside(chunk: Any, size: torch.Size) -> bool:
    offsets: Any = getattr(chunk, "offsets", None)
    sizes: Any = getattr(chunk, "sizes", None)
    if not isinstance(chunk, ChunkStorageMetadata) or not _is_shape(offsets) or \
            not _is_shape(sizes) or not len(offsets) == len(sizes) == len(size):
        return False
    return all(o + s <= n for o, s, n in zip(offsets, sizes, size, strict=True))


def _storage_problem(index: Any, info: Any, files: Mapping[str, FileEntry]) -> str | None:
    fqn = getattr(index, "fqn", None)
    if not isinstance(index, MetadataIndex) or not isinstance(fqn, str):
        return f"a storage key is a {type(index).__name__}"
    if not isinstance(info, _StorageInfo):
        return f"{fqn!r} is stored as a {type(info).__name__}"
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or name not in files or name in _NOT_DATA:
        return (f"{fqn!r} is read from {name!r}, which is not a data file the commit marker "
                "lists")
    offset: Any = getattr(info, "offset", None)
    length: Any = getattr(info, "length", None)
    if not (_is_count(offset) and _is_count(length)) or offset + length > files[name].size:
        return (f"{fqn!r} is read from bytes [{offset!r}, +{length!r}) of {name}, which has "
                f"{files[name].size} bytes")
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        return f"{fqn!r} names stream transforms {transforms!r}"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_shape(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(_is_count(n) for n in value)
