"""The multi-node split's paid moves in native code (``_native.paid_moves``, csrc/split.cpp)
and its numpy twin: both equal a plain statement of the rule, written here with loops, and
both refuse an impossible request without writing anything."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.errors import NativeError


def rule(nodes: np.ndarray, candidate: np.ndarray, hashed: np.ndarray, surplus: np.ndarray,
         width: int, bits: int) -> np.ndarray:
    """csrc/split.h's rule, one step and one node at a time."""
    out = nodes.copy()
    count = surplus.shape[1]
    for step, need in enumerate(surplus):
        mine = [(j, int(c)) for j, c in enumerate(candidate) if c // width == step]
        released = []
        for node in range(count):
            if need[node] <= 0:
                continue
            ranked = sorted((int(hashed[j]) >> (64 - bits), slot, j) for j, slot in mine
                            if nodes[slot] == node)
            released += [(slot, j) for _, slot, j in ranked[:need[node]]]
        taken = [0] * count
        rest = []
        for slot, j in sorted(released):
            backup = (int(nodes[slot]) + 1 + int(hashed[j]) % (count - 1)) % count
            if taken[backup] < -need[backup]:
                out[slot] = backup
                taken[backup] += 1
            else:
                rest.append(slot)
        room = [node for node in range(count) for _ in range(max(0, -need[node]) - taken[node])]
        assert len(room) == len(rest)
        for slot, node in zip(rest, room, strict=True):
            out[slot] = node
    return out


@st.composite
def requests(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]:
    """A balanced request: every step's targets sum to its width; the candidates are the
    slots of nodes with a surplus (as the split asks), or, sometimes, more slots than that."""
    count = draw(st.integers(1, 9))
    steps = draw(st.integers(0, 5))
    width = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    bits = draw(st.sampled_from([1, 3, 20, 32]))
    rng = np.random.default_rng(seed)
    skew = rng.dirichlet(np.full(count, draw(st.sampled_from([0.3, 1.0, 50.0]))))
    nodes = rng.choice(count, size=steps * width, p=skew).astype(np.int64)
    targets = np.array([np.bincount(rng.integers(0, count, width), minlength=count)
                        for _ in range(steps)], dtype=np.int64).reshape(steps, count)
    have = np.bincount(nodes + np.repeat(np.arange(steps) * count, width),
                       minlength=steps * count).reshape(steps, count)
    surplus = have - targets
    on_surplus = surplus.ravel()[nodes + np.repeat(np.arange(steps) * count, width)] > 0
    extra = rng.random(nodes.size) < draw(st.sampled_from([0.0, 0.3]))
    candidate = np.flatnonzero(on_surplus | extra)
    # hashes with many equal priorities (ties go by slot)
    hashed = rng.integers(0, 2**64, candidate.size, dtype=np.uint64, endpoint=False)
    if draw(st.booleans()):
        hashed &= np.uint64(0xC000_0000_0000_00FF)
    return nodes, candidate, hashed, surplus, width, bits


@given(requests())
@settings(max_examples=150, deadline=None)
def test_paid_moves_follow_the_rule_on_both_backends(
        request: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]) -> None:
    nodes, candidate, hashed, surplus, width, bits = request
    want = rule(nodes, candidate, hashed, surplus, width, bits)
    for name in _native.available_backends():
        got = nodes.copy()
        with _native.use(name):
            _native.paid_moves(got, candidate, hashed, surplus, width, bits)
        assert got.tolist() == want.tolist(), name
        # every step meets its targets exactly
        steps = surplus.shape[0]
        if steps and width:
            counts = np.stack([np.bincount(row, minlength=surplus.shape[1])
                               for row in got.reshape(steps, width)])
            before = np.stack([np.bincount(row, minlength=surplus.shape[1])
                               for row in nodes.reshape(steps, width)])
            assert (counts == before - surplus).all(), name


