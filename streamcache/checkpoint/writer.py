"""DCP's storage writer, producing the files DCP's own writer produces with less work.

:class:`OnePassWriter` is a ``FileSystemWriter`` (same plan, same file names and split
into files, same ``.metadata``; any DCP reader loads its checkpoints) that differs only in
how the bytes of each file reach the disk (its ``_write_data``, which DCP's ``write_data``
calls with the files it named):

- a tensor is stored as DCP stores it, a ``torch.save`` archive per item, but the archive is
  assembled from its header and tail (made once per dtype and shape with torch's documented
  ``skip_data`` mode, which leaves the storage bytes to "a separate pass") and the tensor's
  own memory. ``torch.save`` itself computes a CRC32 of every record, 1.35 s per GiB here,
  more than writing the bytes; no reader checks it (``torch.load`` does not), and the commit
  marker's XXH64 of every file is verified before any load;
- each file is written by :class:`~.output.OutputFile`: direct I/O from the staging
  buffers, checksummed while written, so the commit needs no second read of the files.

Anything that is not a plain dense CPU tensor (and every tensor on a torch without
``skip_data``) is written with ``torch.save`` into the same :class:`~.output.OutputFile`.

:attr:`OnePassWriter.written` holds each file this rank wrote (``.metadata`` on the
coordinator) with its size and checksum once ``dcp.save`` returns.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..format.checksum import checksum_bytes
from ..remote import storage
from .layout import DCP_METADATA_NAME, FileEntry
from .output import OutputFile
from .pace import Pace

# (dtype, shape) -> (header bytes, tail bytes) of that tensor's torch.save archive
_ARCHIVES: dict[tuple[torch.dtype, tuple[int, ...]], tuple[bytes, bytes]] = {}
_ARCHIVES_LOCK = threading.Lock()
_ARCHIVES_MAX = 65536


class OnePassWriter(FileSystemWriter):
    """A DCP ``FileSystemWriter`` that writes each byte once (see the module doc).

    Args:
        path: the checkpoint directory.
        durable: fsync files before ``dcp.save`` returns (False for a local tier's copy,
            which is written through the page cache: it is read back at once to upload it,
            and need not reach the disk).
        thread_count: files (and threads) per rank, as DCP's ``thread_count``.
        pace: where hashing yields to a busy training thread.
        direct: use direct I/O for durable files where the file system supports it.
    """

    def __init__(self, path: str, *, durable: bool, thread_count: int = 1,
                 pace: Pace | None = None, direct: bool = True) -> None:
        super().__init__(path, sync_files=durable, thread_count=thread_count, overwrite=False)
        self.pace, self.direct = pace, direct and durable
        self.written: dict[str, FileEntry] = {}
        self._written_lock = threading.Lock()

    def _write_data(self, planner: SavePlanner,
                    file_queue: queue.Queue[Any]) -> Future[list[WriteResult]]:
        """Write the files DCP's ``write_data`` queued (path, name, items), one thread each.

        (DCP's ``write_data`` names the files and splits the items, as for its own writer,
        then calls this.)
        """
        jobs = []
        while not file_queue.empty():
            path, name, items = file_queue.get_nowait()
            jobs.append((str(path), name, items))
        results: list[WriteResult] = []
        if len(jobs) == 1:
            results = self._write_file(*jobs[0], planner)
        elif jobs:
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="streamcache-ckpt-w") as pool:
                parts = [pool.submit(self._write_file, path, name, items, planner)
                         for path, name, items in jobs]
                for part in parts:
                    results.extend(part.result())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Publish ``.metadata`` (what DCP's writer publishes), checksummed from its bytes."""
        metadata.version = "1.0.0"
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        data = pickle.dumps(metadata)
        path = os.path.join(str(self.path), DCP_METADATA_NAME)
        storage.write_atomic_local(path, data, durable=self.sync_files)
        self._record(DCP_METADATA_NAME, FileEntry(len(data), checksum_bytes(data)))

    # ------------------------------------------------------------------ internals

    def _write_file(self, path: str, name: str, items: list[WriteItem],
                    planner: SavePlanner) -> list[WriteResult]:
        out = OutputFile(path, durable=self.sync_files, pace=self.pace, direct=self.direct)
        try:
            results = [self._write_item(out, name, item, planner) for item in items]
            entry = out.finish()
        except BaseException:
            out.abort()
            raise
        self._record(name, entry)
        return results

    def _write_item(self, out: OutputFile, name: str, item: WriteItem,
                    planner: SavePlanner) -> WriteResult:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            start = out.position
            out.write_bytes(data.getbuffer())
        else:
            assert isinstance(data, torch.Tensor)
            start = write_tensor(out, data.detach())
        length = out.position - start
        return WriteResult(index=item.index, size_in_bytes=length,
                           storage_data=_StorageInfo(name, start, length))

    def _record(self, name: str, entry: FileEntry) -> None:
        with self._written_lock:
            self.written[name] = entry


