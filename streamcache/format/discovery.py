"""Existing data files for :func:`~streamcache.format.index.build_index`: finding them and
reading their footers.

:func:`discover_files` finds the Parquet and Arrow IPC files under a folder (Hive partitions
included), matching a glob, or listed by the ``state.json`` of a folder that Hugging Face
``datasets.save_to_disk`` wrote; side files are skipped. :func:`footer_info` reads one file's
footer (an Arrow IPC stream, which has none, is read through) into a
:class:`~streamcache.format.shard_table.ShardInfo`, and :func:`common_schema` checks that the
files agree on the schema.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from ..errors import SchemaError, SourceError
from ..remote import storage
from .checksum import checksum_bytes, checksum_file
from .columns import field_from_arrow
from .index_format import read_capped
from .schema import Schema
from .shard_entry import ShardInfo
from .shard_paths import local_escape

_PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc", ".arrows")
HF_STATE = "state.json"  # beside the Arrow files of a Hugging Face `save_to_disk` folder
HF_DATASET_DICT = "dataset_dict.json"  # beside the split folders of a saved DatasetDict
HF_SIDE_FILES = (HF_STATE, "dataset_info.json", HF_DATASET_DICT)  # never data
_MAX_SIDE_JSON_BYTES = 16 << 20

#: (the shard, its Arrow schema, its URL, the nulls of each column: a count, or None when
#: the footer cannot tell and the column must be read to know)
FooterInfo = tuple[ShardInfo, pa.Schema, str, dict[str, int | None]]


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
        saved = _saved_by_hf_datasets(fs, root, url)
        found = saved if saved is not None else [p for p in fs.find(path) if _shard_format(p)]
    elif fs.exists(path):
        root, found = posixpath.dirname(path), [path]
    else:
        raise SourceError(f"nothing at {url}: give a folder, a glob, or a file")
    files = sorted(p for p in found if _shard_format(p) and not _hidden(p[len(root):]))
    if not files:
        raise SourceError(f"no Parquet or Arrow IPC files found at {url}")
    if storage.is_local(fs):
        _check_links(files, root)
    return fs, root, files


def _check_links(files: Sequence[str], root: str) -> None:
    """Refuse a data file that is a symbolic link (or lies below one) leading outside the
    folder being indexed: the index would name a file of the folder and the loader would
    read wherever the link points (e.g. another user's file)."""
    for path in files:
        outside = local_escape(path, root)
        if outside is not None:
            raise SourceError(
                f"{path} is a link to {outside}, outside the folder being indexed ({root}): "
                "streamcache indexes the files of the folder itself (links resolved); put "
                "the file itself there, or index the folder it lives in")


def _saved_by_hf_datasets(fs: Any, root: str, url: str) -> list[str] | None:
    """The data files of a folder written by Hugging Face ``datasets.save_to_disk``, in the
    order its ``state.json`` lists them; None for any other folder.

    Raises:
        SourceError: the folder holds a DatasetDict (several splits: index one), or its
            ``state.json`` is malformed or names a file that is not there.
    """
    if fs.exists(storage.join(root, HF_DATASET_DICT)):
        splits = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)
                        if fs.isdir(p))
        raise SourceError(
            f"{url} holds a Hugging Face DatasetDict (splits {splits}): index one split, e.g. "
            f"`streamcache index {storage.join(url.rstrip('/'), splits[0] if splits else 'train')}`"
        )
    state_path = storage.join(root, HF_STATE)
    if not fs.exists(state_path):
        return None
    try:
        state = json.loads(read_capped(fs, state_path, _MAX_SIDE_JSON_BYTES))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"{storage.unstrip(fs, state_path)} is not a Hugging Face datasets "
                          f"state file ({exc}); save the dataset again") from exc
    files = []
    for name in names:
        if not isinstance(name, str) or not _shard_format(name) or "/" in name or \
                name.startswith("."):
            raise SourceError(f"{storage.unstrip(fs, state_path)} lists {name!r}, not an Arrow "
                              "file beside it; save the dataset again")
        files.append(storage.join(root, name))
    missing = [f for f in files if not fs.exists(f)]
    if missing:
        raise SourceError(f"{storage.unstrip(fs, state_path)} lists {missing[0]}, which is "
                          "missing; save the dataset again")
    return files


def footer_info(fs: Any, path: str, root: str) -> FooterInfo:
    """One file's shard entry (its path relative to ``root``), Arrow schema, URL and the
    nulls of its columns (from a Parquet file's statistics; counted in the batches of an
    Arrow file or stream, which are read anyway).

    Raises:
        SourceError: the file is unreadable.
    """
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
                nulls = _parquet_nulls(meta, arrow_schema)
            else:
                fmt, rows, arrow_schema, raw, nulls = _arrow_rows(f)
                compression = None
        except (pa.ArrowInvalid, OSError) as exc:
            raise SourceError(
                f"{storage.unstrip(fs, path)} is not a readable {fmt} file: {exc}"
            ) from exc
    info = ShardInfo(relative, str(fmt), rows, size, None, compression, raw)
    return info, arrow_schema, storage.unstrip(fs, path), nulls


