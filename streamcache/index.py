"""The dataset index: ``index.json`` beside the shards.

It lists every shard (path relative to the index, format, rows, bytes, checksum), the schema
and a fingerprint of the whole, under a format version. Loading is strict: a missing key, an
unknown version or a fingerprint that does not match the content is a clear error.

:func:`build_index` makes an index for Parquet or Arrow IPC files written by anyone, reading
only their footers (in parallel), so existing data streams without conversion.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from . import storage
from .checksum import checksum_bytes, checksum_file
from .columns import field_from_arrow
from .errors import (
    EmptyDatasetError,
    IndexFormatError,
    IndexNotFoundError,
    SchemaError,
    SourceError,
)
from .schema import Schema

INDEX_NAME = "index.json"
FORMAT_NAME = "streamcache-index"
FORMAT_VERSION = 1
SHARD_FORMATS = ("arrow", "parquet")
_PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc", ".arrows")


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the index records it."""

    path: str  # relative to the index's folder, or an absolute URL
    format: str  # "arrow" or "parquet"
    rows: int
    bytes: int
    checksum: str | None = None  # "xxh64:<hex>" of the object's bytes; None: size only
    compression: str | None = None  # of the stored buffers, for information
    raw_bytes: int | None = None  # uncompressed size of the data, when known

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "format": self.format, "rows": self.rows, "bytes": self.bytes,
            "checksum": self.checksum, "compression": self.compression,
            "raw_bytes": self.raw_bytes,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ShardInfo:
        shard = cls(
            path=str(obj["path"]), format=str(obj["format"]), rows=int(obj["rows"]),
            bytes=int(obj["bytes"]), checksum=obj.get("checksum"),
            compression=obj.get("compression"), raw_bytes=obj.get("raw_bytes"),
        )
        if shard.format not in SHARD_FORMATS:
            raise IndexFormatError(f"shard {shard.path!r} has unknown format {shard.format!r}")
        if shard.rows < 0 or shard.bytes < 0:
            raise IndexFormatError(f"shard {shard.path!r} has a negative row or byte count")
        return shard


@dataclass(frozen=True)
class DatasetIndex:
    """The parsed ``index.json`` of a dataset. ``url`` is where it was loaded from."""

    schema: Schema
    shards: tuple[ShardInfo, ...]
    fingerprint: str = ""
    url: str = ""
    created: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", compute_fingerprint(self.schema, self.shards))

    @property
    def num_samples(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def shard_rows(self) -> np.ndarray:
        return np.fromiter((s.rows for s in self.shards), dtype=np.int64, count=len(self.shards))

    @property
    def root(self) -> str:
        """The folder URL that relative shard paths are resolved against."""
        return posixpath.dirname(self.url) if self.url.endswith(INDEX_NAME) else self.url

    def shard_url(self, shard: int | ShardInfo) -> str:
        info = self.shards[shard] if isinstance(shard, int) else shard
        return storage.join(self.root, info.path)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "created": self.created or time.time(),
            "num_samples": self.num_samples,
            "schema": self.schema.to_json(),
            "shards": [s.to_json() for s in self.shards],
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1) + "\n").encode()


def compute_fingerprint(schema: Schema, shards: Sequence[ShardInfo]) -> str:
    """A digest of what decides the data: schema, shard paths, rows, sizes and checksums."""
    content = {
        "version": FORMAT_VERSION,
        "schema": schema.to_json(),
        "shards": [[s.path, s.format, s.rows, s.bytes, s.checksum] for s in shards],
    }
    return checksum_bytes(json.dumps(content, sort_keys=True).encode())


def index_url(url: str) -> str:
    """The index.json URL for a dataset URL (a folder, or the index file itself)."""
    return url if url.rstrip("/").endswith(INDEX_NAME) else storage.join(url, INDEX_NAME)


