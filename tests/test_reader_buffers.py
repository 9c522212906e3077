"""The gather's pooled output buffers (streamcache/format/buffers.py) and bytes fields gathered
as one bytes object per row (Ragged.from_rows, bytes_as_rows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_reader import SCHEMA, sample, write_shard

from streamcache.format.buffers import POOL, BufferPool
from streamcache.format.reader import Ragged, ShardReader, bytes_as_rows, gather


def test_a_buffer_is_reused_only_once_nothing_made_from_it_is_alive() -> None:
    pool = BufferPool(min_bytes=1024)
    first = pool.take(100_000)
    tensor = torch.from_numpy(first.view(np.int32).reshape(25, 1000))
    first[:] = 7
    del first
    second = pool.take(100_000)  # the tensor still refers to the first buffer
    assert pool.reused == 0
    second[:] = 9
    assert bool((tensor == 0x07070707).all())
    del tensor
    third = pool.take(90_000)  # the first buffer is free again; the second is still held
    assert pool.reused == 1 and third.size == 90_000
    assert not np.shares_memory(third, second)


def test_small_requests_and_a_full_pool_get_plain_arrays() -> None:
    pool = BufferPool(min_bytes=4096, max_buffers=2, max_bytes=1 << 20)
    assert pool.take(100).size == 100
    held = [pool.take(200_000) for _ in range(4)]  # two pooled, two beyond the pool
    assert len({id(a.base) for a in held}) == 4
    del held
    again = [pool.take(200_000) for _ in range(2)]
    assert pool.reused == 2 and again[0].flags.writeable


def test_batches_kept_by_the_loop_are_never_overwritten(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(POOL, "min_bytes", 1)  # pool even these small batches
    ids = range(0, 40)
    with ShardReader(write_shard(tmp_path / "a.arrow", ids), SCHEMA) as shard:
        rows = np.arange(40, dtype=np.int64)
        which = np.zeros(40, np.int32)
        kept = [gather([shard], which, np.roll(rows, k), [SCHEMA["img"], SCHEMA["t"]])
                for k in range(3)]
        for _ in range(10):  # later batches: reuse only what nobody holds
            gather([shard], which, rows[::-1].copy(), [SCHEMA["img"], SCHEMA["t"]])
    assert POOL.reused > 0
    for k, batch in enumerate(kept):
        order = np.roll(rows, k)
        assert batch["img"][:, 0, 0].tolist() == [i % 256 for i in order]
        assert batch["t"].lengths.tolist() == [i % 4 for i in order]


@pytest.mark.usefixtures("backend")
def test_bytes_as_rows_gives_the_rows_as_bytes_objects(tmp_path: Path) -> None:
    with ShardReader(write_shard(tmp_path / "a.arrow", range(0, 9)), SCHEMA) as a, \
            ShardReader(write_shard(tmp_path / "b.arrow", range(9, 14)), SCHEMA) as b:
        which = np.array([1, 0, 0, 1, 0], np.int32)
        rows = np.array([4, 8, 0, 0, 3], np.int64)
        fields = [SCHEMA["b"], SCHEMA["s"]]
        contiguous = gather([a, b], which, rows, fields)
        with bytes_as_rows():
            as_rows = gather([a, b], which, rows, fields)
        outside = gather([a, b], which, rows, fields)
    want = [sample(i)["b"] for i in (13, 8, 0, 9, 3)]
    rows_form = as_rows["b"]
    assert isinstance(rows_form, Ragged) and rows_form.kind == "bytes"
    assert rows_form.tolist() == want and len(rows_form) == 5 and rows_form[1] == want[1]
    assert all(type(row) is bytes for row in rows_form)
    # values and offsets are still there, equal to the contiguous gather's
    assert contiguous["b"].tolist() == want and outside["b"].tolist() == want
    assert np.array_equal(rows_form.values, contiguous["b"].values)
    assert np.array_equal(rows_form.offsets, contiguous["b"].offsets)
    assert np.array_equal(rows_form.lengths, [len(w) for w in want])
    # only bytes fields change form; str stays contiguous
    assert as_rows["s"].tolist() == [sample(i)["s"] for i in (13, 8, 0, 9, 3)]


def test_ragged_from_rows_of_an_empty_batch() -> None:
    empty = Ragged.from_rows([])
    assert len(empty) == 0 and empty.tolist() == [] and empty.offsets.tolist() == [0]
    assert empty.values.size == 0


def test_a_child_forked_while_the_pool_is_locked_can_take_buffers() -> None:
    import os
    import signal

    pool = BufferPool(min_bytes=1024)
    kept = pool.take(100_000)
    with pool._lock:  # as a reader thread of the parent may hold it at the fork
        pid = os.fork()
        if pid == 0:  # the child: must neither wait for the parent's lock nor reuse its buffer
            signal.alarm(10)
            fresh = pool.take(100_000)
            os._exit(0 if not np.shares_memory(fresh, kept) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_gather_into_takes_the_outputs_from_the_pool_given(tmp_path: Path) -> None:
    """What the loader's pin_memory path uses (a pool of page-locked buffers on CUDA): the
    gathered arrays are views of that pool's buffers, not copies."""
    from streamcache.format.buffers import gather_into

    made: list[np.ndarray] = []

    def allocate(nbytes: int) -> np.ndarray:
        made.append(np.empty(nbytes, dtype=np.uint8))
        return made[-1]

    pool = BufferPool(min_bytes=0, allocate=allocate)
    with ShardReader(write_shard(tmp_path / "a.arrow", range(0, 9)), SCHEMA) as shard:
        rows = np.array([4, 1, 7], dtype=np.int64)
        with gather_into(pool):
            inside = gather([shard], np.zeros(3, np.int32), rows, list(SCHEMA))
        outside = gather([shard], np.zeros(3, np.int32), rows, list(SCHEMA))
    fixed = [name for name, value in inside.items() if isinstance(value, np.ndarray)]
    assert fixed and all(inside[name].base is not None and
                         any(np.shares_memory(inside[name], b) for b in made) for name in fixed)
    assert not any(np.shares_memory(outside[name], b) for name in fixed for b in made)
    for name in inside:
        assert np.array_equal(np.asarray(inside[name] if name in fixed else
                                         inside[name].values),
                              np.asarray(outside[name] if name in fixed else
                                         outside[name].values))


