"""The native core against its twin, and both against an independent XXH64."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.errors import CorruptDataError, NativeError, RowOutOfRangeError


@pytest.mark.parametrize("length", [0, 1, 3, 4, 7, 8, 31, 32, 33, 64, 100, 1000, 4099])
@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1])
def test_xxh64_matches_reference(backend: str, length: int, seed: int) -> None:
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    assert _native.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed=seed)


def test_xxh64_file_streams_across_block_boundaries(backend: str, tmp_path) -> None:
    data = os.urandom((4 << 20) + 37)  # crosses the 4 MiB read block and a 32-byte stripe
    path = tmp_path / "blob"
    path.write_bytes(data)
    digest, size = _native.xxh64_file(str(path))
    assert (digest, size) == (xxhash.xxh64_intdigest(data), len(data))


def test_xxh64_file_missing_is_a_clear_error(backend: str, tmp_path) -> None:
    with pytest.raises(NativeError, match="missing"):
        _native.xxh64_file(str(tmp_path / "missing"))


def _fixed_sources(rng: np.random.Generator, stride: int, rows: list[int]) -> list[np.ndarray]:
    return [rng.integers(0, 256, n * stride, dtype=np.uint8) for n in rows]


@given(
    stride=st.integers(1, 64),
    shard_rows=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    picks=st.integers(0, 60),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_gather_fixed_native_equals_twin(stride: int, shard_rows: list[int], picks: int,
                                         seed: int) -> None:
    rng = np.random.default_rng(seed)
    sources = _fixed_sources(rng, stride, shard_rows)
    which = rng.integers(0, len(shard_rows), picks).astype(np.int32)
    rows = np.array([rng.integers(0, shard_rows[w]) for w in which], dtype=np.int64)
    pieces = [sources[w][r * stride:(r + 1) * stride] for w, r in zip(which, rows, strict=True)]
    expected = np.stack(pieces) if picks else np.empty((0, stride), np.uint8)
    for name in _native.available_backends():
        out = np.empty((picks, stride), np.uint8)
        with _native.use(name):
            _native.gather_fixed(sources, stride, which, rows, out)
        assert np.array_equal(out, expected), name


@given(
    elem_size=st.sampled_from([1, 2, 4, 8]),
    lengths=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=8), min_size=1,
                     max_size=4),
    picks=st.integers(0, 40),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_gather_var_native_equals_twin(elem_size: int, lengths: list[list[int]], picks: int,
                                       seed: int) -> None:
    rng = np.random.default_rng(seed)
    values, offsets = [], []
    for shard_lengths in lengths:
        off = np.concatenate([[0], np.cumsum(shard_lengths)]).astype(np.int64)
        offsets.append(off)
        values.append(rng.integers(0, 256, int(off[-1]) * elem_size, dtype=np.uint8))
    which = rng.integers(0, len(lengths), picks).astype(np.int32)
    rows = np.array([rng.integers(0, len(lengths[w])) for w in which], dtype=np.int64)
    pieces = [values[w][offsets[w][r] * elem_size:offsets[w][r + 1] * elem_size]
              for w, r in zip(which, rows, strict=True)]
    expected = np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
    for name in _native.available_backends():
        with _native.use(name):
            got_values, got_offsets = _native.gather_var(values, offsets, elem_size, which, rows)
        assert np.array_equal(got_values, expected), name
        assert got_offsets[-1] * elem_size == expected.size
        assert np.all(np.diff(got_offsets) >= 0)


def test_large_gather_uses_the_pool_and_matches(backend: str) -> None:
    rng = np.random.default_rng(0)
    stride = 100_000
    sources = _fixed_sources(rng, stride, [40, 40])
    which = rng.integers(0, 2, 64).astype(np.int32)
    rows = rng.integers(0, 40, 64).astype(np.int64)
    out = np.empty((64, stride), np.uint8)
    _native.gather_fixed(sources, stride, which, rows, out)
    for i in range(64):
        assert np.array_equal(out[i], sources[which[i]][rows[i] * stride:(rows[i] + 1) * stride])


def test_out_of_range_rows_and_shards_raise(backend: str) -> None:
    sources = [np.zeros(4 * 8, np.uint8)]
    out = np.empty((1, 8), np.uint8)
    with pytest.raises(RowOutOfRangeError, match="row 4 but it has 4 rows"):
        _native.gather_fixed(sources, 8, np.zeros(1, np.int32), np.array([4], np.int64), out)
    with pytest.raises(RowOutOfRangeError, match="names shard 1 of 1"):
        _native.gather_fixed(sources, 8, np.ones(1, np.int32), np.zeros(1, np.int64), out)
    with pytest.raises(RowOutOfRangeError):
        _native.gather_fixed(sources, 8, np.zeros(1, np.int32), np.array([-1], np.int64), out)


def test_corrupt_offsets_raise(backend: str) -> None:
    values = [np.zeros(10, np.uint8)]
    offsets = [np.array([0, 5, 50], np.int64)]  # second row runs past the values buffer
    with pytest.raises(CorruptDataError, match="do not fit its 10 elements"):
        _native.gather_var(values, offsets, 1, np.zeros(1, np.int32), np.array([1], np.int64))
    offsets = [np.array([0, 7, 3], np.int64)]  # decreasing
    with pytest.raises(CorruptDataError):
        _native.gather_var(values, offsets, 1, np.zeros(1, np.int32), np.array([1], np.int64))


def test_output_too_small_is_rejected(backend: str) -> None:
    sources = [np.zeros(64, np.uint8)]
    out = np.empty(8, np.uint8)
    with pytest.raises(NativeError, match="batch needs 2 rows of 8 bytes"):
        _native.gather_fixed(sources, 8, np.zeros(2, np.int32), np.zeros(2, np.int64), out)


def test_native_gather_runs_in_parallel_threads() -> None:
    """The GIL is released: several Python threads gather at once and all get right answers."""
    if "native" not in _native.available_backends():
        pytest.skip("extension not built")
    rng = np.random.default_rng(1)
    stride = 4096
    sources = _fixed_sources(rng, stride, [256])
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        local = np.random.default_rng(seed)
        rows = local.integers(0, 256, 512).astype(np.int64)
        out = np.empty((512, stride), np.uint8)
        try:
            for _ in range(20):
                _native.gather_fixed(sources, stride, np.zeros(512, np.int32), rows, out)
                assert np.array_equal(out[7], sources[0][rows[7] * stride:(rows[7] + 1) * stride])
        except BaseException as exc:  # reported to the test thread below
            errors.append(exc)

    with _native.use("native"):
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


def test_thread_pool_size_is_configurable() -> None:
    if "native" not in _native.available_backends():
        pytest.skip("extension not built")
    with _native.use("native"):
        before = _native.get_num_threads()
        try:
            _native.set_num_threads(3)
            assert _native.get_num_threads() == 3
        finally:
            _native.set_num_threads(0)
        assert _native.get_num_threads() == before


def test_pool_works_in_a_forked_child() -> None:
    if "native" not in _native.available_backends():
        pytest.skip("extension not built")
    rng = np.random.default_rng(2)
    sources = _fixed_sources(rng, 100_000, [32])
    rows = np.arange(32, dtype=np.int64)
    out = np.empty((32, 100_000), np.uint8)
    with _native.use("native"):
        _native.gather_fixed(sources, 100_000, np.zeros(32, np.int32), rows, out)  # pool started
        pid = os.fork()
        if pid == 0:  # child: a large gather needs the pool, whose threads were not forked
            try:
                child_out = np.empty_like(out)
                _native.gather_fixed(sources, 100_000, np.zeros(32, np.int32), rows, child_out)
                os._exit(0 if np.array_equal(child_out, out) else 3)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_xxh64_file_of_a_directory_says_why(backend: str, tmp_path) -> None:
    with pytest.raises(NativeError, match="Is a directory"):
        _native.xxh64_file(str(tmp_path))


needs_native = pytest.mark.skipif("native" not in _native.available_backends(),
                                  reason="extension not built")


@needs_native
@pytest.mark.parametrize("throw_at", [0, 999])  # in the first chunk, in the last
def test_an_exception_in_a_pool_chunk_reaches_the_caller(throw_at: int) -> None:
    from streamcache import _core

    _native.set_num_threads(4)
    try:
        visited, message = _core._test_pool_job(1000, throw_at, -1)
        assert message == f"chunk of item {throw_at}"
        assert visited < 1000
        assert _core._test_pool_job(1000, -1, -1) == (1000, "")  # the pool still works
    finally:
        _native.set_num_threads(0)


@needs_native
def test_a_job_does_not_wait_for_another_callers_chunks() -> None:
    """Each parallel call completes on its own: one stuck job never holds up another."""
    from streamcache import _core

    rng = np.random.default_rng(3)
    stride = 100_000
    sources = _fixed_sources(rng, stride, [32])
    rows = rng.integers(0, 32, 32).astype(np.int64)
    out = np.empty((32, stride), np.uint8)
    _core._set_test_gate(False)
    stuck = threading.Thread(target=_core._test_pool_job, args=(64, -1, 63))
    try:
        stuck.start()
        deadline = time.monotonic() + 60
        while _core._set_test_gate(False) == 0:  # until the stuck chunk waits at the gate
            assert time.monotonic() < deadline, "the pool job never reached the gate"
            time.sleep(0.01)
        with _native.use("native"):
            other = threading.Thread(
                target=_native.gather_fixed,
                args=(sources, stride, np.zeros(32, np.int32), rows, out))
            other.start()
            other.join(timeout=60)
        assert not other.is_alive(), "a parallel gather waited for another job's chunk"
    finally:
        _core._set_test_gate(True)
        stuck.join()
    assert np.array_equal(out[5], sources[0][rows[5] * stride:(rows[5] + 1) * stride])


@needs_native
def test_forked_children_gather_while_the_parent_is_gathering() -> None:
    """A fork while another thread is inside the pool leaves the child no lock held."""
    rng = np.random.default_rng(4)
    stride = 100_000
    sources = _fixed_sources(rng, stride, [32])
    rows = np.arange(32, dtype=np.int64)
    which = np.zeros(32, np.int32)
    stop = threading.Event()

    def busy() -> None:
        out = np.empty((32, stride), np.uint8)
        while not stop.is_set():
            _native.gather_fixed(sources, stride, which, rows, out)

    with _native.use("native"):
        worker = threading.Thread(target=busy)
        worker.start()
        try:
            for _ in range(5):
                pid = os.fork()
                if pid == 0:
                    try:
                        out = np.empty((32, stride), np.uint8)
                        _native.gather_fixed(sources, stride, which, rows, out)
                        os._exit(0 if np.array_equal(out[3], sources[0][3 * stride:4 * stride])
                                 else 3)
                    except BaseException:
                        os._exit(4)
                deadline = time.monotonic() + 60
                while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
                    if time.monotonic() > deadline:
                        os.kill(pid, 9)
                        os.waitpid(pid, 0)
                        pytest.fail("a forked child hung in the native pool")
                    time.sleep(0.01)
                assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0
        finally:
            stop.set()
            worker.join()


@needs_native
def test_the_committed_stub_is_the_one_the_build_generated() -> None:
    """streamcache/_core.pyi (what mypy reads) is nanobind's stubgen output, not hand-written."""
    import streamcache
    from streamcache import _core

    built = Path(_core.__file__).with_name("_core.pyi")
    committed = Path(streamcache.__file__).with_name("_core.pyi")
    if built == committed or not built.exists():
        pytest.skip("no separately installed stub to compare with")
    assert committed.read_text() == built.read_text(), (
        f"csrc/bindings.cpp changed: copy the generated {built} to streamcache/_core.pyi"
    )


