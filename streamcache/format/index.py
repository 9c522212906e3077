"""The dataset index: ``index.json`` beside the shards.

It lists every shard (path relative to the index, format, rows, bytes, checksum), the schema
and a fingerprint of the whole, under a format version. From
:data:`~streamcache.format.index_format.SHARD_TABLE_MIN_SHARDS` shards on, the shard list is a
Parquet side file beside it (format version 2); in memory it is always a columnar
:class:`~streamcache.format.shard_table.ShardTable`.

An index is untrusted input. Loading is strict: a missing key, an unknown version, a value of
the wrong type or range, a document over :data:`MAX_INDEX_BYTES` or another cap (see
:mod:`~streamcache.format.index_format`), a fingerprint that does not match the content, or a
shard path outside the index's folder (see
:func:`~streamcache.format.shard_paths.check_shard_paths`) is an :class:`IndexFormatError`.

:func:`build_index` makes an index for Parquet or Arrow IPC files (or streams, such as Hugging
Face ``save_to_disk`` writes) by anyone, reading only their footers (in parallel; see
:mod:`~streamcache.format.discovery`), so existing data streams without conversion.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import EmptyDatasetError, IndexFormatError, IndexNotFoundError
from ..remote import storage
from ..remote.capped import read_capped as fetch_capped
from ..remote.options import FetchOptions
from .checksum import checksum_bytes
from .discovery import check_nulls, common_schema, discover_files, footer_info, with_checksum
from .index_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    SHARD_TABLE_PREFIX,
    TABLE_FORMAT_VERSION,
    ReadCapped,
    check_fingerprint,
    compute_fingerprint,
    decode_document,
    decode_header,
    decode_inline_table,
    fingerprint_inline,
    fingerprint_table,
    open_side_table,
    uses_side_table,
)
from .schema import Schema
from .shard_entry import SHARD_FORMATS, ShardInfo
from .shard_paths import check_same_filesystem, check_shard_paths, local_escape
from .shard_table import ShardTable

if TYPE_CHECKING:
    from ..remote.fetch import Fetcher

INDEX_NAME = "index.json"
MAX_INDEX_BYTES = 256 << 20  # index.json; a larger shard table belongs in a side file
SIDE_ROW_GROUP = 1 << 16  # shards per row group of a side file (decoded a group at a time)


@dataclass(frozen=True)
class DatasetIndex:
    """The parsed ``index.json`` of a dataset. ``url`` is where it was loaded from.

    ``shards`` may be given as any sequence of :class:`ShardInfo`; it is kept as a columnar
    :class:`ShardTable` (no Python object per shard).
    """

    schema: Schema
    shards: Sequence[ShardInfo]
    fingerprint: str = ""
    url: str = ""
    created: float = field(default=0.0, compare=False)
    #: Whether shard paths may lead outside the index's folder (``allow_external_paths``).
    external_paths: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            object.__setattr__(self, "shards", ShardTable.from_infos(self.shards))
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", compute_fingerprint(self.schema, self.shards))

    @property
    def shard_table(self) -> ShardTable:
        return cast(ShardTable, self.shards)

    @property
    def num_samples(self) -> int:
        return self.shard_table.total_rows

    @property
    def total_bytes(self) -> int:
        return int(self.shard_table.nbytes.sum(dtype=np.uint64))

    @property
    def shard_rows(self) -> np.ndarray:
        """Every shard's row count (int64, read-only)."""
        return self.shard_table.rows

    @property
    def root(self) -> str:
        """The folder URL that relative shard paths are resolved against."""
        return posixpath.dirname(self.url) if self.url.endswith(INDEX_NAME) else self.url

    def shard_url(self, shard: int | ShardInfo) -> str:
        """The URL of a shard (its path joined to :attr:`root`).

        Raises:
            IndexFormatError: a local shard named by a relative path is a symbolic link (or
                lies below one) that leads outside the index's folder, unless
                :attr:`external_paths` (a link planted in a shared folder must not make the
                loader read and serve another file; see
                :func:`~streamcache.format.shard_paths.local_escape`).
        """
        info = self.shards[shard] if isinstance(shard, int) else shard
        url = storage.join(self.root, info.path)
        if not self.external_paths and not storage.is_absolute_url(info.path):
            outside = local_escape(url, self.root)
            if outside is not None:
                raise IndexFormatError(
                    f"{url} is a link to {outside}, outside the dataset's folder {self.root}: "
                    "shards are read from inside the index's folder only (links resolved); "
                    "put the file itself there, or pass allow_external_paths=True to follow "
                    "the link")
        return url

    @property
    def has_side_table(self) -> bool:
        """Whether the shard table is stored as a Parquet side file (from
        :data:`~streamcache.format.index_format.SHARD_TABLE_MIN_SHARDS` shards on) rather than
        listed in index.json."""
        return uses_side_table(len(self.shards))

    def to_json(self, shard_table: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The index document; ``shard_table`` names the side file that holds the shards
        (required exactly when :attr:`has_side_table`)."""
        if (shard_table is not None) != self.has_side_table:
            raise ValueError("an index of this size needs a shard table file"
                             if self.has_side_table else "this index lists its shards inline")
        out: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": TABLE_FORMAT_VERSION if self.has_side_table else FORMAT_VERSION,
            # (recomputed: an index loaded from an older layout gets its new layout's digest)
            "fingerprint": compute_fingerprint(self.schema, self.shards),
            "created": self.created or time.time(),
            "num_samples": self.num_samples,
            "schema": self.schema.to_json(),
        }
        if shard_table is None:
            out["shards"] = self.shard_table.to_json()
        else:
            out["shard_table"] = dict(shard_table)
        return out

    def dumps(self, shard_table: Mapping[str, Any] | None = None) -> bytes:
        return (json.dumps(self.to_json(shard_table), indent=1) + "\n").encode()


def index_url(url: str) -> str:
    """The index.json URL for a dataset URL (a folder, or the index file itself)."""
    return url if url.rstrip("/").endswith(INDEX_NAME) else storage.join(url, INDEX_NAME)


def parse_index(raw: bytes, url: str, *, allow_external_paths: bool = False,
                read: ReadCapped | None = None, table_cache: str | None = None,
                ) -> DatasetIndex:
    """Parse and validate index bytes; every problem names ``url`` and what to do.

    Args:
        allow_external_paths: accept shard paths outside the index's folder (absolute paths
            or URLs of the index's own protocol); never a path of another protocol.
        read: ``read(url, limit)`` returns an object's bytes (more than ``limit`` when it is
            larger); used for a shard-table side file (default: fsspec).
        table_cache: a node cache folder: a side-file shard table is opened from the node's
            copy there (made from the side file once per node and dataset version:
            format/node_table.py) instead of being decoded in this process.

    Raises:
        IndexFormatError: malformed, oversized or too deeply nested JSON, a field of the wrong
            type or range, a fingerprint that does not match, a shard path outside the root.
        EmptyDatasetError: no samples.
    """
    obj = decode_document(raw, url, MAX_INDEX_BYTES)
    version, schema, recorded, created = decode_header(obj, url)
    if version == FORMAT_VERSION:
        shards = decode_inline_table(obj, url)
        actual = fingerprint_inline(schema, shards)
    else:  # (the table's digest is recorded with a node copy: no pass over the columns)
        shards = open_side_table(obj, url, schema, recorded, read, table_cache)
        actual = fingerprint_table(schema, shards)
    index = DatasetIndex(schema, shards, fingerprint=recorded, url=url, created=created,
                         external_paths=allow_external_paths)
    check_fingerprint(url, recorded, actual)
    stated = obj.get("num_samples", index.num_samples)
    if stated != index.num_samples or type(stated) is not int:
        raise IndexFormatError(f"{url} says num_samples={stated!r}, its shards hold "
                               f"{index.num_samples}; the index was edited or damaged: rebuild it")
    check_shard_paths(index.shard_table, url, index.root,
                      allow_external_paths=allow_external_paths)
    if index.num_samples == 0:
        raise EmptyDatasetError(f"the dataset at {url} has no samples")
    return index


def load_index(url: str, storage_options: Mapping[str, Any] | None = None, *,
               allow_external_paths: bool = False, fetch: FetchOptions | None = None,
               table_cache: str | None = None, fetcher: Fetcher | None = None) -> DatasetIndex:
    """Load a dataset's index from a folder URL or an index.json URL.

    ``allow_external_paths``: see
    :func:`~streamcache.format.shard_paths.check_shard_paths`. ``fetch``: the stall timeout
    and retries of the reads (see :class:`~streamcache.remote.options.FetchOptions`); a read that
    fails raises :class:`~streamcache.remote.retry.FetchError` naming the URL.
    ``table_cache``: see :func:`parse_index` (a :class:`~streamcache.StreamDataset` passes
    its ``cache_dir``). ``fetcher``: read with this :class:`~streamcache.remote.fetch.Fetcher`
    (left open; ``fetch`` and ``storage_options`` are then its own, see ``read_capped``).
    """
    target = index_url(url)
    fs, path = storage.filesystem(target, storage_options)
    try:
        raw = fetch_capped(storage.unstrip(fs, path), MAX_INDEX_BYTES,
                           options=fetch, storage_options=storage_options, fetcher=fetcher)
    except FileNotFoundError:
        raise IndexNotFoundError(
            f"no {INDEX_NAME} at {target}: write the dataset with ShardWriter / "
            "`streamcache convert`, or build an index for existing Parquet/Arrow files with "
            f"`streamcache index {url}`"
        ) from None

    def read(side_url: str, limit: int) -> bytes:
        try:
            return fetch_capped(side_url, limit, options=fetch, storage_options=storage_options,
                                fetcher=fetcher)
        except FileNotFoundError:
            raise IndexFormatError(f"{side_url}, the shard table of {target}, is missing: "
                                   "rebuild the index") from None

    return parse_index(raw, storage.unstrip(fs, path), allow_external_paths=allow_external_paths,
                       read=read, table_cache=table_cache)


def save_index(index: DatasetIndex, url: str, storage_options: Mapping[str, Any] | None = None,
               ) -> str:
    """Publish ``index`` atomically at ``url`` (folder or index.json); returns its URL.

    From :data:`~streamcache.format.index_format.SHARD_TABLE_MIN_SHARDS` shards on, the shards
    go to a Parquet side file beside index.json, named by its content and published first;
    index.json names it with its size and checksum, and its fingerprint covers the table's
    content.
    """
    target = index_url(url)
    fs, path = storage.filesystem(target, storage_options)
    side: dict[str, Any] | None = None
    side_path: str | None = None  # a side file this call adds (removed if nothing uses it)
    if index.has_side_table:
        sink = pa.BufferOutputStream()
        pq.write_table(index.shard_table.to_arrow(), sink, compression="zstd",
                       row_group_size=SIDE_ROW_GROUP)
        data = sink.getvalue().to_pybytes()
        checksum = checksum_bytes(data)
        name = f"{SHARD_TABLE_PREFIX}{checksum.partition(':')[2]}.parquet"
        side_path = storage.join(posixpath.dirname(path), name)
        if fs.exists(side_path):  # the same table published before (re-indexing): keep it
            side_path = None
        storage.publish_bytes(fs, storage.join(posixpath.dirname(path), name), data)
        side = {"path": name, "bytes": len(data), "checksum": checksum,
                "shards": len(index.shards)}
    document = index.dumps(side)
    try:
        storage.publish_bytes(fs, path, document)
    except BaseException:
        # not published (the index there is another, or none): the side file it added is
        # nobody's
        if side_path is not None and _holds(fs, path, document) is False:
            with contextlib.suppress(Exception):
                fs.rm_file(side_path)
        raise
    return storage.unstrip(fs, path)


def _holds(fs: Any, path: str, document: bytes) -> bool | None:
    """Whether ``path`` holds ``document`` now (None: it cannot be read)."""
    try:
        return bytes(fs.cat_file(path)) == document
    except FileNotFoundError:
        return False
    except Exception:
        return None


def build_index(url: str, *, fields: Sequence[str] | None = None, checksums: bool = False,
                output: str | None = None, storage_options: Mapping[str, Any] | None = None,
                threads: int = 16, write: bool = True) -> DatasetIndex:
    """Index existing Parquet / Arrow IPC files at ``url`` (folder or glob).

    Reads only footers (in ``threads`` parallel requests) unless ``checksums`` is set, which
    reads every file whole to record its checksum. Every file must have the same schema (for
    the selected ``fields``). The index is published at ``output`` (default: the files'
    common folder) unless ``write`` is false.

    Raises:
        SourceError: no files, or a file is unreadable.
        SchemaError: files disagree on the schema, a column type is unsupported, or a
            column holds nulls (found in the footers' statistics, or by reading the columns
            whose statistics cannot tell).
    """
    fs, root, files = discover_files(url, storage_options)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        infos = list(pool.map(lambda p: footer_info(fs, p, root), files))
    schema = common_schema(infos, fields)
    check_nulls(fs, infos, schema.names, threads)
    shards = [info for info, _, _, _ in infos]
    target = output or storage.unstrip(fs, root)
    if output is not None and storage.filesystem(output, storage_options)[1].rstrip("/") != root:
        # the index lives elsewhere: name every file by its full URL
        check_same_filesystem(output, storage.unstrip(fs, root), storage_options)
        shards = [replace(s, path=storage.unstrip(fs, storage.join(root, s.path))) for s in shards]
    if checksums:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            shards = list(pool.map(lambda s: with_checksum(fs, root, s), shards))
    index = DatasetIndex(schema, tuple(shards), created=time.time())
    if index.num_samples == 0:
        raise EmptyDatasetError(f"the files at {url} hold no rows")
    if write:
        written = save_index(index, target, storage_options)
        index = replace(index, url=written)
    else:
        index = replace(index, url=index_url(target))
    return index


__all__ = [
    "INDEX_NAME",
    "SHARD_FORMATS",
    "DatasetIndex",
    "ShardInfo",
    "build_index",
    "index_url",
    "load_index",
    "parse_index",
    "save_index",
]
