"""A batch of variable-length rows (:class:`Ragged`): what the gather makes of a
variable-width field, and what a batch hands out as values plus offsets or pads."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .. import _native
from .buffers import output_pool


class Ragged:
    """A batch of variable-length rows: row i is ``values[offsets[i]:offsets[i+1]]``.

    ``kind`` is the field kind: for ``str`` and ``bytes`` the values are UTF-8 / raw bytes.

    A batch of a ``bytes`` field may also hold its rows as ``bytes`` objects
    (:meth:`from_rows`, what the gather makes inside :func:`bytes_as_rows`): then indexing and
    :meth:`tolist` hand out those objects as they are, and ``values``/``offsets`` are built
    (one copy) only if asked for.

    Thread safety: read-only after construction (building ``values`` from rows twice on two
    threads gives equal arrays).
    """

    __slots__ = ("_offsets", "_rows", "_values", "kind")

    def __init__(self, values: np.ndarray, offsets: np.ndarray, kind: str = "sequence") -> None:
        self._values: np.ndarray | None = values
        self._offsets: np.ndarray | None = offsets  # int64, len(self) + 1 entries
        self._rows: list[bytes] | None = None
        self.kind = kind

    @classmethod
    def from_rows(cls, rows: list[bytes]) -> Ragged:
        """A ``bytes`` batch whose rows are these objects (kept, not copied)."""
        ragged = cls.__new__(cls)
        ragged._values = ragged._offsets = None
        ragged._rows = rows
        ragged.kind = "bytes"
        return ragged

    @property
    def values(self) -> np.ndarray:
        if self._values is None:
            assert self._rows is not None
            self._values = np.frombuffer(b"".join(self._rows), dtype=np.uint8)
        return self._values

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            assert self._rows is not None
            offsets = np.zeros(len(self._rows) + 1, dtype=np.int64)
            np.cumsum([len(row) for row in self._rows], out=offsets[1:])
            self._offsets = offsets
        return self._offsets

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else len(self.offsets) - 1

    def __getitem__(self, i: int) -> Any:
        if self._rows is not None:
            return self._rows[i]
        row = self.values[self.offsets[i]:self.offsets[i + 1]]
        if self.kind == "bytes":
            return row.tobytes()
        if self.kind == "str":
            return row.tobytes().decode("utf-8")
        return row

    def __iter__(self) -> Iterator[Any]:
        if self._rows is not None:
            return iter(self._rows)
        return (self[i] for i in range(len(self)))

    def tolist(self) -> list[Any]:
        return list(self)

    def split(self, bounds: Sequence[int]) -> list[Ragged]:
        """The rows ``[bounds[k], bounds[k + 1])`` as one batch each: views of these values
        (the offsets of each made to start at 0), or slices of the row objects."""
        if self._rows is not None:
            return [Ragged.from_rows(self._rows[a:b]) for a, b in itertools.pairwise(bounds)]
        offsets = self.offsets
        return [Ragged(self.values[offsets[a]:offsets[b]], offsets[a:b + 1] - offsets[a],
                       self.kind) for a, b in itertools.pairwise(bounds)]

    def __repr__(self) -> str:
        return f"Ragged(rows={len(self)}, kind={self.kind!r})"

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def to_padded(self, pad_value: Any = 0, max_length: int | None = None, *,
                  share: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(padded [B, L], lengths [B])``; rows longer than ``max_length`` are cut.

        ``share=True`` lets ``padded`` be a view of :attr:`values` where every row already has
        length L (sequences packed to one length, the common case: no copy at all); otherwise
        it is a new array (from the gather's buffer pool), filled by one copy per row.
        """
        offsets = self.offsets
        values = self.values
        lengths = offsets[1:] - offsets[:-1]
        n = len(lengths)
        if max_length is None:  # (each numpy call here costs ~1 us: a step makes one batch)
            width, kept = int(lengths.max(initial=0)), lengths
        else:
            width, kept = max_length, np.minimum(lengths, max_length)
        if (share and n and values.ndim == 1 and offsets[0] == 0
                and offsets[-1] == n * width and int(lengths.min()) == width):
            return values[:n * width].reshape(n, width), kept
        nbytes = n * width * values.dtype.itemsize
        out = output_pool().take(nbytes).view(values.dtype).reshape(n, width)
        _native.pad_rows(np.ascontiguousarray(values), np.ascontiguousarray(offsets,
                                                                            dtype=np.int64),
                         width, pad_value, out)
        return out, kept