def _request() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Two steps of 4 slots over 2 nodes: step 0 gives node 0 one too many."""
    nodes = np.array([0, 0, 0, 1, 0, 1, 0, 1], dtype=np.int64)
    surplus = np.array([[1, -1], [0, 0]], dtype=np.int64)
    candidate = np.array([0, 1, 2], dtype=np.int64)
    hashed = np.array([5 << 60, 1 << 60, 9 << 60], dtype=np.uint64)
    return nodes, candidate, hashed, surplus


def test_paid_moves_small_case(backend: str) -> None:
    nodes, candidate, hashed, surplus = _request()
    _native.paid_moves(nodes, candidate, hashed, surplus, 4, 20)
    assert nodes.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]  # slot 1: the lowest priority


@pytest.mark.parametrize(("change", "message"), [
    (lambda n, c, h, s: (n, c, h, s + np.array([[0, 1], [0, 0]])), "surpluses sum to 1"),
    (lambda n, c, h, s: (n, c[::-1].copy(), h, s), "strictly ascending"),
    (lambda n, c, h, s: (n, np.array([0, 0, 2]), h, s), "strictly ascending"),
    (lambda n, c, h, s: (n, np.array([-1, 1, 2]), h, s), "strictly ascending"),
    (lambda n, c, h, s: (n, np.array([0, 1, 8]), h, s), "not below steps \\* width"),
    (lambda n, c, h, s: (np.where(np.arange(8) == 1, 7, n), c, h, s), "node 7 is not below 2"),
    (lambda n, c, h, s: (n, c[:0], h[:0], s), "only 0 candidates"),
    (lambda n, c, h, s: (n, c, h[:2], s), "hashed holds 2 entries for 3 candidates"),
    (lambda n, c, h, s: (n[:7], c, h, s), "nodes holds 7 slots"),
    (lambda n, c, h, s: (n, c, h, s.reshape(1, 4)), "nodes holds 8 slots, the 1 steps"),
    (lambda n, c, h, s: (n.astype(np.int32), c, h, s), "nodes must have dtype int64"),
    (lambda n, c, h, s: (n, c.astype(np.uint64), h, s), "candidate must have dtype int64"),
    (lambda n, c, h, s: (n, c, h.astype(np.int64), s), "hashed must have dtype uint64"),
    (lambda n, c, h, s: (np.repeat(n, 2)[::2], c, h, s), "nodes must be C-contiguous"),
    (lambda n, c, h, s: (n, c, h, s.ravel()), "surplus must be an int64 array \\(steps, nodes\\)"),
    (lambda n, c, h, s: (n, c, h, s.astype(np.float64)), "surplus must be an int64 array"),
])
def test_paid_moves_refuse_without_writing(backend: str, change, message: str) -> None:
    nodes, candidate, hashed, surplus = change(*_request())
    before = nodes.copy()
    with pytest.raises(NativeError, match=message):
        _native.paid_moves(nodes, candidate, hashed, surplus, 4, 20)
    assert nodes.tolist() == before.tolist()


def test_paid_moves_refuse_a_read_only_output_and_bad_settings(backend: str) -> None:
    nodes, candidate, hashed, surplus = _request()
    frozen = nodes.copy()
    frozen.flags.writeable = False
    with pytest.raises(NativeError, match="nodes must be writable"):
        _native.paid_moves(frozen, candidate, hashed, surplus, 4, 20)
    for bits in (0, 33):
        with pytest.raises(NativeError, match="priority_bits must be in"):
            _native.paid_moves(nodes, candidate, hashed, surplus, 4, bits)
    with pytest.raises(NativeError, match="width must not be negative"):
        _native.paid_moves(nodes[:0], candidate[:0], hashed[:0], surplus[:0], -1, 20)
    with pytest.raises(NativeError, match="count must be at least 1"):
        _native.paid_moves(nodes[:0], candidate[:0], hashed[:0], surplus[:0, :0], 4, 20)
    assert nodes.tolist() == _request()[0].tolist()