def parse_index(raw: bytes, url: str) -> DatasetIndex:
    """Parse and validate index bytes; every problem names ``url`` and what to do."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexFormatError(
            f"{url} is not valid JSON ({exc}); the index is corrupt: rebuild it with "
            "`streamcache index` or rewrite the dataset"
        ) from exc
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise IndexFormatError(f"{url} is not a streamcache index (no 'format': '{FORMAT_NAME}')")
    version = obj.get("version")
    if version != FORMAT_VERSION:
        raise IndexFormatError(
            f"{url} has index format version {version!r}; this streamcache reads version "
            f"{FORMAT_VERSION}: upgrade streamcache or rebuild the index"
        )
    try:
        schema = Schema.from_json(obj["schema"])
        shards = tuple(ShardInfo.from_json(s) for s in obj["shards"])
        recorded = str(obj["fingerprint"])
    except (KeyError, TypeError, ValueError) as exc:
        raise IndexFormatError(f"{url} is missing or has a malformed key: {exc}") from exc
    index = DatasetIndex(schema, shards, url=url, created=float(obj.get("created", 0.0)))
    if index.fingerprint != recorded:
        raise IndexFormatError(
            f"{url}: the recorded fingerprint {recorded} does not match its content "
            f"({index.fingerprint}); the index was edited or damaged: rebuild it"
        )
    if index.num_samples == 0:
        raise EmptyDatasetError(f"the dataset at {url} has no samples")
    return index


def load_index(url: str, storage_options: Mapping[str, Any] | None = None) -> DatasetIndex:
    """Load a dataset's index from a folder URL or an index.json URL."""
    target = index_url(url)
    fs, path = storage.filesystem(target, storage_options)
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise IndexNotFoundError(
            f"no {INDEX_NAME} at {target}: write the dataset with ShardWriter / "
            "`streamcache convert`, or build an index for existing Parquet/Arrow files with "
            f"`streamcache index {url}`"
        ) from None
    return parse_index(raw, storage.unstrip(fs, path))


def save_index(index: DatasetIndex, url: str, storage_options: Mapping[str, Any] | None = None,
               ) -> str:
    """Publish ``index`` atomically at ``url`` (folder or index.json); returns its URL."""
    target = index_url(url)
    fs, path = storage.filesystem(target, storage_options)
    storage.publish_bytes(fs, path, index.dumps())
    return storage.unstrip(fs, path)


# ---------------------------------------------------------------- indexing existing files


def _shard_format(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(_ARROW_SUFFIXES):
        return "arrow"
    return None


def _hidden(relative: str) -> bool:
    """Spark/Hive side files (_SUCCESS, _metadata, .crc, ._x) are not data."""
    return any(part.startswith(("_", ".")) for part in relative.split("/"))


def discover_files(url: str, storage_options: Mapping[str, Any] | None = None,
                   ) -> tuple[Any, str, list[str]]:
    """Data files under a folder (recursively, Hive partitions included) or matching a glob.

    Returns (filesystem, root folder, sorted paths). Side files are skipped.
    """
    fs, path = storage.filesystem(url, storage_options)
    if any(ch in path for ch in "*?["):
        root = path.split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)[0]
        found = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        root = path.rstrip("/")
        found = [p for p in fs.find(path) if _shard_format(p)]
    elif fs.exists(path):
        root, found = posixpath.dirname(path), [path]
    else:
        raise SourceError(f"nothing at {url}: give a folder, a glob, or a file")
    files = sorted(p for p in found if _shard_format(p) and not _hidden(p[len(root):]))
    if not files:
        raise SourceError(f"no Parquet or Arrow IPC files found at {url}")
    return fs, root, files


def _footer_info(fs: Any, path: str, root: str) -> tuple[ShardInfo, pa.Schema, str]:
    fmt = _shard_format(path)
    size = int(fs.size(path))
    relative = path[len(root):].lstrip("/") if path.startswith(root) else storage.unstrip(fs, path)
    with fs.open(path, "rb") as f:
        try:
            if fmt == "parquet":
                meta = pq.ParquetFile(f).metadata
                rows, arrow_schema = meta.num_rows, meta.schema.to_arrow_schema()
                raw = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
                compression = _parquet_compression(meta)
            else:
                reader = ipc.open_file(f)
                rows = sum(reader.get_record_batch(i).num_rows
                           for i in range(reader.num_record_batches))
                arrow_schema, raw, compression = reader.schema, None, None
        except (pa.ArrowInvalid, OSError) as exc:
            raise SourceError(
                f"{storage.unstrip(fs, path)} is not a readable {fmt} file: {exc}"
            ) from exc
    info = ShardInfo(relative, str(fmt), rows, size, None, compression, raw)
    return info, arrow_schema, storage.unstrip(fs, path)


