"""A unit layout without per-shard arrays (streamcache/plan/unit_columns.py, plan/units.py):
every answer equals the plain prefix-sum arrays' (what the layout kept before), on the dense
path and on the cache path (shards that share cache slots, several threads at once); the
digest is the one unit caches were named by; and the layout, the split's tables and a few
steps of the split keep nothing per shard of a large index.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import threading
import tracemalloc

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamcache.format.index import DatasetIndex
from streamcache.format.shard_table import ShardTable
from streamcache.format.writer import ShardWriter
from streamcache.loading.nodes import IndexUnitColumns, unit_layout, valid_at
from streamcache.plan import PlanError, unit_columns
from streamcache.plan.locality import LocalityAssignment, locality_key
from streamcache.plan.owners import typical_chunk_rows
from streamcache.plan.unit_columns import SLOTS, distinct_values
from streamcache.plan.units import UnitLayout, concatenate


class Reference:
    """The layout as plain arrays (the prefix sums every process used to keep)."""

    def __init__(self, rows: np.ndarray, chunk: np.ndarray, piece: np.ndarray,
                 parts: tuple[int, ...]) -> None:
        self.rows, self.chunk = rows, chunk
        cut = chunk > 0
        self.piece = np.where(cut, piece, np.maximum(rows, 1))
        self.pieces = np.maximum(1, -(-rows // self.piece))
        self.chunks = np.where(cut, -(-rows // np.maximum(chunk, 1)), 0)
        self.piece_base = np.concatenate(([0], np.cumsum(self.pieces))).astype(np.int64)
        self.num_pieces = int(self.piece_base[-1])
        self.chunk_base = np.concatenate(([0], np.cumsum(self.chunks))).astype(
            np.int64) + self.num_pieces
        self.parts = parts
        digest = hashlib.blake2b(digest_size=8)
        for array in (rows, chunk, self.piece, np.asarray(parts, dtype=np.int64)):
            digest.update(array.tobytes())
        self.digest = digest.hexdigest()

    def piece_of(self, s: np.ndarray, r: np.ndarray) -> np.ndarray:
        return self.piece_base[s] + r // self.piece[s]

    def chunk_of(self, s: np.ndarray, r: np.ndarray) -> np.ndarray:
        return np.where(self.chunk[s] > 0, self.chunk_base[s] + r // np.maximum(
            self.chunk[s], 1), -1)

    def span(self, unit: int) -> tuple[int, int, int]:
        if unit < self.num_pieces:
            shard = int(np.searchsorted(self.piece_base, unit, side="right")) - 1
            size = int(self.piece[shard])
            first = (unit - int(self.piece_base[shard])) * size
        else:
            shard = int(np.searchsorted(self.chunk_base, unit, side="right")) - 1
            size = int(self.chunk[shard])
            first = (unit - int(self.chunk_base[shard])) * size
        return shard, first, max(0, min(size, int(self.rows[shard]) - first))

    def keys(self, s: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Piece keys and chunk keys, each part's units numbered on their own."""
        first = np.concatenate(([0], np.cumsum(self.parts))).astype(np.int64)
        part = np.searchsorted(first, s, side="right") - 1
        pieces_before = self.piece_base[first[:-1]]
        chunks_before = self.chunk_base[first[:-1]] - self.num_pieces
        own_pieces = self.piece_base[first[1:]] - pieces_before
        own_units = own_pieces + (self.chunk_base[first[1:]] - self.chunk_base[first[:-1]])
        base = np.concatenate(([0], np.cumsum(own_units)[:-1])).astype(np.int64)
        pieces = self.piece_of(s, r) - pieces_before[part] + base[part]
        chunks = self.chunk_of(s, r)
        local = chunks - self.num_pieces - chunks_before[part] + own_pieces[part]
        return pieces, np.where(chunks >= 0, base[part] + local, -1)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...], int]:
    count = draw(st.integers(1, 700))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 40, count)
    rows[rng.random(count) < 0.1] = 0
    chunk = np.where(rng.random(count) < 0.6, rng.integers(1, 9, count), 0)
    piece = np.where(chunk > 0, chunk * rng.integers(1, 4, count), rng.integers(1, 50, count))
    cuts = np.sort(rng.integers(0, count + 1, draw(st.integers(0, 3))))
    parts = tuple(np.diff(np.concatenate(([0], cuts, [count]))).tolist())
    return rows, chunk, piece, parts, seed