def _arrow_rows(f: Any) -> tuple[str, int, pa.Schema, int | None, dict[str, int | None]]:
    """(format, rows, schema, raw bytes or None, nulls per column) of an Arrow IPC file, or
    of a footer-less IPC stream such as Hugging Face ``save_to_disk`` writes (no footer: its
    batches are read)."""
    try:
        reader = ipc.open_file(f)
    except pa.ArrowInvalid:
        f.seek(0)
        stream = ipc.open_stream(f)
        rows = raw = 0
        nulls = dict.fromkeys(stream.schema.names, 0)
        for batch in stream:
            rows, raw = rows + batch.num_rows, raw + batch.nbytes
            _count_nulls(nulls, batch)
        return "arrow_stream", rows, stream.schema, raw, dict(nulls)
    rows = 0
    nulls = dict.fromkeys(reader.schema.names, 0)
    for i in range(reader.num_record_batches):
        batch = reader.get_record_batch(i)
        rows += batch.num_rows
        _count_nulls(nulls, batch)
    return "arrow", rows, reader.schema, None, dict(nulls)


def refused_nulls(array: pa.Array | pa.ChunkedArray) -> int:
    """The values of a column that no field may hold: nulls, null elements of its lists, and
    (Hugging Face Image/Audio) files referred to by path only, without their bytes."""
    if isinstance(array, pa.ChunkedArray):
        return sum(refused_nulls(chunk) for chunk in array.chunks)
    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    if pa.types.is_struct(array.type) and array.type.get_field_index("bytes") >= 0:
        # the bytes with the struct's own nulls applied: null where no bytes are embedded
        return int(array.flatten()[array.type.get_field_index("bytes")].null_count)
    count = array.null_count
    if isinstance(array, (pa.ListArray, pa.LargeListArray, pa.FixedSizeListArray)):
        count += array.flatten().null_count
    return int(count)


def _count_nulls(nulls: dict[str, int], batch: pa.RecordBatch) -> None:
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        nulls[name] += refused_nulls(column)


def _parquet_nulls(meta: Any, arrow_schema: pa.Schema) -> dict[str, int | None]:
    """The nulls of each column from a Parquet footer's statistics: a count for a flat
    column with statistics; None where they cannot tell (no statistics, or a list column,
    whose statistics count its empty lists too): the column is read to know."""
    nulls: dict[str, int | None] = dict.fromkeys(arrow_schema.names, 0)
    for group in range(meta.num_row_groups):
        row_group = meta.row_group(group)
        for column in range(row_group.num_columns):
            chunk = row_group.column(column)
            name, _, nested = chunk.path_in_schema.partition(".")
            stats = chunk.statistics
            if name not in nulls or nulls[name] is None:
                continue
            if stats is None or not stats.has_null_count:
                nulls[name] = None
            elif stats.null_count:
                nulls[name] = None if nested else (nulls[name] or 0) + stats.null_count
    return nulls


def check_nulls(fs: Any, infos: Sequence[FooterInfo], names: Sequence[str],
                threads: int) -> None:
    """Refuse a file whose columns ``names`` hold nulls (reading the columns whose footer
    could not tell).

    Raises:
        SchemaError: naming the file, the column and the count.
    """
    unknown = [(url, name) for _, _, url, nulls in infos for name in names
               if nulls.get(name, 0) is None]

    def count(item: tuple[str, str]) -> tuple[str, str, int]:
        url, name = item
        with fs.open(url, "rb") as f:
            return url, name, refused_nulls(pq.ParquetFile(f).read(columns=[name]).column(0))

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        counted = {(url, name): n for url, name, n in pool.map(count, unknown)}
    for _, arrow_schema, url, nulls in infos:
        for name in names:
            found = counted.get((url, name), nulls.get(name, 0))
            if not found:
                continue
            kind = arrow_schema.field(name).type
            if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
                raise SchemaError(
                    f"{url}: column {name!r} refers to {found} files by path only; embed their "
                    "bytes in the dataset before indexing (or leave the column out with "
                    "--fields)")
            raise SchemaError(
                f"{url}: column {name!r} holds {found} nulls (or null list elements); "
                "streamcache fields cannot be null: fill or drop them, or leave the column "
                "out with --fields")


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


def common_schema(infos: Sequence[FooterInfo], fields: Sequence[str] | None) -> Schema:
    """The schema (of ``fields``, default: all columns) that every file shares.

    Raises:
        SchemaError: files disagree on the schema, or a column type is unsupported.
    """
    _, first_schema, first_url, _ = infos[0]
    schema = _schema_of(first_schema, fields, first_url)
    for _, arrow_schema, where, _ in infos[1:]:
        other = _schema_of(arrow_schema, schema.names, where)
        if other != schema:
            diff = [f"{a.name}: {a.kind} {a.dtype} {list(a.shape)} vs {b.kind} {b.dtype} "
                    f"{list(b.shape)}" for a, b in zip(schema, other, strict=True) if a != b]
            raise SchemaError(
                f"{where} does not match the schema of {first_url}: {'; '.join(diff)}"
            )
    return schema


def with_checksum(fs: Any, root: str, shard: ShardInfo) -> ShardInfo:
    """``shard`` with the checksum of its file (read whole)."""
    full = storage.join(root, shard.path)
    if storage.is_local(fs):
        return replace(shard, checksum=checksum_file(full))
    return replace(shard, checksum=checksum_bytes(fs.cat_file(full)))
