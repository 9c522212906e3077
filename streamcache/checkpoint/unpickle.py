"""Reading DCP checkpoints without running their pickles.

DCP pickles its ``.metadata`` and every non-tensor value, and reads them back with
``pickle.load`` and ``torch.load(weights_only=False)``: whoever can write a checkpoint root
(and a self-consistent commit marker) could run code on every rank that loads it. Here the
metadata is read by an unpickler that builds only DCP's metadata classes and plain values,
and non-tensor values by torch's weights-only unpickler (tensors, numbers, strings, plain
containers). Anything else is refused with :class:`CheckpointUnsafeError` before it runs.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .errors import CheckpointUnsafeError
from .tiers import retrying

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) of everything a DCP .metadata pickle may construct
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to the layout
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def load_metadata(data: bytes, *, where: str) -> Metadata:
    """Unpickle a DCP ``.metadata`` file's bytes, constructing only metadata classes.

    Raises:
        CheckpointUnsafeError: the pickle names anything else (it is never called).
    """
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointUnsafeError(
            f"{where}: refusing DCP metadata: {exc}. Only DCP's metadata classes and plain "
            "values are unpickled (anything else could run code from the checkpoint); this "
            "checkpoint was not written by DCP or was tampered with"
        ) from exc
    except Exception as exc:  # any other failure of an allowed constructor: not DCP's
        raise CheckpointUnsafeError(  # metadata either (a KeyError, a bad enum value, ...)
            f"{where}: refusing DCP metadata: it does not unpickle as DCP writes it "
            f"({type(exc).__name__}: {_first_line(exc)}); this checkpoint was not written by "
            "DCP or was tampered with"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointUnsafeError(f"{where}: the DCP metadata holds a "
                                    f"{type(metadata).__name__}, not DCP's Metadata")
    return metadata


class _SafeMetadataMixin:
    """``read_metadata`` through :func:`load_metadata` (for DCP's file-system readers)."""

    fs: Any
    load_id: Any
    _kept: Metadata | None = None

    def keep_metadata(self, metadata: Metadata) -> None:
        """Answer every later ``read_metadata`` with ``metadata`` (checked by the caller)
        instead of reading the file again."""
        self._kept = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._kept is not None:
            metadata = self._kept
        else:
            path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
            with self.fs.create_stream(path, "rb") as stream:
                metadata = load_metadata(stream.read(), where=str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    """DCP's local reader, reading metadata without running code."""


class SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
    """DCP's fsspec reader, reading metadata without running code.

    A transient error while reading this rank's data (an object store's 5xx) is retried:
    reading again overwrites the same tensors and values, and no collective runs inside.
    """

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        read = super().read_data
        return retrying(lambda: read(plan, planner), f"reading {self.path}")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, unpickling non-tensor values with ``weights_only=True``.

    A refused value is kept in :attr:`refused` too: DCP wraps errors raised while reading in
    its own exception, and the caller re-raises this one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refused: CheckpointUnsafeError | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:  # UnpicklingError: a refused global; others: not a value
            self.refused = CheckpointUnsafeError(
                f"refusing to load the value {fqn!r}: its pickle needs more than tensors, "
                f"numbers, strings and plain containers ({type(exc).__name__}: "
                f"{_first_line(exc)}); loading it would run code from the checkpoint. Save "
                "plain values (or a Stateful whose state_dict holds only those)"
            )
            raise self.refused from exc
        # what DefaultLoadPlanner.load_bytes does after its own (unrestricted) torch.load
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