def test_streaming_xxh64_over_pieces_is_the_xxh64_of_the_whole(backend: str) -> None:
    data = np.random.default_rng(7).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    for cuts in ([], [1], [31, 32, 33], [7, 100, 4095, 4999]):
        state = _native.Xxh64(seed=3)
        for start, stop in zip([0, *cuts], [*cuts, len(data)], strict=True):
            state.update(data[start:stop])
        assert state.digest() == xxhash.xxh64_intdigest(data, seed=3), cuts
    state = _native.Xxh64()
    state.update(data[:10])
    first = state.digest()  # a digest does not end the stream
    state.update(np.frombuffer(data[10:], np.uint8))
    assert (first, state.digest()) == (xxhash.xxh64_intdigest(data[:10]),
                                       xxhash.xxh64_intdigest(data))


@given(shards=st.lists(st.integers(-2**63, 2**63 - 1), max_size=300),
       copies=st.integers(1, 40),
       spread=st.sampled_from(["any", "few", "dense", "dense-negative"]))
@settings(max_examples=80, deadline=None)
def test_group_shards_is_numpy_unique_with_inverse(shards: list[int], copies: int,
                                                   spread: str) -> None:
    """Any shard numbers; a few distinct ones; many in a narrow range (the table path, at
    64 rows or more), near the ends of int64 too; each drawn row ``copies`` times, spread
    over the batch."""
    shards = [s for k in range(copies) for s in shards[k % 3:] + shards[:k % 3]]
    if spread == "few":
        shards = [s % 7 for s in shards]
    elif spread == "dense":
        shards = [2**63 - 1 - s % (2 * len(shards) + 1) for s in shards]
    elif spread == "dense-negative":
        shards = [-2**63 + s % (3 * len(shards) + 1) for s in shards]
    values = np.array(shards, dtype=np.int64)
    want_unique, want_which = np.unique(values, return_inverse=True)
    for name in _native.available_backends():
        with _native.use(name):
            unique, which = _native.group_shards(values)
        assert unique.tolist() == want_unique.tolist(), name
        assert which.dtype == np.int32 and which.tolist() == want_which.tolist(), name


def test_group_shards_refuses_what_it_would_have_to_convert(backend: str) -> None:
    with pytest.raises(NativeError, match="shards must have dtype int64"):
        _native.group_shards(np.array([1, 2], np.int32))
