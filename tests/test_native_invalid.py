"""Invalid requests to the native core: refused, never written outside the output, and the
native core and its twin refuse each one with the same StreamcacheError."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import _native, _twin
from streamcache.errors import NativeError, StreamcacheError

needs_native = pytest.mark.skipif("native" not in _native.available_backends(),
                                  reason="extension not built")
GUARD = 8  # bytes on each side of an output that no call may touch
INVALID = _twin.INVALID


def _guarded(size: int) -> tuple[np.ndarray, np.ndarray]:
    """An output of `size` bytes inside a buffer with GUARD bytes of 0xAB on each side."""
    whole = np.full(size + 2 * GUARD, 0xAB, np.uint8)
    return whole, whole[GUARD:GUARD + size]


def _guards_intact(whole: np.ndarray) -> bool:
    return bool(np.all(whole[:GUARD] == 0xAB) and np.all(whole[-GUARD:] == 0xAB))


def _outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    """What a call did: its exception's type, message, code and item, or its result."""
    try:
        result = call()
    except StreamcacheError as exc:
        return type(exc), str(exc), getattr(exc, "code", None), getattr(exc, "item", None)
    return ("returned", result)


def _same_on_every_backend(call: Callable[[], Any]) -> tuple[Any, ...]:
    outcomes = {}
    for name in _native.available_backends():
        with _native.use(name):
            outcomes[name] = _outcome(call)
    first = next(iter(outcomes.values()))
    assert all(o == first for o in outcomes.values()), outcomes
    return first


# --------------------------------------------------------- the core, called directly

@needs_native
@pytest.mark.parametrize("out_offsets", [
    [-8, 0],          # a negative first offset: the row would land before the output
    [20, 28, 16],     # row 0 beyond the end the last offset promises
    [0, 8, 4],        # decreasing
    [0, 2**62, 2**62 + 8],  # far past the output; offset * elem_size overflows
])
def test_core_gather_var_refuses_out_offsets_outside_the_output(out_offsets: list[int]) -> None:
    from streamcache import _core

    n = len(out_offsets) - 1
    values = [np.arange(8 * n, dtype=np.uint8)]
    offsets = [np.arange(0, 8 * n + 1, 8, dtype=np.int64)]  # n rows of 8 elements
    which, rows = np.zeros(n, np.int32), np.arange(n, dtype=np.int64)
    whole, out = _guarded(8 * n)
    for elem_size, view in ((1, out), (4, out[:8 * n - 8 * n % 4])):
        code, _, message = _core.gather_var(values, offsets, elem_size, which, rows,
                                            np.array(out_offsets, np.int64), view)
        assert code == INVALID, message
        assert _guards_intact(whole)
        twin = _twin.gather_var(values, offsets, elem_size, which, rows,
                                np.array(out_offsets, np.int64), view.copy())
        assert (code, message) == (twin[0], twin[2])


@needs_native
def test_core_refuses_to_convert_arrays() -> None:
    """A converting cast would write into a copy (lost) or truncate int64 to uint8."""
    from streamcache import _core

    sources = [np.arange(32, dtype=np.uint8)]
    which, rows = np.zeros(2, np.int32), np.arange(2, dtype=np.int64)
    strided_out = np.zeros(32, np.uint8)[::2]
    read_only = np.zeros(16, np.uint8)
    read_only.flags.writeable = False
    for args in [
        (sources, 8, which, rows, strided_out),
        (sources, 8, which, rows, read_only),
        ([np.arange(4, dtype=np.int64)], 8, which, rows, np.zeros(16, np.uint8)),
        (sources, 8, which.astype(np.int64), rows, np.zeros(16, np.uint8)),
        (sources, 8, which, rows.astype(np.int32), np.zeros(16, np.uint8)),
        (sources, 8, which, np.arange(4, dtype=np.int64)[::2], np.zeros(16, np.uint8)),
    ]:
        with pytest.raises(TypeError):
            _core.gather_fixed(*args)
    assert not strided_out.any()


def test_non_contiguous_out_is_refused_not_copied(backend: str) -> None:
    out = np.zeros((4, 8), np.uint8)[:, ::2]
    with pytest.raises(NativeError, match="out must be C-contiguous"):
        _native.gather_fixed([np.ones(64, np.uint8)], 4, np.zeros(4, np.int32),
                             np.arange(4, dtype=np.int64), out)


@pytest.mark.parametrize("case", ["int64 sources", "int64 which", "int32 rows", "float rows",
                                  "strided which", "2-d rows", "list rows"])
