"""The choice of the pieces two nodes hold in native code (``_native.choose_backups``,
csrc/backups.cpp) and its numpy twin (``_twin_backups``): both equal a plain statement of the
rule in csrc/backups.h, written here with loops, and both refuse an impossible request
without writing anything."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.errors import NativeError


def rule(bounds: list[int], steps: list[int], rows: list[int], owner: list[int],
         chunks: list[int], surplus: list[list[int]], budget: int) -> list[int]:
    """csrc/backups.h's rule with lists and loops (``surplus`` updated)."""
    nodes = len(surplus[0]) if surplus else 0

    def counts(p: int) -> list[int]:
        found = [0] * nodes
        for e in range(bounds[p], bounds[p + 1]):
            moves = min(rows[e], max(surplus[steps[e]][owner[p]], 0))
            for n in range(nodes):
                found[n] += min(moves, max(-surplus[steps[e]][n], 0))
        found[owner[p]] = -1
        return found

    chosen = [-1] * len(owner)
    if budget <= 0:
        return chosen
    last = {p: max(counts(p)) for p in range(len(owner)) if chunks[p] > 0}
    last = {p: c for p, c in last.items() if c > chunks[p]}
    held = [0] * nodes
    taken = 0
    while last and taken < budget:
        p = min(last, key=lambda q: (-last[q], q))
        del last[p]
        found = counts(p)
        node = max(range(nodes), key=lambda n: (found[n] * (sum(held) + 1) - held[n], -n))
        if found[node] <= chunks[p]:
            continue
        if last and found[node] < max(last.values()):
            last[p] = found[node]
            continue
        for e in range(bounds[p], bounds[p + 1]):
            moved = min(rows[e], max(surplus[steps[e]][owner[p]], 0),
                        max(-surplus[steps[e]][node], 0))
            surplus[steps[e]][owner[p]] -= moved
            surplus[steps[e]][node] += moved
        held[node] += chunks[p]
        chosen[p] = node
        taken += 1
    return chosen