def _check_against(layout: UnitLayout, ref: Reference, seed: int) -> None:
    rng = np.random.default_rng(seed + 1)
    n = ref.rows.size
    assert layout.digest == ref.digest
    assert layout.num_pieces == ref.num_pieces
    assert layout.num_units == int(ref.chunk_base[-1])
    assert layout.num_samples == int(ref.rows.sum())
    assert layout.any_cut == bool((ref.chunk > 0).any())
    cut = ref.chunk > 0
    assert layout.typical_chunk_rows() == (int(np.median(ref.chunk[cut])) if cut.any() else 0)
    assert layout.max_shard_rows == int(ref.rows.max(initial=0))
    for size in (1, 50, 5000):  # (above DISTINCT_AT: each distinct shard looked up once)
        s = rng.integers(0, n, size)
        r = (rng.random(size) * np.maximum(ref.rows[s], 1)).astype(np.int64)
        rows, chunk, piece = (layout.lookup(s, (f,))[0] for f in (0, 1, 2))
        assert np.array_equal(rows, ref.rows[s]) and np.array_equal(chunk, ref.chunk[s])
        assert np.array_equal(piece, ref.piece[s])
        assert np.array_equal(layout.piece_of(s, r), ref.piece_of(s, r))
        assert np.array_equal(layout.chunk_of(s, r), ref.chunk_of(s, r))
        assert np.array_equal(layout.chunk_or_piece(s, r),
                              np.where(cut[s], ref.chunk_of(s, r), ref.piece_of(s, r)))
        pieces, chunks = ref.keys(s, r)
        assert np.array_equal(layout.piece_keys(s, r), pieces)
        assert np.array_equal(layout.chunk_keys(s, r), chunks)
    units = rng.integers(0, layout.num_units, 300)
    spans = [ref.span(int(u)) for u in units]
    shards, firsts = layout.unit_starts(units)
    assert shards.tolist() == [sp[0] for sp in spans]
    assert firsts.tolist() == [sp[1] for sp in spans]
    for u, expected in zip(units.tolist(), spans, strict=True):
        assert layout.span(u) == expected
        assert layout.is_whole(u) == (u < ref.num_pieces and expected[2] == int(
            ref.rows[expected[0]]))


@settings(max_examples=60, deadline=None)
@example((np.array([3]), np.array([0]), np.array([1]), (1,), 0), False)
@given(layouts(), st.booleans())
def test_every_answer_equals_the_prefix_sum_arrays(
        drawn: tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...], int],
        dense: bool) -> None:
    rows, chunk, piece, parts, seed = drawn
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(unit_columns, "DENSE_SHARDS", 1 << 30 if dense else 0)
        patch.setattr(unit_columns, "SCAN", 256)  # (scans of several blocks)
        layout = UnitLayout(rows, chunk, piece, parts=parts)
        assert layout.dense == dense
        ref = Reference(rows, chunk, piece, parts)
        _check_against(layout, ref, seed)
        for k, size in enumerate(parts):
            first = sum(parts[:k])
            alone = layout.part(k)
            assert alone.num_shards == size
            assert alone == UnitLayout(rows[first:first + size], chunk[first:first + size],
                                       piece[first:first + size])


def test_shards_that_share_cache_slots_are_answered_right_from_many_threads() -> None:
    count = 5 * SLOTS + 7
    rng = np.random.default_rng(9)
    rows = rng.integers(1, 30, count)
    chunk = np.where(rng.random(count) < 0.5, rng.integers(1, 5, count), 0)
    piece = np.where(chunk > 0, chunk * 2, 1)
    layout = UnitLayout(rows, chunk, piece)
    assert not layout.dense
    ref = Reference(rows, chunk, piece, (count,))
    # every shard below maps to one of a few home slots: the cache moves and drops them
    crowded = np.concatenate([np.arange(5) * SLOTS + k for k in range(6)])
    errors: list[str] = []

    def worker(seed: int) -> None:
        local = np.random.default_rng(seed)
        for _ in range(200):
            s = local.choice(crowded, local.integers(1, 40))
            if local.random() < 0.3:
                s = np.concatenate([s, local.integers(0, count, 10)])
            r = (local.random(s.size) * rows[s]).astype(np.int64)
            if not np.array_equal(layout.piece_of(s, r), ref.piece_of(s, r)) or \
                    not np.array_equal(layout.chunk_of(s, r), ref.chunk_of(s, r)):
                errors.append(f"seed {seed}: shards {s.tolist()}")
                return

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 99), max_size=300))
def test_distinct_values_are_each_value_once_and_map_back(values: list[int]) -> None:
    array = np.array(values, dtype=np.int64)
    distinct, where = distinct_values(array, 100)
    assert sorted(distinct.tolist()) == sorted(set(values))
    assert np.array_equal(distinct[where], array)


