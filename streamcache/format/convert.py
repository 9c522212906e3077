"""``streamcache convert``: existing data into streamcache shards.

Sources: Parquet and Arrow IPC files (a file, a folder or a glob), JSON Lines (optionally
zstd-compressed), an image folder laid out as torchvision's ImageFolder (one sample per file,
the label from the sub-folder), and numpy arrays (.npy / .npz; the first axis is the sample).
Columnar sources stream record batches straight into :meth:`ShardWriter.write_batch`, so no
per-sample Python runs; decoding (pyarrow's threads) and encoding (the writer's thread) use
both cores.
"""

from __future__ import annotations

import io
import posixpath
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.json as pj
import pyarrow.parquet as pq

from ..errors import EmptyDatasetError, SchemaError, SourceError
from ..progress import ProgressLine
from ..remote import storage
from ..units import parse_size, plural
from .discovery import HF_SIDE_FILES
from .index import INDEX_NAME, DatasetIndex, load_index
from .schema import Field, Schema
from .writer import DEFAULT_SHARD_SIZE, ShardWriter

FORMATS = ("parquet", "arrow", "jsonl", "imagefolder", "numpy")
_SUFFIXES = {
    ".parquet": "parquet", ".parq": "parquet", ".pq": "parquet",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".arrows": "arrow",
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".jsonl.zst": "jsonl", ".json.zst": "jsonl", ".ndjson.zst": "jsonl",
    ".npy": "numpy", ".npz": "numpy",
}
_BATCH_ROWS = 4096


@dataclass
class ConvertReport:
    """What a conversion produced."""

    samples: int
    shards: int
    bytes_written: int
    raw_bytes: int
    seconds: float
    url: str

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mb_per_second(self) -> float:
        return self.raw_bytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        return (f"converted {plural(self.samples, 'sample')} into {plural(self.shards, 'shard')} "
                f"at {self.url}: "
                f"{self.bytes_written / 1e6:.1f} MB stored ({self.raw_bytes / 1e6:.1f} MB raw) "
                f"in {self.seconds:.2f} s, {self.samples_per_second:,.0f} samples/s, "
                f"{self.mb_per_second:.1f} MB/s")