@st.composite
def requests(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    nodes = draw(st.integers(1, 7))
    num_steps = draw(st.integers(1, 10))
    pieces = draw(st.integers(0, 25))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    per_piece = rng.integers(0, num_steps + 1, pieces)  # (a piece may have no entries)
    steps = np.concatenate([np.sort(rng.choice(num_steps, k, replace=False))
                            for k in per_piece]).astype(np.int64) if pieces else \
        np.zeros(0, np.int64)
    rows = rng.integers(0, 6, steps.size).astype(np.int64)
    bounds = np.concatenate(([0], np.cumsum(per_piece))).astype(np.int64)
    owner = rng.integers(0, nodes, pieces).astype(np.int64)
    chunks = rng.integers(0, 4, pieces).astype(np.int64)
    surplus = rng.integers(-8, 9, (num_steps, nodes)).astype(np.int64)
    budget = np.array([draw(st.integers(-1, 30))])
    return bounds, steps, rows, owner, chunks, surplus, budget


@given(requests())
@settings(max_examples=200, deadline=None)
def test_the_choice_follows_the_rule_on_both_backends(request) -> None:
    bounds, steps, rows, owner, chunks, surplus, (budget,) = request
    expected_surplus = surplus.tolist()
    want = rule(bounds.tolist(), steps.tolist(), rows.tolist(), owner.tolist(),
                chunks.tolist(), expected_surplus, int(budget))
    for name in _native.available_backends():
        got_surplus = surplus.copy()
        with _native.use(name):
            got = _native.choose_backups(bounds, steps, rows, owner, chunks, got_surplus,
                                         int(budget))
        assert got.tolist() == want, name
        assert got_surplus.tolist() == expected_surplus, name
        assert all(got[p] != owner[p] for p in np.flatnonzero(got >= 0)), name


def _request() -> tuple[np.ndarray, ...]:
    """Two pieces of node 0 over two steps; node 0 has 3 too many in both, node 1 3 too few."""
    bounds = np.array([0, 2, 4], dtype=np.int64)
    steps = np.array([0, 1, 0, 1], dtype=np.int64)
    rows = np.array([2, 2, 1, 3], dtype=np.int64)
    owner = np.array([0, 0], dtype=np.int64)
    chunks = np.array([1, 1], dtype=np.int64)
    surplus = np.array([[3, -3], [3, -3]], dtype=np.int64)
    return bounds, steps, rows, owner, chunks, surplus


def test_a_small_choice(backend: str) -> None:
    bounds, steps, rows, owner, chunks, surplus = _request()
    # piece 0 moves 2 + 2, piece 1 then 1 + 1 (its 3 in step 1 meet a deficit of 1)
    assert _native.choose_backups(bounds, steps, rows, owner, chunks, surplus, 5).tolist() \
        == [1, 1]
    assert surplus.tolist() == [[0, 0], [0, 0]]
    bounds, steps, rows, owner, chunks, surplus = _request()
    assert _native.choose_backups(bounds, steps, rows, owner, chunks, surplus, 1).tolist() \
        == [1, -1]  # the budget: the piece that moves more
    assert _native.choose_backups(*_request(), 0).tolist() == [-1, -1]


@pytest.mark.parametrize("change, message", [
    (lambda b, s, r, o, c, u: (b.astype(np.int32), s, r, o, c, u),
     "bounds must have dtype int64"),
    (lambda b, s, r, o, c, u: (b, s, r, o, c, u.astype(np.int32)),
     "surplus must be an int64 array \\(steps, nodes\\)"),
    (lambda b, s, r, o, c, u: (b, s, r, o, c, u.ravel()), "surplus must be an int64 array"),
    (lambda b, s, r, o, c, u: (b[:-1], s, r, o, c, u), "bounds must hold pieces \\+ 1"),
    (lambda b, s, r, o, c, u: (b, s, r[:-1], o, c, u), "steps and rows must hold one value"),
    (lambda b, s, r, o, c, u: (b + 1, s, r, o, c, u), "bounds must rise from 0 to the 4"),
    (lambda b, s, r, o, c, u: (b[[0, 2, 1]], s, r, o, c, u), "bounds must rise from 0"),
    (lambda b, s, r, o, c, u: (b, s + np.array([0, 0, 0, 1]), r, o, c, u),
     "entry 3's step 2 or rows 3 is out of range \\(step below 2"),
    (lambda b, s, r, o, c, u: (b, s, r - np.array([0, 3, 0, 0]), o, c, u),
     "entry 1's step 1 or rows -1 is out of range"),
    (lambda b, s, r, o, c, u: (b, s, r, o + np.array([0, 2]), c, u),
     "piece 1's owner 2 or chunks 1 is out of range \\(owner below 2"),
    (lambda b, s, r, o, c, u: (b, s, r, o, c - 2, u), "piece 0's owner 0 or chunks -1"),
])
def test_an_impossible_request_is_refused_without_writing(backend: str, change,
                                                          message: str) -> None:
    bounds, steps, rows, owner, chunks, surplus = change(*_request())
    before = np.array(surplus, copy=True)
    with pytest.raises(NativeError, match=message):
        _native.choose_backups(bounds, steps, rows, owner, chunks, surplus, 5)
    assert np.array_equal(surplus, before)


def test_a_read_only_surplus_and_no_nodes_are_refused(backend: str) -> None:
    bounds, steps, rows, owner, chunks, surplus = _request()
    frozen = surplus.copy()
    frozen.flags.writeable = False
    with pytest.raises(NativeError, match="surplus must be writable"):
        _native.choose_backups(bounds, steps, rows, owner, chunks, frozen, 5)
    with pytest.raises(NativeError, match="nodes must be at least 1"):
        _native.choose_backups(bounds, steps, rows, owner, chunks, surplus[:, :0], 5)