@pytest.mark.parametrize("bad", [[-1], [100], [3, 100], [-5, 2]])
def test_lookups_of_shards_out_of_range_are_refused(bad: list[int]) -> None:
    with pytest.raises(PlanError, match="out of range"):
        distinct_values(np.array(bad), 100)
    for dense in (True, False):
        rows = np.full(100, 10)
        layout = UnitLayout(rows, np.full(100, 2), np.full(100, 4))
        layout._tables._dense = layout._tables._dense if dense else None
        if not dense:
            layout._tables._tags = np.full(SLOTS, unit_columns._EMPTY, dtype=np.int64)
            layout._tables._values = np.zeros((len(unit_columns.FIELDS), SLOTS), np.int64)
        with pytest.raises(PlanError, match="out of range"):
            layout.lookup(np.array(bad))


def test_a_layout_of_several_parts_is_not_concatenated_again() -> None:
    one = UnitLayout(np.full(3, 5), np.full(3, 1), np.full(3, 2))
    two = concatenate([one, one])
    assert two.parts == (3, 3)
    with pytest.raises(PlanError, match="one part each"):
        concatenate([two, one])
    assert typical_chunk_rows(two) == 1 and typical_chunk_rows(None) == 0


def test_valid_at_reads_the_bitmap_of_sliced_and_unsliced_columns() -> None:
    values = [None if k % 3 == 0 else f"v{k}" for k in range(50)]
    column = pa.array(values, pa.string())
    at = np.array([0, 1, 2, 3, 47, 48, 49])
    assert valid_at(column, at).tolist() == [values[k] is not None for k in at]
    sliced = column.slice(5, 40)
    assert valid_at(sliced, np.array([0, 1, 39])).tolist() == [
        values[k] is not None for k in (5, 6, 44)]
    assert valid_at(pa.array(["a", "b"]), np.array([1, 0])).tolist() == [True, True]
    assert valid_at(pa.nulls(4, pa.string()), np.array([2])).tolist() == [False]
    chunked = pa.chunked_array([column.slice(0, 10), column.slice(10)])
    assert valid_at(chunked, at).tolist() == [values[k] is not None for k in at]


def _big_index(tmp_path, count: int) -> DatasetIndex:
    """An index of ``count`` shards like one ShardWriter shard (chunked, zstd, checksummed),
    some without a checksum or a chunk layout (not cut)."""
    with ShardWriter(str(tmp_path / "one"), chunk_size=4096, compression_min_savings=0) as writer:
        for i in range(2000):
            writer.write({"x": np.int64(i), "pad": np.zeros(16, np.int64)})
    info = writer.index.shards[0]
    rng = np.random.default_rng(0)
    plain = rng.random(count) < 0.05
    checksums = pa.array(np.where(plain, None, info.checksum).tolist(), pa.string())
    chunk_rows = np.where(rng.random(count) < 0.05, -1, info.chunk_rows)
    table = ShardTable(
        pa.array([f"s{k}.arrow" for k in range(count)], pa.large_string()),
        np.zeros(count, np.uint8), np.full(count, info.rows, np.int64),
        np.full(count, info.bytes, np.int64), checksums,
        pa.array([info.compression] * count, pa.string()),
        np.full(count, info.raw_bytes, np.int64), chunk_rows.astype(np.int64),
        np.full(count, info.tail_bytes, np.int64), pa.array([info.tail_checksum] * count))
    return DatasetIndex(writer.index.schema, table, url="s3://bucket/data")


def test_the_index_columns_give_what_the_arrays_did(tmp_path) -> None:
    index = _big_index(tmp_path, 3000)
    columns = IndexUnitColumns(index, 1 << 16, 8)
    rows, chunk, piece = columns.block(0, 3000)
    shards = np.random.default_rng(1).integers(0, 3000, 500)
    assert all(np.array_equal(a[shards], b) for a, b in zip(
        (rows, chunk, piece), columns.at(shards), strict=True))
    assert ((chunk == 0) == ~np.asarray(index.shard_table.columns()["checksums"].is_valid())
            | (np.asarray(index.shard_table.columns()["chunk_rows"]) < 0)).all()
    layout = unit_layout(index, 1 << 16, 8)
    assert layout == UnitLayout(rows, chunk, piece)
    assert layout.shard_counts() is index.shard_table.counts()
    # (a DataLoader worker gets it pickled: the index and the two numbers, nothing per shard)
    pickled = pickle.dumps(layout)
    with pytest.MonkeyPatch.context() as patch:  # (the scan's results travel: no second scan)
        patch.setattr(unit_columns.ColumnTables, "_scan", None)
        copy = pickle.loads(pickled)
    assert copy == layout and copy.sources[0].index.fingerprint == index.fingerprint
    # (the index as it pickles, and 16 bytes per 128 shards)
    assert len(pickled) < len(pickle.dumps(index)) + (4 << 10), len(pickled)
    assert np.array_equal(copy.piece_of(shards, shards % 7), layout.piece_of(shards, shards % 7))