def test_wrong_arrays_are_refused_with_a_clear_error(backend: str, case: str) -> None:
    sources: list[Any] = [np.arange(32, dtype=np.uint8)]
    which: Any = np.zeros(2, np.int32)
    rows: Any = np.arange(2, dtype=np.int64)
    if case == "int64 sources":
        sources = [np.arange(4, dtype=np.int64)]
    elif case == "int64 which":
        which = which.astype(np.int64)
    elif case == "int32 rows":
        rows = rows.astype(np.int32)
    elif case == "float rows":
        rows = rows.astype(np.float64)
    elif case == "strided which":
        which = np.zeros(4, np.int32)[::2]
    elif case == "2-d rows":
        rows = rows.reshape(1, 2)
    else:
        rows = [0, 1]
    out = np.zeros(16, np.uint8)
    with pytest.raises(NativeError, match=r"gather_fixed: (sources|which|rows)"):
        _native.gather_fixed(sources, 8, which, rows, out)
    with pytest.raises(NativeError, match=r"var_offsets: (values|which|rows)"):
        _native.gather_var(sources, [np.array([0, 4, 8, 32], np.int64)], 1, which, rows)
    assert not out.any()


# --------------------------------------------------------- the same refusal on every backend

FIXED_DEFECTS = [
    "row past the end", "negative row", "shard past the end", "negative shard",
    "lengths differ", "zero stride", "negative stride", "overflowing stride", "small output",
    "int64 which", "int32 rows", "int64 source", "strided source", "strided which",
    "strided rows", "read-only out", "2-d which",
]
VAR_DEFECTS = [
    "negative first offset", "decreasing offsets", "offset past the values", "row past the end",
    "negative row", "shard past the end", "lengths differ", "zero elem_size",
    "negative elem_size", "lists differ", "empty offsets", "int32 offsets", "int64 values",
    "strided values", "strided offsets", "int64 which", "strided rows",
]


def _strided(array: np.ndarray) -> np.ndarray:
    """The same values with a stride of two elements (two zeros if there are fewer than two:
    numpy calls every array of one element contiguous)."""
    doubled = np.zeros(2 * max(array.size, 2), array.dtype)
    doubled[:2 * array.size:2] = array
    return doubled[:2 * max(array.size, 2):2]


@given(
    defect=st.sampled_from(FIXED_DEFECTS),
    stride=st.integers(1, 16),
    shard_rows=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    picks=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=120, deadline=None)
