"""A chunked shard read where it lies, opened lazily (streamcache/format/lazy_chunks.py).

The contract: every row reads as an eager open reads it, whichever chunks were parsed before,
on any thread; a chunk is parsed only when a read needs one of its rows; and what an eager
open refuses at open (a chunk that does not parse, offsets outside their values, a null, a
chunk of another row count than the index says) is refused when that chunk is first read,
with the same error, while the shard's other chunks still read. The adversarial side: files
whose chunks contradict the index, are truncated, corrupted in one chunk, or of another type.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from format_helpers import backend  # noqa: F401  (fixture)
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import ShardWriter
from streamcache.errors import SchemaError, ShardCorruptError
from streamcache.format.index import load_index
from streamcache.format.reader import ShardReader, gather
from streamcache.format.schema import Field, Schema

SCHEMA = Schema([Field("x", "tensor", "int32", (3,)), Field("tokens", "sequence", "int64"),
                 Field("blob", "bytes")])


def _rows(count: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.integers(-9, 9, 3).astype(np.int32),
             "tokens": rng.integers(0, 1000, int(rng.integers(0, 12))).astype(np.int64),
             "blob": rng.bytes(int(rng.integers(0, 300)))} for _ in range(count)]


def _write(folder: Path, rows: list[dict[str, Any]], chunk_size: int) -> tuple[str, int, int]:
    """One uncompressed shard of ``rows`` in chunks: (its path, rows, the index's chunk_rows)."""
    with ShardWriter(str(folder), schema=SCHEMA, compression=None,
                     chunk_size=chunk_size) as writer:
        for row in rows:
            writer.write(row)
    index = load_index(str(folder))
    assert len(index.shards) == 1
    entry = index.shards[0]
    assert entry.chunk_rows is not None
    return os.path.join(str(folder), entry.path), entry.rows, entry.chunk_rows


def _lazy(path: str, rows: int, chunk_rows: int) -> ShardReader:
    reader = ShardReader(path, SCHEMA, expected_rows=rows, chunk_rows=chunk_rows)
    assert reader._lazy is not None, "the file should have been opened lazily"
    return reader


def _read(reader: ShardReader, picks: list[int]) -> dict[str, Any]:
    out = gather([reader], np.zeros(len(picks), np.int32), np.array(picks, np.int64),
                 list(SCHEMA))
    return {"x": out["x"].tolist(), "tokens": [list(t) for t in out["tokens"]],
            "blob": [bytes(b) for b in out["blob"]]}


@given(count=st.integers(2, 120), chunk_size=st.sampled_from([64, 200, 1000, 4000]),
       seed=st.integers(0, 2**32 - 1), reads=st.lists(st.lists(st.integers(0, 10**6),
                                                                max_size=20), max_size=5))
@settings(max_examples=40, deadline=None)
def test_lazy_reads_equal_an_eager_open_whatever_was_read_before(
        tmp_path_factory: pytest.TempPathFactory, count: int, chunk_size: int, seed: int,
        reads: list[list[int]]) -> None:
    folder = tmp_path_factory.mktemp("lazy")
    path, rows, chunk_rows = _write(folder, _rows(count, seed), chunk_size)
    eager = ShardReader(path, SCHEMA, expected_rows=rows)
    if eager._chunks is None:
        return  # one chunk: nothing lazy to test
    lazy = _lazy(path, rows, chunk_rows)
    assert not lazy._lazy._loaded.any()  # type: ignore[union-attr]  # the footer only
    for picks in [*reads, list(range(rows))]:
        picks = [p % rows for p in picks]
        assert _read(lazy, picks) == _read(eager, picks)
        loaded = lazy._lazy._loaded  # type: ignore[union-attr]
        assert set(np.flatnonzero(loaded).tolist()) >= {p // chunk_rows for p in picks}
    assert lazy._lazy.complete  # type: ignore[union-attr]


def test_only_the_chunks_read_are_parsed(tmp_path: Path, backend: str) -> None:  # noqa: F811
    path, rows, chunk_rows = _write(tmp_path, _rows(200, 1), 256)
    reader = _lazy(path, rows, chunk_rows)
    picks = [3, chunk_rows * 2 + 1, rows - 1]
    _read(reader, picks)
    loaded = np.flatnonzero(reader._lazy._loaded).tolist()  # type: ignore[union-attr]
    assert loaded == sorted({p // chunk_rows for p in picks})


def test_threads_reading_a_fresh_lazy_shard_at_once_read_it_right(tmp_path: Path) -> None:
    path, rows, chunk_rows = _write(tmp_path, _rows(300, 2), 200)
    expected = _read(ShardReader(path, SCHEMA, expected_rows=rows), list(range(rows)))
    reader = _lazy(path, rows, chunk_rows)
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        barrier.wait()
        try:
            for _ in range(20):
                picks = rng.integers(0, rows, 16).tolist()
                got = _read(reader, picks)
                assert got == {k: [v[p] for p in picks] for k, v in expected.items()}
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def _chunk_files(path: str) -> list[pa.RecordBatch]:
    with pa.memory_map(path) as source:
        return list(ipc.open_file(source).read_all().to_batches())


def _rewrite(path: str, batches: list[pa.RecordBatch], schema: pa.Schema | None = None) -> None:
    schema = schema or batches[0].schema
    with ipc.new_file(path + ".tmp", schema) as out:
        for batch in batches:
            out.write_batch(batch)
    os.replace(path + ".tmp", path)


def test_a_chunk_of_another_row_count_than_the_index_says_is_refused_when_read(
        tmp_path: Path) -> None:
    path, rows, chunk_rows = _write(tmp_path, _rows(100, 3), 2000)
    batches = _chunk_files(path)
    assert len(batches) >= 3 and chunk_rows >= 2
    # the same rows and the same number of chunks, cut elsewhere: chunk 0 one row longer
    whole = pa.Table.from_batches(batches)
    cuts = [0, chunk_rows + 1] + [chunk_rows * k for k in range(2, len(batches))] + [rows]
    _rewrite(path, [whole.slice(a, b - a).combine_chunks().to_batches()[0]
                    for a, b in itertools.pairwise(cuts)])
    reader = _lazy(path, rows, chunk_rows)
    with pytest.raises(ShardCorruptError, match=rf"chunk 0 holds {chunk_rows + 1} rows"):
        _read(reader, [0])
    last = rows - 1  # a chunk that agrees with the index still reads
    assert _read(reader, [last])["x"] == [list(_rows(100, 3)[last]["x"])]


def test_offsets_outside_their_values_in_one_chunk_are_refused_when_that_chunk_is_read(
        tmp_path: Path) -> None:
    path, rows, chunk_rows = _write(tmp_path, _rows(100, 4), 2000)
    batches = _chunk_files(path)
    tokens = batches[1].column("tokens")
    offsets = np.frombuffer(tokens.buffers()[1], dtype=np.int64)[:len(tokens) + 1].copy()
    data = bytearray(Path(path).read_bytes())
    where = data.find(offsets.tobytes())  # chunk 1's offsets, as the file holds them
    assert where > 0 and data.find(offsets.tobytes(), where + 1) < 0
    offsets[-1] += 10**6  # past the end of its values
    data[where:where + offsets.nbytes] = offsets.tobytes()
    Path(path).write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError):  # an eager open refuses the whole file
        ShardReader(path, SCHEMA, expected_rows=rows)
    reader = _lazy(path, rows, chunk_rows)
    assert len(_read(reader, [0])["x"]) == 1  # chunk 0 is sound
    with pytest.raises(ShardCorruptError, match=str(path)):
        _read(reader, [chunk_rows])  # chunk 1 is not
    with pytest.raises(ShardCorruptError):  # and stays refused
        _read(reader, [chunk_rows + 1])


def test_a_null_in_one_chunk_is_refused_when_that_chunk_is_read(tmp_path: Path) -> None:
    path, rows, chunk_rows = _write(tmp_path, _rows(100, 5), 256)
    batches = _chunk_files(path)
    bad = batches[2]
    blob = bad.column("blob").to_pylist()
    blob[0] = None
    nullable = bad.schema.set(bad.schema.get_field_index("blob"),
                              bad.schema.field("blob").with_nullable(True))
    batches = [b.cast(nullable) for b in batches]
    batches[2] = pa.RecordBatch.from_arrays(
        [pa.array(blob, type=bad.schema.field("blob").type) if n == "blob" else bad.column(n)
         for n in bad.schema.names], schema=nullable)
    _rewrite(path, batches, nullable)
    reader = _lazy(path, rows, chunk_rows)
    _read(reader, [0])
    with pytest.raises((SchemaError, ShardCorruptError), match="null"):
        _read(reader, [2 * chunk_rows])


def test_a_truncated_file_is_refused_at_open(tmp_path: Path) -> None:
    path, rows, chunk_rows = _write(tmp_path, _rows(100, 6), 256)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 40)  # the footer is gone
    with pytest.raises(ShardCorruptError, match="truncated or corrupt"):
        ShardReader(path, SCHEMA, expected_rows=rows, chunk_rows=chunk_rows)


def test_a_column_of_another_type_is_refused_at_open(tmp_path: Path) -> None:
    path, rows, chunk_rows = _write(tmp_path, _rows(100, 7), 256)
    other = Schema([Field("x", "tensor", "int64", (3,)), Field("tokens", "sequence", "int64"),
                    Field("blob", "bytes")])
    with pytest.raises(SchemaError, match="column 'x' has type"):
        ShardReader(path, other, expected_rows=rows, chunk_rows=chunk_rows)
    missing = Schema([Field("y", "tensor", "int32", (3,))])
    with pytest.raises(SchemaError, match="has no column 'y'"):
        ShardReader(path, missing, expected_rows=rows, chunk_rows=chunk_rows)


def test_a_layout_the_file_does_not_hold_falls_back_to_an_eager_open(tmp_path: Path) -> None:
    """An index whose chunk_rows gives another chunk count than the file's batches: the file
    is read eagerly (every batch checked at open), rows the same."""
    path, rows, chunk_rows = _write(tmp_path, _rows(100, 8), 256)
    expected = _read(ShardReader(path, SCHEMA, expected_rows=rows), list(range(rows)))
    for wrong in (chunk_rows * 2, max(1, chunk_rows - 1), rows):
        reader = ShardReader(path, SCHEMA, expected_rows=rows, chunk_rows=wrong)
        if -(-rows // wrong) != len(_chunk_files(path)):
            assert reader._lazy is None
        assert _read(reader, list(range(rows))) == expected
    with pytest.raises(ShardCorruptError, match="the index says"):  # rows contradict: eager
        ShardReader(path, SCHEMA, expected_rows=rows + 1, chunk_rows=chunk_rows * 50)


def test_a_loader_over_data_read_in_place_parses_only_what_it_reads(tmp_path: Path) -> None:
    """ShardWriter(compression=None) data is read where it lies: a fresh loader's first batch
    parses the chunks of its rows only, and the epoch still reads every sample once."""
    from streamcache import StreamDataset, StreamLoader

    with ShardWriter(str(tmp_path / "data"), compression=None, chunk_size=512,
                     shard_size=20_000) as writer:
        for i in range(400):
            writer.write({"x": np.full(16, i, np.int32)})
    dataset = StreamDataset(str(tmp_path / "data"), batch_size=8, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"))
    with StreamLoader(dataset) as loader:
        ids = next(iter(loader))["__id__"].tolist()
        readers = list(dataset.reader._readers.values())  # type: ignore[union-attr]
        lazy = [r._lazy for r in readers if r._lazy is not None]
        assert lazy, "the shards read in place should open lazily"
        assert sum(int(c._loaded.sum()) for c in lazy) < sum(c._loaded.size for c in lazy)
        ids += [i for batch in loader for i in batch["__id__"].tolist()]
    assert sorted(ids) == list(range(400))


def test_a_chunk_set_reaches_handles_made_before_and_after(backend: str) -> None:  # noqa: F811
    from streamcache import _native

    empty, none = np.empty(0, np.uint8), np.zeros(1, np.int64)
    fixed = _native.ColumnChunks([empty, empty])
    before = np.empty((1, 4), np.uint8)
    with pytest.raises(Exception, match="row"):  # a placeholder has no rows: refused
        _native.gather_fixed_chunks([fixed], 4, np.array([1], np.int32),
                                    np.array([0], np.int64), before)
    fixed.set(1, np.arange(8, dtype=np.uint8))  # after a handle was made (by the gather)
    _native.gather_fixed_chunks([fixed], 4, np.array([1], np.int32), np.array([1], np.int64),
                                before)
    assert before.tolist() == [[4, 5, 6, 7]]
    var = _native.ColumnChunks([empty, empty], [none, none])
    var.set(0, np.arange(5, dtype=np.uint8), np.array([0, 2, 5], np.int64))  # before a handle
    values, offsets = _native.gather_var_chunks([var], 1, np.array([0, 0], np.int32),
                                                np.array([1, 0], np.int64))
    assert values.tolist() == [2, 3, 4, 0, 1] and offsets.tolist() == [0, 3, 5]
    with pytest.raises(IndexError, match="chunk 2 of 2"):
        fixed.set(2, empty)
    with pytest.raises(ValueError, match="has no offsets"):
        fixed.set(0, empty, none)
    with pytest.raises(ValueError, match="needs offsets"):
        var.set(0, empty)