def test_a_large_layout_and_its_split_keep_nothing_per_shard(tmp_path) -> None:
    # 400,000 shards: the prefix-sum arrays and the split's per-shard tables were ~30 MB in
    # every process (56 + 24 bytes a shard); the index's own columns are the node's
    count = 400_000
    index = _big_index(tmp_path, count)
    rng = np.random.default_rng(2)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        layout = unit_layout(index, 1 << 18, 8)
        split = LocalityAssignment(8, locality_key("x"), layout, 1024)
        for _ in range(20):  # (the lookups and the caches they fill)
            shards = rng.integers(0, count, 40_000)
            rows = rng.integers(0, 2000, shards.size)
            split.owners(shards, rows)
            split.backups(shards, rows)
            layout.piece_keys(shards[:1000], rows[:1000])
            layout.chunk_keys(shards[:1000], rows[:1000])
            layout.span(int(rng.integers(0, layout.num_units)))
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert not layout.dense
    assert kept < 3 << 20, f"{kept:,} bytes kept for {count:,} shards"


@pytest.mark.parametrize("dense", [True, False])
def test_extreme_counts_are_answered_like_the_arrays(dense: bool) -> None:
    # what a valid index can hold: a shard of 2**40 one-row chunks, chunks larger than their
    # shard, empty shards; no sum of them may wrap
    rows = np.array([1 << 40, 5, 0, 7, (1 << 40) + 3], dtype=np.int64)
    chunk = np.array([1, 1 << 50, 0, 0, 3], dtype=np.int64)
    piece = np.array([512, 1 << 50, 1, 1, 3 << 20], dtype=np.int64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(unit_columns, "DENSE_SHARDS", 1 << 30 if dense else 0)
        layout = UnitLayout(rows, chunk, piece)
    ref = Reference(rows, chunk, piece, (5,))
    assert layout.num_units == int(ref.chunk_base[-1]) > 1 << 40
    s = np.array([0, 1, 2, 3, 4, 4, 0])
    r = np.array([(1 << 40) - 1, 4, 0, 6, (1 << 40) + 2, 0, 12345])
    assert np.array_equal(layout.piece_of(s, r), ref.piece_of(s, r))
    assert np.array_equal(layout.chunk_of(s, r), ref.chunk_of(s, r))
    for unit in (0, ref.num_pieces - 1, ref.num_pieces, int(ref.chunk_base[1]) - 1,
                 int(ref.chunk_base[-1]) - 1):
        assert layout.span(unit) == ref.span(unit)
    with pytest.raises(PlanError, match="does not exist"):
        layout.span(int(ref.chunk_base[-1]))


def test_the_median_chunk_is_kept_in_fixed_memory_exact_up_to_its_cap() -> None:
    # (a histogram of MEDIAN_CAP + 1 counts, not one entry per distinct chunk size, which a
    # dataset of varied samples has per shard)
    cap = unit_columns.MEDIAN_CAP
    rows = np.full(5, 10 * cap, dtype=np.int64)
    chunk = np.array([3, 5, 2 * cap, 3 * cap, 0], dtype=np.int64)
    layout = UnitLayout(rows, chunk, np.maximum(chunk, 1))
    assert layout.typical_chunk_rows() == int((5 + cap) / 2)  # (np.median: (5 + 2 cap) / 2)
    layout = UnitLayout(rows[:3], np.array([3, 5, 2 * cap]), np.array([3, 5, 2 * cap]))
    assert layout.typical_chunk_rows() == 5


def test_a_child_forked_while_a_lookup_held_the_locks_looks_up_alike() -> None:
    # a DataLoader worker is forked while the parent's threads may be inside a lookup: the
    # child gets fresh locks and empty caches (a slot may have been between tag and values)
    count = 2 * SLOTS + 5
    rows = np.full(count, 40, dtype=np.int64)
    chunk = np.full(count, 4, dtype=np.int64)
    layout = UnitLayout(rows, chunk, np.full(count, 8, dtype=np.int64))
    split = LocalityAssignment(4, locality_key("fork"), layout, 64)
    shards = np.arange(0, count, 97)
    expected = (layout.piece_of(shards, shards % 40), split.owners(shards, shards % 40))
    layout._tables._tags[:] = shards[0]  # (what a torn slot could leave: a tag, wrong values)
    with layout._tables._lock, split._offsets._lock:
        pid = os.fork()
        if pid == 0:  # the child: the parent's "threads" hold every lock
            code = 1
            try:
                signal.alarm(20)
                got = (layout.piece_of(shards, shards % 40), split.owners(shards, shards % 40))
                code = 0 if all(np.array_equal(a, b) for a, b in zip(
                    got, expected, strict=True)) else 3
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
