"""The memory tier's files: its private folder, slot files opened without following links and
checked to be this user's alone, a slot's mapping that snapshots copy into, and the
checksummed reads of a snapshot's tensors and manifest (the format is memory_format.py's; the
tier, memory.py)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import stat
from typing import Any

import numpy as np
import torch

from .. import _native
from .errors import CheckpointError
from .memory_format import (
    HEADER_SIZE,
    PIECE_BYTES,
    FormatProblem,
    Header,
    Manifest,
    align,
    check_manifest,
    pieces,
    unpack_header,
)


def digest(data: Any) -> int:
    """The checksum of a snapshot's bytes (XXH64)."""
    return _native.xxh64(data)


class ReadHandle:
    """An fd of one slot, opened without following links and checked to be ours."""

    def __init__(self, dir_fd: int, name: str) -> None:
        self.fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)

    def __enter__(self) -> tuple[int, int]:
        info = os.fstat(self.fd)
        problem = file_problem(info)
        if problem is not None:
            os.close(self.fd)
            raise FormatProblem(problem)
        return self.fd, info.st_size

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def file_problem(info: os.stat_result) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not this user"
    if info.st_mode & 0o077:
        return f"open to other users (mode {stat.S_IMODE(info.st_mode):o})"
    if info.st_nlink != 1:
        return f"{info.st_nlink} links to it"
    return None


def private_dir(path: str) -> int:
    """An fd of ``path`` (made 0700 if missing, parents included), checked to be ours alone."""
    parent = os.path.dirname(path)
    for folder in (parent, path):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CheckpointError(f"memory tier: cannot make {folder}: {exc}; pass "
                                  "MemoryOptions(directory=...) a writable tmpfs") from exc
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or \
                info.st_mode & 0o077:
            raise CheckpointError(
                f"memory tier: {folder} is not a private folder of this user (a link, another "
                f"owner, or mode {stat.S_IMODE(info.st_mode):o}); remove it, or pass "
                "MemoryOptions(directory=...) another tmpfs")
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class SlotMap:
    """One slot file's shared mapping, kept from one snapshot to the next.

    A snapshot's tensors are copied into it with non-temporal stores (``stream_copy``: about
    2.6x a ``pwrite`` into tmpfs, whose pages are then reused, not faulted in again). The
    copies and the checksums read it with the native core's SIGBUS guard: another process of
    the user truncating the file costs that snapshot (an error), not the job. Remade when the
    file was replaced or must grow.
    """

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self._file: tuple[int, int] | None = None  # (st_dev, st_ino) mapped

    def array(self, fd: int, size: int) -> np.ndarray:
        """The first ``size`` bytes of ``fd``'s file as a writable uint8 array (the file must
        already be at least that long)."""
        info = os.fstat(fd)
        if self._array is None or self._file != (info.st_dev, info.st_ino) or \
                len(self._array) < size:
            self.close()
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._array = np.frombuffer(self._map, dtype=np.uint8)
            self._file = (info.st_dev, info.st_ino)
        return self._array[:size]

    def close(self) -> None:
        self._array, self._file = None, None
        if self._map is not None:
            # a view that still lives (a traceback's frame) keeps it mapped until it goes
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


def copy_tensor(out: np.ndarray, tensor: torch.Tensor, threads: int) -> None:
    """Copy ``tensor``'s bytes into ``out`` (a slot's mapping, exactly as long).

    Raises:
        NativeError: the mapped file was cut short during the copy (another process).
    """
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    raw = flat.contiguous().reshape(-1).view(torch.uint8).numpy()
    _native.stream_copy(raw, out, threads=threads, guard=True)


def piece_digests(data: np.ndarray) -> list[int]:
    """The digests of a tensor's bytes as the format keeps them (one per piece).

    Raises:
        NativeError: the mapped file was cut short while it was read (another process).
    """
    return _native.xxh64_pieces(data, PIECE_BYTES, guard=True)


def read_manifest(fd: int, size: int) -> tuple[Header, Manifest]:
    header = unpack_header(os.pread(fd, HEADER_SIZE, 0), size, digest)
    raw = os.pread(fd, header.manifest_len, header.manifest_offset)
    if len(raw) != header.manifest_len or digest(raw) != header.manifest_digest:
        raise FormatProblem("manifest checksum mismatch (torn or edited)")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatProblem(f"manifest is not JSON: {exc}") from None
    return header, check_manifest(doc, header)


def read_tensors(fd: int, manifest: Manifest) -> list[torch.Tensor]:
    """Every tensor of the snapshot read into one fresh buffer, each piece verified.

    The buffer holds the tensors packed (not at their file offsets), so what is allocated is
    what the tensors claim, whatever gaps a hostile manifest leaves between them.
    """
    packed, total = [], 0
    for spec in manifest.tensors:
        packed.append(total)
        total = align(total + spec.nbytes)
    buffer = torch.empty(total, dtype=torch.uint8)
    raw = buffer.numpy()
    tensors = []
    for i, (spec, at) in enumerate(zip(manifest.tensors, packed, strict=True)):
        for (start, length), expected in zip(pieces(spec.nbytes), spec.digests, strict=True):
            view = raw[at + start: at + start + length]
            if os.preadv(fd, [view.data], HEADER_SIZE + spec.offset + start) != length:
                raise FormatProblem(f"tensor {i} is cut short")
            if digest(view) != expected:
                raise FormatProblem(f"tensor {i} checksum mismatch (torn or edited)")
        tensors.append(buffer[at: at + spec.nbytes].view(spec.dtype).reshape(spec.shape))
    return tensors


def folder_name(root_url: str, job_id: str | None) -> str:
    """``<root digest>-<job digest>``: the restarts of one job (one job id) share a folder,
    another job or another root never does."""
    root = hashlib.sha256(root_url.encode()).hexdigest()[:20]
    job = hashlib.sha256((job_id or "").encode()).hexdigest()[:12]
    return f"{root}-{job}"


def remove_sibling_folders(folder: str) -> None:
    """Delete the other folders of ``folder``'s root (the same root digest, other jobs) and
    their files; a folder another process removes meanwhile is skipped."""
    parent = os.path.dirname(folder)
    mine = os.path.basename(folder)
    prefix = mine.split("-")[0] + "-"
    for name in os.listdir(parent):
        if name.startswith(prefix) and name != mine:
            other = os.path.join(parent, name)
            with contextlib.suppress(OSError):  # another rank of the node removed it
                for entry in os.listdir(other):
                    os.unlink(os.path.join(other, entry))
                os.rmdir(other)


def open_for_write(dir_fd: int, name: str) -> int:
    """An fd of slot file ``name`` in the tier's folder, read-write: made if missing, and
    made again if what is there is a link or not this user's private regular file."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        fd = -1
    if fd < 0 or file_problem(os.fstat(fd)) is not None:
        if fd >= 0:
            os.close(fd)
        os.unlink(name, dir_fd=dir_fd)  # not a file of ours: replace it
        return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
    return fd
