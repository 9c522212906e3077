"""The accounting file, ``accounting.json``: the installed bytes of every shard of every dataset
in the cache folder, as a header line and records appended one install at a time (JSON lines),
and :class:`Ledger`, one cache object's view of it.

Format (version 2)::

    {"format":"streamcache-cache-accounting","version":2,"generation":"<32 hex digits>"}
    {"add":"datasets/<ds>/NNNNNN.arrow","bytes":123,"installed":1767225600.5}
    {"remove":"datasets/<ds>/NNNNNN.arrow"}

Every change is made under the cache-wide lock (accounting.py): an install or an eviction
appends its records in one ``write``; the whole file is rewritten (a new generation, renamed
into place) only when the cache opens or the file does not validate (both from the directory
walk), and when the records outnumber twice the entries plus :data:`COMPACT_SLACK`, so that
rewrites cost O(1) per change, amortized. A view reads only the records appended since it last
looked, unless the header (and so the generation) or the file changed: then it reads the file
whole. Why a journal rather than a rewrite per install or an in-memory batch: docs/cache.md,
"Installing a shard, across processes".

The file is untrusted input (anyone who may write to the cache folder may write anything into
it): it is opened without following a link and without blocking (a FIFO), read up to
:data:`MAX_ACCOUNTING_BYTES`, and every record must name a shard file of a dataset folder with
a plain name, with a size and time that are finite numbers. Anything else, a torn last line
included, is a :class:`LedgerError`: the caller rebuilds the file from the directory. The name
is the one version 1 (a single JSON document) used, so an older streamcache sharing the folder
finds a file it cannot parse and rebuilds from the files, rather than keeping a second budget.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import stat
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from ..errors import CacheError
from ..remote import storage
from .confine import open_below

ACCOUNTING_NAME = "accounting.json"
ACCOUNTING_FORMAT = "streamcache-cache-accounting"
ACCOUNTING_VERSION = 2
KEY_FORMAT, KEY_VERSION, KEY_GENERATION = "format", "version", "generation"
KEY_ADD, KEY_REMOVE, KEY_BYTES, KEY_INSTALLED = "add", "remove", "bytes", "installed"
#: A larger file is not read (it would be ~2.5 million entries): it is rebuilt from the files.
MAX_ACCOUNTING_BYTES = 256 << 20
#: Records beyond twice the entries that the file may hold before it is rewritten.
COMPACT_SLACK = 1024
#: A dataset folder's name, and a shard file's, under ``datasets/`` (each matched whole).
DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
SHARD_FILE = re.compile(r"(\d{6,})\.arrow")
#: An accounting key: a shard file of a dataset folder; nothing else is ever trusted.
KEY_PATTERN = re.compile(rf"datasets/({DATASET_NAME.pattern})/{SHARD_FILE.pattern}")
_HEADER_MAX = 256
_GENERATION = re.compile(r"[0-9a-f]{32}")
_MAX_BYTES_VALUE = 1 << 62


class Entry(NamedTuple):
    """One installed shard as the accounting records it."""

    nbytes: int
    installed: float  # time.time() of its install (or its mtime, when rebuilt from the files)


class LedgerError(ValueError):
    """The accounting file is missing, unreadable, torn or does not validate: the caller
    rebuilds it from the files."""


class Ledger:
    """One cache object's view of the accounting file: every entry, their total, and where in
    which file the view stands.

    Thread safety: none; every method must be called with the cache-wide lock held (which also
    serializes the processes sharing the file). Fork: a child may keep its parent's view (it
    is a view of the file at a position, which the next :meth:`refresh` checks).
    """

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.total = 0
        self._header = b""  # the header line of the file the view was read from ("": none)
        self._file: tuple[int, int] = (-1, -1)  # its (st_dev, st_ino)
        self._offset = 0  # bytes of it the view has read (or written)
        self._records = 0  # records in it (compaction is due when they outnumber the entries)

    def refresh(self, root: str) -> None:
        """Bring the view up to date with ``root``'s accounting file: read the records
        appended since the last look, or the whole file when it is another one.

        Raises:
            LedgerError: the file is missing, not a regular file, too large, torn or invalid
                (the view is then empty; rebuild with :meth:`rewrite`).
        """
        try:
            fd = open_below(root, ACCOUNTING_NAME, os.O_RDONLY | os.O_NONBLOCK)
        except (OSError, CacheError) as error:  # missing, or a planted link
            self._forget()
            raise LedgerError(f"cannot open {ACCOUNTING_NAME}: {error}") from error
        try:
            self._catch_up(fd)
        except (OSError, LedgerError) as error:
            self._forget()
            raise LedgerError(f"{ACCOUNTING_NAME} is unusable: {error}") from error
        finally:
            os.close(fd)

    def commit(self, root: str, removed: Iterable[str], added: Mapping[str, Entry],
               temp_dir: str) -> None:
        """Record that the ``removed`` keys are gone and the ``added`` entries installed (the
        view must have just been refreshed): appended in one ``write``, or the whole file
        rewritten from the view when compaction is due or the file is not the one the view
        read (written without the lock since: what it added is not trusted).

        Raises:
            OSError: the write failed (disk full, folder removed). The view is forgotten, so
                the next :meth:`refresh` reads the file whole: it holds the records whole,
                not at all, or torn (found then, and rebuilt from the files).
        """
        records: list[tuple[str, Entry | None]] = [(key, None) for key in removed]
        records.extend(added.items())
        if not records:
            return
        if (self._records + len(records) <= COMPACT_SLACK + 2 * len(self.entries)
                and self._append(root, records)):
            return
        entries = dict(self.entries)
        _apply_to(entries, records)
        self.rewrite(root, entries, temp_dir)

    def rewrite(self, root: str, entries: Mapping[str, Entry], temp_dir: str) -> None:
        """Replace the file with one of a new generation holding ``entries`` (renamed into
        place, so a reader sees the old file or the whole new one), and make it the view.

        Raises:
            OSError: the file could not be written; nothing was published, the view is
                forgotten.
        """
        header = _line({KEY_FORMAT: ACCOUNTING_FORMAT, KEY_VERSION: ACCOUNTING_VERSION,
                        KEY_GENERATION: secrets.token_hex(16)})
        body = b"".join(_record_line(key, entry) for key, entry in entries.items())
        self._forget()
        # the temporary lives in the process's folder, which is swept once it is dead; not
        # durable: after a power loss the next open rebuilds the file from the directory
        with storage.atomic_write(os.path.join(root, ACCOUNTING_NAME), "wb", durable=False,
                                  temp_dir=temp_dir) as f:
            f.write(header + body)
            written = os.fstat(f.fileno())
        self.entries = dict(entries)
        self.total = sum(entry.nbytes for entry in self.entries.values())
        self._header, self._file = header, (written.st_dev, written.st_ino)
        self._offset, self._records = len(header) + len(body), len(self.entries)

    # ------------------------------------------------------------------ reading

    def _catch_up(self, fd: int) -> None:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ACCOUNTING_BYTES:
            raise LedgerError("not a regular file of a plausible size")
        header = _first_line(_read(fd, 0, min(st.st_size, _HEADER_MAX)))
        if (header != self._header or (st.st_dev, st.st_ino) != self._file
                or st.st_size < self._offset):
            self._start(header, (st.st_dev, st.st_ino))
        records = _parse(_read(fd, self._offset, st.st_size - self._offset))
        self.total += _apply_to(self.entries, records)
        self._offset, self._records = st.st_size, self._records + len(records)

    def _start(self, header: bytes, file: tuple[int, int]) -> None:
        """Read a file from its start: an empty view positioned after its (valid) header."""
        _check_header(header)
        self.entries, self.total, self._records = {}, 0, 0
        self._header, self._file, self._offset = header, file, len(header)

    def _forget(self) -> None:
        self.entries, self.total = {}, 0
        self._header, self._file, self._offset, self._records = b"", (-1, -1), 0, 0

    # ------------------------------------------------------------------ writing

    def _append(self, root: str, records: list[tuple[str, Entry | None]]) -> bool:
        """Append ``records`` in one ``write``; False (nothing written) when the file is not
        the one the view read up to its end: something wrote it without the lock."""
        data = b"".join(_record_line(key, entry) for key, entry in records)
        try:
            fd = open_below(root, ACCOUNTING_NAME, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
        except (OSError, CacheError):  # removed, or a link planted, since the refresh
            return False
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self._file or st.st_size != self._offset:
                return False
            _write_all(fd, data)
        except OSError:
            self._forget()
            raise
        finally:
            os.close(fd)
        self.total += _apply_to(self.entries, records)
        self._offset, self._records = self._offset + len(data), self._records + len(records)
        return True


def _apply_to(entries: dict[str, Entry], records: Iterable[tuple[str, Entry | None]]) -> int:
    """Apply ``records`` to ``entries`` in order; returns the change of their total bytes."""
    change = 0
    for key, entry in records:
        old = entries.pop(key, None)
        change -= old.nbytes if old is not None else 0
        if entry is not None:
            entries[key] = entry
            change += entry.nbytes
    return change


def _read(fd: int, offset: int, size: int) -> bytes:
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            raise LedgerError("the file shrank while it was read")
        chunks.append(chunk)
        offset, size = offset + len(chunk), size - len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _first_line(head: bytes) -> bytes:
    end = head.find(b"\n")
    if end < 0:
        raise LedgerError("no header line")
    return head[:end + 1]


def _check_header(header: bytes) -> None:
    obj = _loads(header)
    if not isinstance(obj, dict) or set(obj) != {KEY_FORMAT, KEY_VERSION, KEY_GENERATION}:
        raise LedgerError("not an accounting header")
    if obj[KEY_FORMAT] != ACCOUNTING_FORMAT or obj[KEY_VERSION] != ACCOUNTING_VERSION:
        raise LedgerError(f"format {obj[KEY_FORMAT]!r} version {obj[KEY_VERSION]!r}")
    if not isinstance(obj[KEY_GENERATION], str) or not _GENERATION.fullmatch(
            obj[KEY_GENERATION]):
        raise LedgerError("not a generation")


def _parse(data: bytes) -> list[tuple[str, Entry | None]]:
    """The records of whole lines (one JSON object each); a torn or invalid one raises."""
    if not data:
        return []
    if not data.endswith(b"\n"):
        raise LedgerError("a torn last record")
    objs = _loads(b"[" + data[:-1].replace(b"\n", b",") + b"]")
    if not isinstance(objs, list) or len(objs) != data.count(b"\n"):
        raise LedgerError("not one record per line")
    return [_record(obj) for obj in objs]


def _record(obj: Any) -> tuple[str, Entry | None]:
    if not isinstance(obj, dict):
        raise LedgerError("a record that is not an object")
    if set(obj) == {KEY_REMOVE}:
        return _key(obj[KEY_REMOVE]), None
    if set(obj) != {KEY_ADD, KEY_BYTES, KEY_INSTALLED}:
        raise LedgerError("a record of unknown keys")
    nbytes, installed = obj[KEY_BYTES], obj[KEY_INSTALLED]
    if type(nbytes) is not int or not 0 <= nbytes < _MAX_BYTES_VALUE:
        raise LedgerError("a size that is not a plausible count of bytes")
    if type(installed) not in (int, float) or not math.isfinite(installed):
        raise LedgerError("a time that is not a finite number")
    return _key(obj[KEY_ADD]), Entry(nbytes, float(installed))


def _key(value: Any) -> str:
    if not isinstance(value, str) or not KEY_PATTERN.fullmatch(value):
        raise LedgerError("an entry that does not name a shard of this cache")
    return value


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as error:  # (UnicodeDecodeError is a ValueError)
        raise LedgerError(f"not JSON: {error}") from error


def _line(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _record_line(key: str, entry: Entry | None) -> bytes:
    if entry is None:
        return _line({KEY_REMOVE: key})
    return _line({KEY_ADD: key, KEY_BYTES: entry.nbytes, KEY_INSTALLED: entry.installed})


__all__ = ["ACCOUNTING_NAME", "COMPACT_SLACK", "DATASET_NAME", "KEY_PATTERN",
           "MAX_ACCOUNTING_BYTES", "SHARD_FILE", "Entry", "Ledger", "LedgerError"]
