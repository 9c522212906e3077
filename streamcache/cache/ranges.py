"""Range reads: given rows of a remote shard, with the fewest bytes and requests.

A cold reader should not wait for whole shards to read a few of their rows. The
:class:`RangeReader` reads just those rows, in memory, installing nothing:

- a chunked Arrow IPC shard (written by ShardWriter; format/chunks.py): its tail (footer) in
  one request, verified against the index, then only the chunks holding the rows, byte ranges
  a few KiB apart coalesced, all fetched concurrently; every chunk is checked against its
  digest in the footer;
- a Parquet file of several row groups: its footer (one tail read, a second one only for a
  footer over 64 KiB), then the byte ranges of the row groups holding the rows;
- anything else (a one-batch Arrow file, an Arrow stream, a Parquet file of one row group):
  the whole object, verified by size and checksum like an install, kept in a small in-memory
  cache of decoded shards.

Requests go through the :class:`~streamcache.remote.fetch.Fetcher` (its concurrency bound,
stall timeouts, retries and errors); a chunk that fails its digest, or a footer that fails
its checksum, is fetched again like a body that fails its checksum, then raised as
:class:`~streamcache.errors.ChecksumMismatchError`. What cannot be checked on a partial read
is said in docs/cache.md ("Range reads"): for Parquet and for indexes without a chunk layout
there is no checksum short of the whole object, so a range read relies on the size in the
index and on the file's own structure (and Parquet page CRCs, where the writer wrote them).
Footers and the checks of a chunk are cache/shard_footers.py's; coalescing byte ranges and
the file of fetched pieces that pyarrow reads, cache/byte_ranges.py's.

Thread safety: every method may be called from any number of threads.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from .. import forksafe
from ..errors import RowOutOfRangeError, ShardCorruptError
from ..format.chunks import Block
from ..format.index import DatasetIndex
from ..format.materialize import decode_shard
from ..format.reader import ShardReader
from ..format.schema import Schema
from ..remote.fetch import Fetcher
from ..remote.retry import FetchError, ranges_ignored
from .byte_ranges import COALESCE_GAP, coalesce
from .memory_shard import MemoryShard
from .shard_footers import (
    Footer,
    arrow_footer,
    decode_unit,
    empty_batch,
    open_pieces,
    parquet_footer,
)

#: The most a cold start reads of a shard by range after its first steps, as a fraction of its
#: stored bytes, before it waits for the shard's install (:meth:`RangeReader.cold_budget_left`).
#: At 0, the default, the first steps (``dataset_reader.COLD_START_STEPS``, within
#: :data:`COLD_START_BUDGET`) are read by range, later ones wait for the installs, which range
#: reads slow down. It was 1/16 while each install fsynced its shard before publishing it;
#: since they do not wait for the disk (cache/durability.py) the later range reads cost more
#: than they saved: 100 KB samples 1,736-2,100 -> 2,615-2,679 samples/s over the first 4,096
#: on loopback, 280 -> 79 requests (benchmarks/RESULTS.md, 2026-12-06).
COLD_BUDGET = 0.0
#: The cold budget of the first steps of a cold start (``dense``): they are read by range
#: while the chunks the node's ranks need of a shard (a rank's times the node's ranks) stay
#: within this fraction of its stored bytes, ahead of the downloads; denser rows wait for the
#: shard's install (one download per node). Judged by the node's step, not a rank's part: at
#: 1/8 of a rank's coalesced bytes, 2 and 4 ranks read the token shards' first steps in
#: 400-620 requests beside their downloads, 1,800-3,000 samples/s against 4,200-4,400 without
#: (benchmarks/RESULTS.md, "The first steps judged by the node", 2026-12-06).
COLD_START_BUDGET = 1 / 16
#: Parsed footers kept (per reader), and decoded whole shards (bytes, per reader).
FOOTERS_KEPT = 256
WHOLE_SHARD_BYTES = 256 << 20


@dataclass
class RangeStats:
    """Counters of a :class:`RangeReader` (a snapshot; see :attr:`RangeReader.stats`).

    Attributes:
        shards: shard reads served (one per shard per batch).
        rows: rows served.
        chunks: chunks (or row groups) fetched.
        requests: range requests made for them (footers included; retries not counted).
        bytes: bytes those requests returned.
        whole: whole objects fetched (shards that are not addressable).
    """

    shards: int = 0
    rows: int = 0
    chunks: int = 0
    requests: int = 0
    bytes: int = 0
    whole: int = 0


class RangeReader:
    """Reads rows of a dataset's shards by range requests, into memory.

    Args:
        index: the dataset's index.
        fetcher: the Fetcher that makes the requests (its options decide timeouts, retries
            and the concurrency bound). Not closed by :meth:`close`.
        schema: the fields to read (default: all of the index's).
        threads: shards read at once by :meth:`read_many`.
        budget_share: the fraction of :data:`COLD_BUDGET` this reader may spend (default 1:
            the node's only reader).
        node_ranks: the ranks of this node, each reading its part of every step: the first
            steps' :data:`COLD_START_BUDGET` is a node's, split among them.

    Owns: a pool of ``threads`` named daemon threads (``streamcache-ranges-*``), started on
    first use and stopped by :meth:`close`. Fork: a child gets a new lock and pool on first
    use (the Fetcher makes its own fresh start).
    """

    def __init__(self, index: DatasetIndex, fetcher: Fetcher, *, schema: Schema | None = None,
                 threads: int = 16, budget_share: float = 1.0, node_ranks: int = 1) -> None:
        self.index = index
        #: This reader's share of the node's :data:`COLD_BUDGET` (1 / the node's reading
        #: processes): every process of a node has its own reader, and the budget bounds the
        #: node's range reads that its one install per shard makes redundant.
        self.budget_share = budget_share
        self.node_ranks = max(1, node_ranks)
        self.fetcher = fetcher
        self.schema = schema or index.schema
        self._threads = max(1, threads)
        self.coalesce_gap = COALESCE_GAP
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._footers: collections.OrderedDict[int, Footer] = collections.OrderedDict()
        self._footer_gates: dict[int, threading.Lock] = {}  # one fetch of a footer at a time
        self._whole: collections.OrderedDict[int, MemoryShard] = collections.OrderedDict()
        self._whole_bytes = 0
        self._stats = RangeStats()
        self._shard_bytes: dict[int, int] = {}  # bytes range-read per shard
        self._whole_only: set[int] = set()  # Parquet files found to have one row group
        #: Range reads of shards without per-range digests (Parquet, foreign Arrow) serve rows
        #: before anything verified them: only when the user allows it (FetchOptions).
        self.unverified = fetcher.options.allow_unverified_ranges
        self._ranges_ignored = False  # the server answered a range with the whole object
        forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._footer_gates = {}  # (a gate held by a parent's thread would never open here)
        self._pool = None  # (the parent's threads are not in this process)

    @property
    def stats(self) -> RangeStats:
        with self._lock:
            return RangeStats(**vars(self._stats))

    def addressable(self, shard: int) -> bool:
        """Whether rows of ``shard`` are read without its whole object: a chunked Arrow shard
        (every chunk verified against its digest before it is served), or, only with
        ``FetchOptions(allow_unverified_ranges=True)``, a Parquet file of several row groups
        (its footer is read to know). Never once the server was found to ignore ranges."""
        info = self.index.shards[shard]
        if self._ranges_ignored:
            return False
        if info.chunked:
            return info.chunk_rows is not None and info.chunk_rows < info.rows
        if not self.unverified or info.format != "parquet" or shard in self._whole_only:
            return False
        try:
            whole = self._footer(shard).whole
        except _RangesIgnored:
            return False
        if whole:
            self._whole_only.add(shard)  # (remembered beyond the footers kept)
            return False
        return True

    def verified(self, shard: int) -> bool:
        """Whether a range read of ``shard`` is verified before it is served (a chunked
        shard: its tail against the index, each chunk against the tail's digests)."""
        return bool(self.index.shards[shard].chunked)

    def cold_budget_left(self, shard: int, more: int = 0, budget: float | None = None,
                         ) -> bool:
        """Whether a cold start may still read ``shard`` by range: the bytes of rows
        range-read from it so far (its footer not counted), plus ``more``, stay within
        ``budget`` (default: this reader's share of :data:`COLD_BUDGET`) of its stored
        bytes."""
        with self._lock:
            used = self._shard_bytes.get(shard, 0)
        fraction = COLD_BUDGET * self.budget_share if budget is None else budget
        return fraction > 0 and used + more <= fraction * self.index.shards[shard].bytes

    def read_rows(self, shard: int, rows: np.ndarray, *, cold: bool = False,
                  dense: bool = False, source: bytes | None = None,
                  ) -> tuple[ShardReader, np.ndarray] | None:
        """Rows ``rows`` of ``shard``: an in-memory shard reader holding them (and perhaps
        their neighbours) and the row numbers to gather from it, in the order given.

        With ``source`` (the shard's whole stored bytes, downloaded and verified against the
        index's size and checksum, e.g. by an install still decoding them), the chunks are
        decoded from it instead of requested: no request, no cold budget (a chunked shard
        only: ValueError for another).

        With ``cold`` (the cold-start rule), None instead when the read would take the
        shard's range-read bytes over :data:`COLD_BUDGET` of its size (its footer is read to
        know; not with ``dense``: the first steps of a cold start): rows that dense in the
        shard are cheaper from the install. A cold read also declines (None) what only a
        whole object would serve: the install fetches that.

        Raises:
            FetchError: a request failed after the Fetcher's retries.
            ChecksumMismatchError: the footer or a chunk does not match what the index (or the
                footer) records, on every attempt: the object is corrupt or was rewritten.
            ShardCorruptError, SchemaError: the object is not the shard the index describes.
            RowOutOfRangeError: a row does not exist.
        """
        rows = np.asarray(rows, dtype=np.int64)
        info = self.index.shards[shard]
        if rows.size and (rows.min() < 0 or rows.max() >= info.rows):
            raise RowOutOfRangeError(f"rows {rows.min()}..{rows.max()} of shard {shard}: it "
                                     f"has {info.rows}")
        if source is not None:
            if not info.chunked or info.chunk_rows is None:
                raise ValueError(f"shard {shard} is not chunked: its rows are not read from "
                                 "its bytes by chunk")
            return self._by_range(shard, rows, None, source)
        if self.addressable(shard):
            try:
                # (the first steps' budget is the node's: each rank holds 1/node_ranks of a
                # step's rows, the later budget is split among every reading process)
                budget = (COLD_START_BUDGET / self.node_ranks if dense else
                          COLD_BUDGET * self.budget_share) if cold else None
                return self._by_range(shard, rows, budget, dense=dense)
            except _RangesIgnored:
                pass  # (the server ignores ranges: whole objects from now on)
        if cold:
            return None  # a cold start awaits the install, which is one request anyway
        reader = self._whole_shard(shard)
        self._count(shards=1, rows=int(rows.size))
        return reader, rows

    def _by_range(self, shard: int, rows: np.ndarray, budget: float | None,
                  source: bytes | None = None, dense: bool = False,
                  ) -> tuple[ShardReader, np.ndarray] | None:
        """:meth:`read_rows` of an addressable shard; with ``budget`` (a fraction of the
        shard), None when the read would take the shard's range-read bytes past it (``dense``:
        the chunks' own bytes, which do not depend on how near they lie); with ``source``,
        its chunks sliced from those bytes."""
        footer = self._footer(shard, source)
        units = np.searchsorted(footer.starts, rows, side="right") - 1
        needed = np.unique(units)
        spans = coalesce([footer.blocks[u] for u in needed.tolist()], self.coalesce_gap)
        wanted = sum(footer.blocks[u].length for u in needed.tolist()) if dense else \
            sum(s.length for s in spans)
        if budget is not None and not self.cold_budget_left(shard, wanted, budget):
            return None
        batches = self._read_units(shard, footer, needed.tolist(), spans, source)
        sizes = np.array([b.num_rows for b in batches], np.int64)
        local_starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        position = np.searchsorted(needed, units)
        local = local_starts[position] + rows - footer.starts[units]
        table = pa.Table.from_batches(batches, schema=self.schema.arrow_schema())
        batch = table.combine_chunks().to_batches()[0] if table.num_rows else \
            empty_batch(self.schema)
        self._count(shards=1, rows=int(rows.size), chunks=len(needed))
        return MemoryShard(batch, self.schema, where=self.index.shard_url(shard)), local

    def submit(self, shard: int, rows: np.ndarray, *, cold: bool = False, dense: bool = False,
               ) -> Future[tuple[ShardReader, np.ndarray] | None]:
        """:meth:`read_rows` on this reader's threads."""
        return self._executor().submit(self.read_rows, shard, rows, cold=cold, dense=dense)

    def read_many(self, requests: Sequence[tuple[int, np.ndarray]],
                  ) -> list[tuple[ShardReader, np.ndarray]]:
        """:meth:`read_rows` for several shards at once (concurrently), results in order."""
        if len(requests) <= 1:
            return [_read(self.read_rows(shard, rows)) for shard, rows in requests]
        futures = [self.submit(shard, rows) for shard, rows in requests]
        return [_read(future.result()) for future in futures]

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._footers.clear()
            self._whole.clear()
            self._whole_bytes = 0
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ footers

    def _footer(self, shard: int, source: bytes | None = None) -> Footer:
        with self._lock:
            footer = self._footers.get(shard)
            if footer is not None:
                self._footers.move_to_end(shard)
                return footer
            gate = self._footer_gates.setdefault(shard, threading.Lock())
        # A gate per shard is held across the fetch, on purpose: the threads that install a
        # shard's first units at once wait for one footer instead of each fetching it.
        with gate:
            with self._lock:
                footer = self._footers.get(shard)
            if footer is None:
                footer = self._fetch_footer(shard, source)
        with self._lock:
            if self._footer_gates.get(shard) is gate:
                del self._footer_gates[shard]
        return footer

    def _fetch_footer(self, shard: int, source: bytes | None = None) -> Footer:
        info = self.index.shards[shard]
        url = self.index.shard_url(shard)

        def fetch(ranges: list[tuple[int, int]], verify: Any = None) -> list[bytes]:
            return self._fetch(shard, url, ranges, verify, source, rows=False)

        footer = arrow_footer(info, url, self.index.schema, fetch) if info.chunked else \
            parquet_footer(info, url, fetch)
        with self._lock:
            self._footers[shard] = footer
            while len(self._footers) > FOOTERS_KEPT:
                self._footers.popitem(last=False)
        return footer

    # ------------------------------------------------------------------ chunks

    def _read_units(self, shard: int, footer: Footer, units: list[int], spans: list[Block],
                    source: bytes | None = None) -> list[pa.RecordBatch]:
        """Fetch ``spans`` of ``shard`` (or slice them from ``source``) and decode its chunks
        (or row groups) ``units``, verified."""
        info = self.index.shards[shard]
        url = self.index.shard_url(shard)
        if source is not None:  # (the download's checksum verified every byte already)
            try:
                file = ipc.open_file(pa.BufferReader(source),
                                     options=ipc.IpcReadOptions(use_threads=False))
            except (pa.ArrowInvalid, OSError) as exc:
                raise ShardCorruptError(f"{url}: its downloaded bytes are not an Arrow IPC "
                                        f"file ({exc})") from exc
            # (chunks are hashed only where the index records no checksum of the object)
            return [decode_unit(file, footer, u, url, self.index.schema, self.schema,
                                digest=info.checksum is None) for u in units]
        decoded: list[pa.RecordBatch] = []

        def verify(blocks: list[bytes]) -> None:
            pieces = footer.pieces + [(s.offset, b) for s, b in zip(spans, blocks, strict=True)]
            file = open_pieces(footer, info.bytes, pieces, url)
            decoded[:] = [decode_unit(file, footer, u, url, self.index.schema, self.schema)
                          for u in units]

        self._fetch(shard, url, [(s.offset, s.offset + s.length) for s in spans], verify,
                    source)
        return decoded

    # ------------------------------------------------------------------ whole objects

    def _whole_shard(self, shard: int) -> MemoryShard:
        with self._lock:
            reader = self._whole.get(shard)
            if reader is not None:
                self._whole.move_to_end(shard)
                return reader
        info = self.index.shards[shard]
        url = self.index.shard_url(shard)
        data = self.fetcher.fetch(url, size=info.bytes, checksum=info.checksum)
        self._count(requests=1, bytes=len(data), whole=1)
        batch = decode_shard(data, info.format, self.index.schema, where=url,
                             expected_rows=info.rows)
        batch = pa.RecordBatch.from_arrays([batch.column(f.name) for f in self.schema],
                                           schema=self.schema.arrow_schema())
        reader = MemoryShard(batch, self.schema, where=url)
        with self._lock:
            self._whole[shard] = reader
            self._whole_bytes += batch.nbytes
            while self._whole_bytes > WHOLE_SHARD_BYTES and len(self._whole) > 1:
                _, dropped = self._whole.popitem(last=False)
                self._whole_bytes -= dropped._batch.nbytes
        return reader

    # ------------------------------------------------------------------ helpers

    def _fetch(self, shard: int, url: str, ranges: list[tuple[int, int]], verify: Any = None,
               source: bytes | None = None, rows: bool = True) -> list[bytes]:
        """The bytes of ``ranges`` of ``shard``; counted in its cold budget where they hold
        ``rows`` (a footer does not: each process reads its own, whatever its budget)."""
        if source is not None:  # (downloaded already: sliced, no request, no budget used)
            blocks = [bytes(source[start:end]) for start, end in ranges]
            if any(len(block) != end - start for block, (start, end) in zip(
                    blocks, ranges, strict=True)):
                raise ShardCorruptError(f"{url}: its downloaded bytes ({len(source)}) end "
                                        "before a part its index or footer lists")
            if verify is not None:
                verify(blocks)
            return blocks
        try:
            blocks = self.fetcher.fetch_ranges(url, ranges, verify=verify)
        except FetchError as error:
            if not ranges_ignored(error):
                raise
            with self._lock:
                self._ranges_ignored = True
            raise _RangesIgnored(str(error)) from error
        nbytes = sum(len(b) for b in blocks)
        self._count(requests=len(ranges), bytes=nbytes)
        with self._lock:
            self._shard_bytes[shard] = self._shard_bytes.get(shard, 0) + nbytes * rows
        return blocks

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads,
                                                thread_name_prefix="streamcache-ranges")
            return self._pool


class _RangesIgnored(Exception):
    """The server answered a range request with more than was asked (it ignores ``Range``)."""


def _read(result: tuple[ShardReader, np.ndarray] | None) -> tuple[ShardReader, np.ndarray]:
    assert result is not None  # (only a cold read may decline)
    return result


__all__ = ["MemoryShard", "RangeReader", "RangeStats"]
