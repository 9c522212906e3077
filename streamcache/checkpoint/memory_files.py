"""The memory tier's files: its private folder, slot files opened without following links and
checked to be this user's alone, and the checksummed reads and writes of a snapshot's tensors
and manifest (the format is memory_format.py's; the tier, memory.py)."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import torch

from .. import _native
from .errors import CheckpointError
from .memory_format import (
    HEADER_SIZE,
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


def write_tensor(fd: int, tensor: torch.Tensor, offset: int) -> list[int]:
    """Write one tensor's bytes at ``offset``; the digest of each piece (hashed, then written
    while it is in cache)."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1).view(torch.uint8)
    digests = []
    for start, length in pieces(flat.numel()):
        piece = flat[start:start + length].numpy()
        digests.append(digest(piece))
        pwrite_all(fd, piece, offset + start)
    return digests


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
