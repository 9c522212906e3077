"""Byte ranges of a remote object: neighbouring ranges coalesced into fewer requests, and a
read-only file of the pieces fetched (what pyarrow opens to decode a footer and its chunks).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from ..format.chunks import Block

#: connection's rate; the CPU of a request on both ends here): 256 KiB saves requests
#: without making a cold start's bytes much larger than its chunks' (merged spans count
#: against the cold budgets).
COALESCE_GAP = 256 << 10
#: A coalesced range never grows beyond this (each range must arrive within ``timeout_s``).
MAX_RANGE = 8 << 20


def coalesce(blocks: Sequence[Block], gap: int = COALESCE_GAP,
             limit: int = MAX_RANGE) -> list[Block]:
    """Byte ranges covering ``blocks`` (in file order): neighbours less than ``gap`` bytes
    apart merge into one range, while it stays within ``limit`` bytes."""
    spans: list[Block] = []
    for block in sorted(blocks, key=lambda b: b.offset):
        if spans:
            last = spans[-1]
            end = max(last.offset + last.length, block.offset + block.length)
            if block.offset - (last.offset + last.length) <= gap and end - last.offset <= limit:
                spans[-1] = Block(last.offset, end - last.offset)
                continue
        spans.append(block)
    return spans


def sparse_file(size: int, pieces: list[tuple[int, bytes]]) -> pa.PythonFile:
    """A read-only file of ``size`` bytes of which only some ranges were fetched; reading
    elsewhere is an error (pyarrow reads only what the footer points at)."""
    return pa.PythonFile(Pieces(size, pieces), mode="r")


class Pieces(io.RawIOBase):
    def __init__(self, size: int, pieces: list[tuple[int, bytes]]) -> None:
        self._size = size
        self._pieces = sorted(pieces, key=lambda p: p[0])
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._position, self._size)[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer: Any) -> int:
        wanted = max(0, min(len(buffer), self._size - self._position))
        for start, piece in self._pieces:
            if start <= self._position and self._position + wanted <= start + len(piece):
                at = self._position - start
                buffer[:wanted] = piece[at:at + wanted]
                self._position += wanted
                return wanted
        raise OSError(f"bytes [{self._position}, {self._position + wanted}) were not fetched")