class Progress:
    """Reports conversion progress to a stream at most once a second: a line redrawn in
    place on a terminal, whole lines in a log (see :class:`~streamcache.progress.ProgressLine`)."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.started = time.perf_counter()
        self._last = 0.0
        self._line = ProgressLine(stream, "converting", unit="samples")

    def update(self, samples: int, raw_bytes: int) -> None:
        now = time.perf_counter()
        if self.stream is None or now - self._last < 1.0:
            return
        self._last = now
        rate = raw_bytes / 1e6 / max(now - self.started, 1e-9)
        self._line.update(samples, f"{raw_bytes / 1e6:,.1f} MB, {rate:,.1f} MB/s", force=True)

    def done(self) -> None:
        self._line.close()


def _suffix_format(path: str) -> str | None:
    lower = path.lower()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix):
            return _SUFFIXES[suffix]
    return None


def _is_side_file(path: str) -> bool:
    """Files beside the data that are never data: hidden, ``_SUCCESS``-style, ``index.json``,
    and the JSON files Hugging Face ``save_to_disk`` writes beside its Arrow files."""
    name = posixpath.basename(path.rstrip("/"))
    return name.startswith((".", "_")) or name == INDEX_NAME or name in HF_SIDE_FILES


def detect_format(fs: Any, path: str) -> str:
    """The source format of a file, folder or glob, from file suffixes and layout.

    Side files (see :func:`_is_side_file`, e.g. the ``index.json`` that ``streamcache index``
    writes) are not data and do not count.
    """
    if any(ch in path for ch in "*?["):
        matches = [p for p in fs.glob(path) if not _is_side_file(p)]
        found = {_suffix_format(p) for p in matches} - {None}
    elif fs.isfile(path):
        found = {_suffix_format(path)} - {None}
    elif fs.isdir(path):
        files = [p for p in fs.find(path) if not _is_side_file(p)]
        found = {_suffix_format(p) for p in files} - {None}
        if not found and any(fs.isdir(p) for p in fs.ls(path, detail=False)):
            return "imagefolder"
    else:
        raise SourceError(f"nothing at {path}")
    if len(found) != 1:
        raise SourceError(
            f"cannot tell the format of {path} (found {sorted(str(f) for f in found) or 'none'}); "
            f"pass format= (--format) one of {FORMATS}"
        )
    return str(found.pop())


def _source_files(fs: Any, path: str, fmt: str) -> list[str]:
    if any(ch in path for ch in "*?["):
        files = fs.glob(path)
    elif fs.isdir(path):
        files = fs.find(path)
    else:
        files = [path]
    chosen = sorted(p for p in files if _suffix_format(p) == fmt and not _is_side_file(p))
    if not chosen:
        raise SourceError(f"no {fmt} files at {path}")
    return chosen


def _indexed_source(fs: Any, path: str, src: str,
                    storage_options: Mapping[str, Any] | None) -> DatasetIndex | None:
    """The index of ``src`` when it is an indexed folder (or its index.json), else None."""
    if any(ch in path for ch in "*?["):
        return None
    if posixpath.basename(path.rstrip("/")) == INDEX_NAME and fs.isfile(path):
        return load_index(src, storage_options)
    if fs.isdir(path) and fs.isfile(storage.join(path, INDEX_NAME)):
        return load_index(src, storage_options)
    return None


def _indexed_batches(index: DatasetIndex, fields: Sequence[str] | None,
                     storage_options: Mapping[str, Any] | None) -> Iterator[pa.RecordBatch]:
    """The rows of every shard the index lists, in index order (only its fields)."""
    names = list(fields) if fields else index.schema.names
    for number, shard in enumerate(index.shards):
        fs, path = storage.filesystem(index.shard_url(number), storage_options)
        reader = _parquet_batches if shard.format == "parquet" else _arrow_batches
        yield from reader(fs, [path], names)


def _parquet_batches(fs: Any, files: Sequence[str], fields: Sequence[str] | None,
                     ) -> Iterator[pa.RecordBatch]:
    for path in files:
        with fs.open(path, "rb") as f:
            yield from pq.ParquetFile(f).iter_batches(batch_size=_BATCH_ROWS, columns=fields)


def _arrow_batches(fs: Any, files: Sequence[str], fields: Sequence[str] | None,
                   ) -> Iterator[pa.RecordBatch]:
    for path in files:
        with fs.open(path, "rb") as f:
            data = pa.py_buffer(f.read())
        try:
            reader: Any = ipc.open_file(data)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            batches = iter(ipc.open_stream(data))
        for batch in batches:
            yield batch.select(fields) if fields else batch


def _jsonl_batches(fs: Any, files: Sequence[str], fields: Sequence[str] | None,
                   ) -> Iterator[pa.RecordBatch]:
    for path in files:
        with fs.open(path, "rb") as raw:
            stream: Any = raw
            if path.lower().endswith(".zst"):
                import zstandard

                stream = zstandard.ZstdDecompressor().stream_reader(raw)
            reader = pj.open_json(pa.PythonFile(stream, mode="r"),
                                  read_options=pj.ReadOptions(block_size=1 << 22))
            for batch in reader:
                yield batch.select(fields) if fields else batch


def _numpy_arrays(fs: Any, files: Sequence[str]) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for path in files:
        if storage.is_local(fs) and path.endswith(".npy"):
            arrays[posixpath.basename(path)[:-4]] = np.load(path, mmap_mode="r")
            continue
        with fs.open(path, "rb") as f:
            loaded = np.load(io.BytesIO(f.read()), allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            arrays[posixpath.basename(path)[:-4]] = loaded
        else:
            arrays.update({k: loaded[k] for k in loaded.files})
    lengths = {name: len(a) if a.ndim else -1 for name, a in arrays.items()}
    if len(set(lengths.values())) != 1 or -1 in lengths.values():
        raise SourceError(f"numpy arrays must share their first (sample) axis; got {lengths}")
    return arrays


def _numpy_batches(arrays: Mapping[str, np.ndarray], fields: Sequence[str] | None,
                   ) -> tuple[Schema, Iterator[pa.RecordBatch]]:
    names = list(fields) if fields else list(arrays)
    schema = Schema(Field.tensor(n, arrays[n].dtype, arrays[n].shape[1:]) for n in names)
    total = len(arrays[names[0]])

    def batches() -> Iterator[pa.RecordBatch]:
        from .columns import build_column

        for start in range(0, total, _BATCH_ROWS):
            columns = [build_column(f, np.ascontiguousarray(arrays[f.name][start:start
                                                                            + _BATCH_ROWS]))
                       for f in schema]
            yield pa.RecordBatch.from_arrays(columns, schema=schema.arrow_schema())

    return schema, batches()


def _imagefolder_batches(fs: Any, root: str) -> tuple[Schema, Iterator[pa.RecordBatch]]:
    root = root.rstrip("/")
    classes = sorted(posixpath.basename(p) for p in fs.ls(root, detail=False) if fs.isdir(p)
                     and not posixpath.basename(p).startswith((".", "_")))
    if not classes:
        raise SourceError(f"{root} has no class sub-folders (expected ROOT/CLASS/FILE)")
    items = [(p, label) for label, name in enumerate(classes)
             for p in sorted(fs.find(posixpath.join(root, name)))
             if not posixpath.basename(p).startswith(".")]
    schema = Schema([Field("image", "bytes"), Field.tensor("label", "int64"),
                     Field("path", "str")])

    def batches() -> Iterator[pa.RecordBatch]:
        with ThreadPoolExecutor(max_workers=8) as pool:
            for start in range(0, len(items), 256):
                chunk = items[start:start + 256]
                blobs = list(pool.map(lambda item: fs.cat_file(item[0]), chunk))
                yield pa.RecordBatch.from_arrays(
                    [pa.array(blobs, pa.large_binary()),
                     pa.array([label for _, label in chunk], pa.int64()),
                     pa.array([p[len(root) + 1:] for p, _ in chunk], pa.large_string())],
                    schema=schema.arrow_schema(),
                )

    return schema, batches()


def convert(src: str, dst: str, *, format: str | None = None,
            fields: Sequence[str] | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
            compression: str | None = "zstd", overwrite: bool = False,
            storage_options: Mapping[str, Any] | None = None,
            progress: TextIO | None = None) -> ConvertReport:
    """Convert ``src`` (see the module docstring) into a streamcache dataset at ``dst``.

    A folder that ``streamcache index`` has indexed (or its ``index.json``) converts as its
    index describes: the shards it lists, in its order, with its schema (``fields`` selects
    from it); files it leaves out are not read.

    Args:
        format: one of FORMATS; detected from the index, or from suffixes and layout, when
            None.
        fields: columns / arrays to keep (default: all).
        progress: a stream for a one-line progress report (None: silent).

    Raises:
        SourceError: the source is missing, unreadable or of an unknown format.
        SchemaError: a column's type is unsupported (the message names it).
        EmptyDatasetError: the source holds no samples (nothing is published).
        DestinationError: ``dst`` is not writable or already holds a dataset.
    """
    fs, path = storage.filesystem(src, storage_options)
    indexed = _indexed_source(fs, path, src, storage_options) if format is None else None
    fmt = "indexed" if indexed is not None else format or detect_format(fs, path)
    if fmt not in FORMATS and indexed is None:
        raise SourceError(f"unknown source format {fmt!r}; use one of {FORMATS}")
    schema: Schema | None = None
    if indexed is not None:
        schema = indexed.schema.select(fields)
        batches = _indexed_batches(indexed, fields, storage_options)
    elif fmt == "imagefolder":
        schema, batches = _imagefolder_batches(fs, path)
    elif fmt == "numpy":
        schema, batches = _numpy_batches(_numpy_arrays(fs, _source_files(fs, path, fmt)), fields)
    else:
        reader = {"parquet": _parquet_batches, "arrow": _arrow_batches,
                  "jsonl": _jsonl_batches}[fmt]
        batches = reader(fs, _source_files(fs, path, fmt), fields)
    meter = Progress(progress)
    started = time.perf_counter()
    with ShardWriter(dst, schema=schema, shard_size=shard_size, compression=compression,
                     overwrite=overwrite, storage_options=storage_options) as writer:
        raw = 0
        try:
            for batch in batches:
                writer.write_batch(batch)
                raw += batch.nbytes
                meter.update(writer.stats.samples, raw)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, ValueError) as exc:
            if isinstance(exc, SchemaError):
                raise
            raise SourceError(f"cannot read {src} as {fmt}: {exc}") from exc
        if writer.stats.samples == 0:
            raise EmptyDatasetError(f"{src} holds no samples; nothing was written")
    meter.done()
    index = writer.index
    assert index is not None
    return ConvertReport(index.num_samples, len(index.shards), writer.stats.bytes_written,
                         writer.stats.raw_bytes, time.perf_counter() - started, index.url)


__all__ = ["FORMATS", "ConvertReport", "convert", "detect_format", "parse_size"]