def write_tensor(out: OutputFile, tensor: torch.Tensor) -> int:
    """Append ``tensor`` as a ``torch.save`` archive; returns where the archive starts."""
    tensor = tensor.cpu()
    if not _plain(tensor) or not hasattr(torch.serialization, "skip_data"):
        start = out.position
        torch.save(tensor, cast(IO[bytes], _Sink(out.write_bytes)))
        return start
    if not tensor.is_contiguous() or tensor.storage_offset() != 0 or \
            tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.contiguous().clone()  # what DCP's writer saves: the tensor's own bytes
    header, tail = archive_parts(tensor.dtype, tuple(tensor.shape))
    out.write_bytes(bytes(out.pad_for(len(header), tensor.data_ptr())))
    start = out.position
    out.write_bytes(header)
    if tensor.numel():
        data: Any = tensor.reshape(-1).view(torch.uint8).numpy()
        out.write_memory(memoryview(data))
    out.write_bytes(tail)
    return start


def archive_parts(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The bytes of a ``torch.save`` archive of a contiguous ``dtype`` tensor of ``shape``
    before and after its data (the same for every such tensor)."""
    key = (dtype, shape)
    with _ARCHIVES_LOCK:
        found = _ARCHIVES.get(key)
    if found is not None:
        return found
    probe = torch.empty(shape, dtype=dtype)  # its bytes are never read
    recorder = _Recorder()
    with torch.serialization.skip_data():
        torch.save(probe, cast(IO[bytes], recorder))
    parts = recorder.split(probe.numel() * probe.element_size())
    with _ARCHIVES_LOCK:
        if len(_ARCHIVES) >= _ARCHIVES_MAX:
            _ARCHIVES.clear()
        _ARCHIVES[key] = parts
    return parts


def _plain(tensor: torch.Tensor) -> bool:
    return (type(tensor) is torch.Tensor and tensor.layout == torch.strided
            and not tensor.is_quantized and tensor.device.type == "cpu")


class _Sink(io.RawIOBase):
    """A write-only stream that hands every write to ``write`` (for ``torch.save``)."""

    def __init__(self, write: Callable[[Any], None]) -> None:
        self._write = write

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._write(view)
        return view.nbytes


class _Recorder(io.RawIOBase):
    """A seekable sink keeping what ``torch.save`` writes under ``skip_data`` (a gap where
    the storage bytes go)."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, bytes]] = []
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self.pos = offset
        elif whence == io.SEEK_CUR:
            self.pos += offset
        else:
            self.pos = max((p + len(b) for p, b in self.writes), default=0) + offset
        return self.pos

    def write(self, data: Any) -> int:
        chunk = bytes(memoryview(data))
        self.writes.append((self.pos, chunk))
        self.pos += len(chunk)
        return len(chunk)

    def split(self, data_bytes: int) -> tuple[bytes, bytes]:
        """(header, tail): the bytes before and after the one gap of ``data_bytes``."""
        image: dict[int, bytes] = {}
        for position, chunk in self.writes:
            image[position] = chunk  # a later write at the same place replaces an earlier
        header, tail, end, gap = bytearray(), bytearray(), 0, None
        for position in sorted(image):
            chunk = image[position]
            if gap is None and position != end:
                gap = position
            if gap is None:
                header += chunk
            else:
                tail += chunk
            end = position + len(chunk)
        if gap is None:  # no bytes to leave out (an empty tensor)
            gap = len(header)
        if gap - len(header) != data_bytes:
            raise RuntimeError(f"unexpected torch.save layout: a gap of {gap - len(header)} "
                               f"bytes where the tensor has {data_bytes}")
        return bytes(header), bytes(tail)
