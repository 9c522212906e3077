"""The plan's Feistel pass (``_native.feistel_walk``, csrc/feistel.cpp; its numpy twin in
streamcache/_twin_bijection.py): the native pass gives the twin's images bit for bit, every
image lies in its domain and every domain is permuted; what no plan makes (a point outside
its domain, a size beyond the width, arrays of the wrong kind) is refused with a message,
never walked forever."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.errors import NativeError
from streamcache.plan.bijection import MAX_DOMAIN, _width, permute

ROUNDS = 6

pytestmark = pytest.mark.skipif("native" not in _native.available_backends(),
                                reason="no extension")


def _walk(backend: str, points: np.ndarray, sizes: np.ndarray, keys: np.ndarray,
          width: int) -> np.ndarray:
    with _native.use(backend):
        return _native.feistel_walk(points, sizes, keys, width)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), per_point=st.booleans(),
       n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_native_images_are_the_twins(data: st.DataObject, per_point: bool, n: int,
                                     seed: int) -> None:
    rng = np.random.default_rng(seed)
    width = data.draw(st.integers(2, 32), label="width")
    low = 1 << (width - 1) if width > 2 else 1
    high = min(1 << width, MAX_DOMAIN)
    if per_point:
        sizes = rng.integers(low, high, size=n, endpoint=True, dtype=np.uint64)
        keys = rng.integers(0, 2**32, size=(ROUNDS, n), dtype=np.uint32)
    else:
        sizes = np.array([data.draw(st.integers(low, high), label="size")], dtype=np.uint64)
        keys = rng.integers(0, 2**32, size=(ROUNDS, 1), dtype=np.uint32)
    domain = np.broadcast_to(sizes, (n,)) if n else np.zeros(0, dtype=np.uint64)
    points = (rng.random(n) * domain).astype(np.int64)
    native = _walk("native", points, sizes, keys, width)
    twin = _walk("twin", points, sizes, keys, width)
    assert native.dtype == np.int64 and np.array_equal(native, twin), seed
    assert ((native >= 0) & (native.astype(np.uint64) < domain)).all()


@pytest.mark.parametrize("size", [1, 2, 3, 5, 64, 1000, 4097])
def test_every_domain_is_permuted(backend: str, size: int) -> None:
    keys = np.arange(1, ROUNDS + 1, dtype=np.uint32).reshape(-1, 1) * np.uint32(0x9E37)
    images = _native.feistel_walk(np.arange(size, dtype=np.int64),
                                  np.array([size], dtype=np.uint64), keys, _width(size))
    assert sorted(images.tolist()) == list(range(size))


def test_permute_is_the_same_on_both_backends_for_groups_of_mixed_widths() -> None:
    sizes = np.array([1, 7, 300, 5000, 70_000, MAX_DOMAIN], dtype=np.int64)
    keys = np.arange(len(sizes), dtype=np.uint64) * np.uint64(0x1234_5678_9ABC)
    rng = np.random.default_rng(3)
    group = rng.integers(0, len(sizes), size=2000)
    points = (rng.random(2000) * sizes[group]).astype(np.int64)
    results = []
    for backend in _native.available_backends():
        with _native.use(backend):
            results.append(permute(points, sizes, keys, group))
            assert permute(np.arange(8, dtype=np.int64), 8, 99).tolist() == \
                [6, 4, 5, 3, 7, 1, 0, 2]  # pinned (tests/test_plan.py)
    assert all(np.array_equal(results[0], other) for other in results[1:])
    assert (results[0] < sizes[group]).all()


def _keys(columns: int = 1) -> np.ndarray:
    return np.ones((ROUNDS, columns), dtype=np.uint32)


@pytest.mark.parametrize("points, sizes, width, message", [
    ([5], [5], 3, "outside its domain"),  # its walk would never come back into [0, 5)
    ([-1], [5], 3, "outside its domain"),
    ([0], [9], 3, "exceeds 2\\*\\*3"),
    ([0], [2], 1, "width must be 2..32"),
    ([0], [2], 33, "width must be 2..32"),
])
def test_what_no_plan_makes_is_refused(backend: str, points: list[int], sizes: list[int],
                                       width: int, message: str) -> None:
    with pytest.raises(NativeError, match=message):
        _native.feistel_walk(np.array(points, dtype=np.int64),
                             np.array(sizes, dtype=np.uint64), _keys(), width)


def test_arrays_of_the_wrong_kind_are_refused(backend: str) -> None:
    points = np.arange(4, dtype=np.int64)
    sizes = np.array([8], dtype=np.uint64)
    with pytest.raises(NativeError, match="one per point"):
        _native.feistel_walk(points, np.array([8, 8], dtype=np.uint64), _keys(), 3)
    with pytest.raises(NativeError, match="one per point"):
        _native.feistel_walk(points, sizes, _keys(3), 3)
    assert _native.feistel_walk(points[:0], sizes, _keys(), 3).size == 0


def test_the_native_pass_refuses_arrays_it_does_not_convert() -> None:
    with _native.use("native"), pytest.raises(NativeError):
        _native.feistel_walk(np.arange(4, dtype=np.float64), np.array([8], dtype=np.uint64),
                             _keys(), 3)
