"""Tests of a node's units (streamcache/plan/units.py, cache/units.py, loading/node_reader.py):
what a node installs of a shard (a piece by range, verified; a whole shard whole), and what a
hostile or damaged server or cache folder can do to it (an error that names the object, never
another shard's or a wrong row).
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest
from servers import FaultServer

from streamcache.cache.units import UnitCache, unit_index
from streamcache.errors import ShardCorruptError, StreamcacheError
from streamcache.format.index import load_index
from streamcache.format.reader import ShardReader
from streamcache.format.writer import ShardWriter
from streamcache.loading.nodes import unit_layout
from streamcache.plan import PlanError
from streamcache.plan.units import UnitLayout
from streamcache.remote.options import FetchOptions

ROWS = 4096
QUICK = FetchOptions(retries=1, backoff_initial_s=0.01, backoff_max_s=0.01, timeout_s=5)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """One shard at the writer's defaults (zstd, 64 KiB chunks) of 1 KB rows, row i holding
    x == i, behind an HTTP server."""
    root = tmp_path_factory.mktemp("units")
    rng = np.random.default_rng(3)
    blobs = [rng.integers(0, 50, 1000, dtype=np.uint8).tobytes() for _ in range(ROWS)]
    with ShardWriter(str(root / "ds")) as writer:
        writer.write_batch(pa.record_batch({"x": np.arange(ROWS, dtype=np.int64),
                                            "blob": pa.array(blobs, pa.large_binary())}))
    with FaultServer(root=root) as server:
        index = load_index(server.url_for("ds/index.json"))
        assert index.shards[0].chunk_rows is not None and index.shards[0].chunk_rows < ROWS
        yield server, index


def sent(server: FaultServer) -> int:
    return sum(n for path, n in server.requests.sent_by_path().items()
               if path.endswith(".arrow"))


def piece_layout(index) -> UnitLayout:
    layout = unit_layout(index, ROWS, 4)  # pieces of whole chunks, 16 a node's window
    assert all((chunk > 0).all() for *_, chunk, _ in layout.scan()) and layout.num_pieces > 4
    return layout


def test_a_piece_is_read_by_range_verified_and_installed_in_the_local_layout(served,
                                                                             tmp_path) -> None:
    server, index = served
    layout = piece_layout(index)
    _, first, rows = layout.span(3)
    before = sent(server)
    with UnitCache(index, layout, str(tmp_path), working_set_bytes=1 << 30,
                   fetch_options=QUICK) as cache:
        path = cache.local_path(3)
        fetched = sent(server) - before
        reader = ShardReader(path, index.schema, expected_rows=rows)
        assert np.array_equal(reader._batch.column("x").to_numpy(),  # (the local layout)
                              np.arange(first, first + rows))
        reader.close()
        assert cache.local_path(3) == path and sent(server) - before == fetched  # once
    info = index.shards[0]
    chunks = -(-rows // info.chunk_rows)
    assert fetched < info.tail_bytes + 2 * chunks * info.bytes // -(-ROWS // info.chunk_rows)
    assert fetched < info.bytes // 4  # a piece and the footer, not the shard


def test_a_shard_that_is_not_cut_is_one_whole_unit(served, tmp_path) -> None:
    server, index = served
    layout = UnitLayout.whole_shards(index.shard_rows)
    before = sent(server)
    with UnitCache(index, layout, str(tmp_path), working_set_bytes=1 << 30) as cache:
        assert layout.is_whole(0)
        ShardReader(cache.local_path(0), index.schema, expected_rows=ROWS).close()
    assert sent(server) - before == index.shards[0].bytes


@pytest.mark.parametrize("fault", ["corrupt", "shifted_range", "truncate"])
def test_a_server_that_sends_wrong_bytes_installs_nothing(served, tmp_path, fault) -> None:
    """Every answer for the shard bent the same way: the range read fails its checks on
    every attempt; the user gets a streamcache error naming the shard, and no unit file."""
    server, index = served
    layout = piece_layout(index)
    path = f"/ds/{index.shards[0].path}"
    server.faults.script(path, [fault] * 8)
    try:
        with UnitCache(index, layout, str(tmp_path), working_set_bytes=1 << 30,
                       fetch_options=QUICK) as cache:
            with pytest.raises(StreamcacheError) as error:
                cache.local_path(5)
            assert index.shards[0].path in str(error.value)
            assert not cache.contains(5) and not os.path.exists(cache.shard_path(5))
    finally:
        server.faults.clear()


def test_one_bad_answer_is_retried_and_the_rows_are_right(served, tmp_path) -> None:
    server, index = served
    layout = piece_layout(index)
    server.faults.script(f"/ds/{index.shards[0].path}", [None, "corrupt"])  # (the footer,
    try:                                                                  # then a chunk)
        with UnitCache(index, layout, str(tmp_path), working_set_bytes=1 << 30,
                       fetch_options=QUICK) as cache:
            _, first, rows = layout.span(6)
            reader = ShardReader(cache.local_path(6), index.schema, expected_rows=rows)
            assert np.array_equal(reader._batch.column("x").to_numpy(),
                                  np.arange(first, first + rows))
            reader.close()
    finally:
        server.faults.clear()


def test_a_damaged_unit_file_is_an_error_not_wrong_rows(served, tmp_path) -> None:
    """An installed unit truncated (or replaced by another file) in the node's folder: the
    reader refuses it with an error that names the file, as it does an installed shard."""
    _, index = served
    layout = piece_layout(index)
    with UnitCache(index, layout, str(tmp_path), working_set_bytes=1 << 30) as cache:
        path = cache.local_path(2)
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        with pytest.raises(ShardCorruptError, match=os.path.basename(path)):
            ShardReader(path, index.schema, expected_rows=layout.span(2)[2])
        other = cache.local_path(3)
        os.replace(other, path)  # another unit's rows under this unit's name
        with pytest.raises(ShardCorruptError):
            ShardReader(path, index.schema, expected_rows=layout.span(2)[2] + 1)


def test_units_of_another_layout_or_dataset_never_share_a_folder(served) -> None:
    _, index = served
    big, small = unit_layout(index, 1 << 18, 2), unit_layout(index, ROWS, 4)
    assert big != small
    names = {unit_index(index, layout).fingerprint for layout in (big, small)}
    assert len(names) == 2 and index.fingerprint not in names
    assert unit_index(index, small) == unit_index(index, unit_layout(index, ROWS, 4))
    assert unit_index(index, big).shards[0].path == index.shards[0].path
    with pytest.raises(PlanError, match="does not exist"):
        unit_index(index, big).shards[big.num_units]


def test_a_local_uncompressed_shard_is_installed_as_a_unit_never_read_in_place(
        tmp_path) -> None:
    """A node's units record which unit they are (copy_of): even a whole local shard that a
    single-node job reads in place is installed as a stamped unit."""
    with ShardWriter(str(tmp_path / "ds"), compression=None) as writer:
        writer.write_batch(pa.record_batch({"x": np.arange(ROWS, dtype=np.int64)}))
    index = load_index(str(tmp_path / "ds"))
    layout = UnitLayout.whole_shards(index.shard_rows)
    with UnitCache(index, layout, str(tmp_path / "cache"), working_set_bytes=1 << 30) as cache:
        path = cache.local_path(0)
        assert not os.path.samefile(path, tmp_path / "ds" / index.shards[0].path)
        reader = ShardReader(path, index.schema, expected_rows=ROWS, copy_of=cache.copy_of(0))
        assert np.array_equal(reader._batch.column("x").to_numpy(), np.arange(ROWS))
        reader.close()