def _parquet_compression(meta: Any) -> str | None:
    if meta.num_row_groups == 0 or meta.num_columns == 0:
        return None
    codec = str(meta.row_group(0).column(0).compression).lower()
    return None if codec == "uncompressed" else codec


def _schema_of(arrow_schema: pa.Schema, fields: Sequence[str] | None, where: str) -> Schema:
    names = list(fields) if fields is not None else arrow_schema.names
    missing = [n for n in names if n not in arrow_schema.names]
    if missing:
        raise SchemaError(f"{where} has no column(s) {missing}; it has {arrow_schema.names}")
    return Schema(field_from_arrow(arrow_schema.field(n)) for n in names)


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
        SchemaError: files disagree on the schema, or a column type is unsupported.
    """
    fs, root, files = discover_files(url, storage_options)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        infos = list(pool.map(lambda p: _footer_info(fs, p, root), files))
    _, first_schema, first_url = infos[0]
    schema = _schema_of(first_schema, fields, first_url)
    for _, arrow_schema, where in infos[1:]:
        other = _schema_of(arrow_schema, schema.names, where)
        if other != schema:
            diff = [f"{a.name}: {a.kind} {a.dtype} {list(a.shape)} vs {b.kind} {b.dtype} "
                    f"{list(b.shape)}" for a, b in zip(schema, other, strict=True) if a != b]
            raise SchemaError(
                f"{where} does not match the schema of {first_url}: {'; '.join(diff)}"
            )
    shards = [info for info, _, _ in infos]
    target = output or storage.unstrip(fs, root)
    if output is not None and storage.filesystem(output, storage_options)[1].rstrip("/") != root:
        # the index lives elsewhere: name every file by its full URL
        shards = [replace(s, path=storage.unstrip(fs, storage.join(root, s.path))) for s in shards]
    if checksums:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            shards = list(pool.map(lambda s: _with_checksum(fs, root, s), shards))
    index = DatasetIndex(schema, tuple(shards), created=time.time())
    if index.num_samples == 0:
        raise EmptyDatasetError(f"the files at {url} hold no rows")
    if write:
        written = save_index(index, target, storage_options)
        index = replace(index, url=written)
    else:
        index = replace(index, url=index_url(target))
    return index


def _with_checksum(fs: Any, root: str, shard: ShardInfo) -> ShardInfo:
    full = storage.join(root, shard.path)
    if storage.is_local(fs):
        return replace(shard, checksum=checksum_file(full))
    return replace(shard, checksum=checksum_bytes(fs.cat_file(full)))




# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="folder or glob of Parquet / Arrow IPC files (any fsspec URL)")
    parser.add_argument("--fields", help="comma-separated columns to include (default: all)")
    parser.add_argument("--checksum", action="store_true",
                        help="read every file whole to record checksums (default: footers only)")
    parser.add_argument("--output", help="where to write index.json (default: the files' folder)")
    parser.add_argument("--threads", type=int, default=16, help="parallel footer reads")


def run(args: argparse.Namespace) -> int:
    fields = [f.strip() for f in args.fields.split(",")] if args.fields else None
    started = time.perf_counter()
    index = build_index(args.url, fields=fields, checksums=args.checksum, output=args.output,
                        threads=args.threads)
    elapsed = time.perf_counter() - started
    print(f"indexed {len(index.shards)} files, {index.num_samples} rows, "
          f"{index.total_bytes / 1e6:.1f} MB in {elapsed:.2f} s -> {index.url}")
    return 0


__all__ = [
    "INDEX_NAME",
    "DatasetIndex",
    "ShardInfo",
    "build_index",
    "discover_files",
    "index_url",
    "load_index",
    "parse_index",
    "save_index",
]