def test_invalid_fixed_requests_raise_alike(defect: str, stride: int, shard_rows: list[int],
                                            picks: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sources: list[np.ndarray] = [rng.integers(0, 256, n * stride, dtype=np.uint8)
                                 for n in shard_rows]
    which: np.ndarray = rng.integers(0, len(shard_rows), picks).astype(np.int32)
    rows: np.ndarray = np.array([rng.integers(0, shard_rows[w]) for w in which], np.int64)
    out_bytes = picks * stride
    k = int(rng.integers(0, picks))
    if defect == "row past the end":
        rows[k] = shard_rows[which[k]]
    elif defect == "negative row":
        rows[k] = -1 - int(rng.integers(0, 2**40))
    elif defect == "shard past the end":
        which[k] = len(sources)
    elif defect == "negative shard":
        which[k] = -1
    elif defect == "lengths differ":
        rows = np.append(rows, np.int64(0))
    elif defect == "zero stride":
        stride = 0
    elif defect == "negative stride":
        stride = -stride
    elif defect == "overflowing stride":  # 4 * stride wraps around to 0 in 64 bits
        stride, which, rows = 2**62, np.zeros(4, np.int32), np.zeros(4, np.int64)
        out_bytes = 16
    elif defect == "small output":
        out_bytes -= 1
    elif defect == "int64 which":
        which = which.astype(np.int64)
    elif defect == "int32 rows":
        rows = rows.astype(np.int32)
    elif defect == "int64 source":
        sources[-1] = sources[-1].astype(np.int64)
    elif defect == "strided source":
        sources[-1] = _strided(sources[-1])
    elif defect == "strided which":
        which = _strided(which)
    elif defect == "strided rows":
        rows = _strided(rows)
    elif defect == "2-d which":
        which = which.reshape(1, -1)
    read_only = defect == "read-only out"

    def call() -> None:
        whole, out = _guarded(out_bytes)
        out.flags.writeable = not read_only
        try:
            _native.gather_fixed(sources, stride, which, rows, out)
        finally:
            assert _guards_intact(whole)

    outcome = _same_on_every_backend(call)
    assert outcome[0] != "returned" and issubclass(outcome[0], StreamcacheError), outcome


@given(
    defect=st.sampled_from(VAR_DEFECTS),
    elem_size=st.sampled_from([1, 2, 4, 8]),
    lengths=st.lists(st.lists(st.integers(0, 6), min_size=2, max_size=6), min_size=1,
                     max_size=3),
    picks=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=120, deadline=None)
def test_invalid_var_requests_raise_alike(defect: str, elem_size: int, lengths: list[list[int]],
                                          picks: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    offsets: list[np.ndarray] = [np.concatenate([[0], np.cumsum(ls)]).astype(np.int64)
                                 for ls in lengths]
    values: list[np.ndarray] = [rng.integers(0, 256, int(o[-1]) * elem_size, dtype=np.uint8)
                                for o in offsets]
    which: np.ndarray = rng.integers(0, len(lengths), picks).astype(np.int32)
    rows: np.ndarray = np.array([rng.integers(0, len(lengths[w])) for w in which], np.int64)
    k = int(rng.integers(0, picks))
    shard, row = int(which[k]), int(rows[k])
    if defect == "negative first offset":
        offsets[shard][row] = -1 - int(rng.integers(0, 2**40))
    elif defect == "decreasing offsets":
        offsets[shard][row + 1] = offsets[shard][row] - 1 - int(rng.integers(0, 4))
    elif defect == "offset past the values":
        offsets[shard][row + 1] = values[shard].size // elem_size + 1 + int(rng.integers(0, 4))
    elif defect == "row past the end":
        rows[k] = len(lengths[shard])
    elif defect == "negative row":
        rows[k] = -1
    elif defect == "shard past the end":
        which[k] = len(values)
    elif defect == "lengths differ":
        which = which[:-1]
    elif defect == "zero elem_size":
        elem_size = 0
    elif defect == "negative elem_size":
        elem_size = -elem_size
    elif defect == "lists differ":
        offsets = [*offsets, offsets[0]]
    elif defect == "empty offsets":
        offsets[shard] = np.empty(0, np.int64)
    elif defect == "int32 offsets":
        offsets[shard] = offsets[shard].astype(np.int32)
    elif defect == "int64 values":
        values[shard] = values[shard].astype(np.int64)
    elif defect == "strided values":
        values[shard] = _strided(values[shard])
    elif defect == "strided offsets":
        offsets[shard] = _strided(offsets[shard])
    elif defect == "int64 which":
        which = which.astype(np.int64)
    elif defect == "strided rows":
        rows = _strided(rows)

    outcome = _same_on_every_backend(
        lambda: _native.gather_var(values, offsets, elem_size, which, rows))
    assert outcome[0] != "returned" and issubclass(outcome[0], StreamcacheError), outcome


@needs_native
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    shift=st.integers(-2**62, 2**62),
    at=st.integers(0, 8),
    elem_size=st.sampled_from([1, 2, 8]),
)
@settings(max_examples=120, deadline=None)
def test_core_and_twin_agree_on_shifted_out_offsets(lengths: list[int], shift: int, at: int,
                                                    elem_size: int) -> None:
    """gather_var's out_offsets come from the caller: any shifted entry is caught by both."""
    from streamcache import _core

    offsets = [np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)]
    values = [np.arange(int(offsets[0][-1]) * elem_size, dtype=np.uint8)]
    n = len(lengths)
    which, rows = np.zeros(n, np.int32), np.arange(n, dtype=np.int64)
    out_offsets = offsets[0].copy()
    out_offsets[min(at, n)] += shift
    size = int(offsets[0][-1]) * elem_size
    results = []
    for gather in (_core.gather_var, _twin.gather_var):
        whole, out = _guarded(size)
        status = gather(values, offsets, elem_size, which, rows, out_offsets, out)
        assert _guards_intact(whole)
        results.append((status, out.copy()))
    (native_status, native_out), (twin_status, twin_out) = results
    assert native_status == twin_status
    if native_status[0] == 0:
        assert shift == 0 and np.array_equal(native_out, twin_out)


@pytest.mark.parametrize("bad", [(15, 16), (0, 31), (3, 20, 21), (31,)])
def test_a_parallel_gather_reports_the_first_bad_item_like_the_twin(bad: tuple[int, ...]) -> None:
    """Batches over a megabyte are split over the pool; the error is still the lowest item's."""
    rng = np.random.default_rng(sum(bad))
    stride, n = 100_000, 32  # 3.2 MB: the parallel path
    sources = [rng.integers(0, 256, 32 * stride, dtype=np.uint8)]
    which, rows = np.zeros(n, np.int32), rng.integers(0, 32, n).astype(np.int64)
    rows[list(bad)] = 32
    outcome = _same_on_every_backend(lambda: _native.gather_fixed(
        sources, stride, which, rows, np.empty((n, stride), np.uint8)))
    assert outcome[3] == bad[0], outcome


@needs_native
@pytest.mark.parametrize("bad", [(15, 16), (0, 30), (3, 20, 21), (30,)])
def test_a_parallel_var_gather_reports_the_first_bad_item_like_the_twin(
        bad: tuple[int, ...]) -> None:
    from streamcache import _core

    stride, n = 100_000, 32
    values = [np.random.default_rng(sum(bad)).integers(0, 256, n * stride, dtype=np.uint8)]
    offsets = [np.arange(0, n * stride + 1, stride, dtype=np.int64)]
    which, rows = np.zeros(n, np.int32), np.arange(n, dtype=np.int64)
    out_offsets = offsets[0].copy()
    for item in bad:  # the output ranges of these items end before they begin
        out_offsets[item + 1] = out_offsets[item] - 1
    statuses = [gather(values, offsets, 1, which, rows, out_offsets, np.empty(n * stride, np.uint8))
                for gather in (_core.gather_var, _twin.gather_var)]
    assert statuses[0] == statuses[1]
    assert statuses[0][:2] == (INVALID, bad[0])