@pytest.mark.parametrize("lengths", ["equal", "varied"])
def test_padded_sequences_kept_by_the_loop_are_never_overwritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lengths: str) -> None:
    # rows of one length come out as the gathered values themselves (no copy), others padded
    # into pooled buffers: either way a batch the loop keeps must stay as it was read
    from streamcache import ShardWriter, StreamDataset, StreamLoader

    monkeypatch.setattr(POOL, "min_bytes", 1)  # pool even these small batches
    rng = np.random.default_rng(4)
    rows = [rng.integers(-1000, 1000, 6 if lengths == "equal" else int(rng.integers(0, 9)),
                         dtype=np.int32) for _ in range(96)]
    with ShardWriter(str(tmp_path / "ds"), shard_size=1000, chunk_size=200) as writer:
        for row in rows:
            writer.write({"tokens": row})
    dataset = StreamDataset(str(tmp_path / "ds"), batch_size=8, cache_dir=str(tmp_path / "cache"),
                            pad_value=-7)
    with StreamLoader(dataset) as loader:
        kept = [batch for _ in range(2) for batch in loader]
    assert len(kept) == 24
    for batch in kept:
        padded, kept_lengths = batch["tokens"], batch["tokens_lengths"]
        assert padded.shape[1] == int(kept_lengths.max())
        for i, sample_id in enumerate(batch["__id__"].tolist()):
            want = rows[sample_id]
            assert kept_lengths[i] == len(want)
            assert padded[i, :len(want)].tolist() == want.tolist()
            assert (padded[i, len(want):] == -7).all()
