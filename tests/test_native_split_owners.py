"""The multi-node split's other native kernels (csrc/split.cpp) and their numpy twins:
``_native.owner_nodes`` (each slot's piece, owner and each step's surplus) and
``_native.release_moves`` (the paid moves of the slots on nodes with a surplus, hashed by
their chunk keys). Both equal a plain statement written here, and refuse hostile tables,
entries and sizes with the same error on both backends, without writing ``nodes``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_split import rule

from streamcache import _native
from streamcache.errors import NativeError
from streamcache.plan.bijection import counter_hash

WHOLE = np.iinfo(np.int64).max


@st.composite
def tables(draw: st.DrawFn) -> dict:
    """Value tables (offsets, piece rows, chunk key bases and rows), slots pointing into them,
    steps of ``width`` slots and each node's target."""
    count = draw(st.integers(1, 9))
    steps = draw(st.integers(0, 5))
    width = draw(st.integers(1, 40))
    values = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    big = draw(st.booleans())
    total = steps * width
    targets = np.bincount(rng.integers(0, count, width), minlength=count).astype(np.int64)
    return {
        "count": count, "steps": steps, "width": width, "targets": targets,
        "at": rng.integers(0, values, total).astype(np.int64),
        "rows": rng.integers(0, 2**40 if big else 500, total).astype(np.int64),
        "offsets": rng.integers(0, count, values).astype(np.int64),
        "piece_rows": np.where(rng.random(values) < 0.2, WHOLE,
                               rng.integers(1, 2**20 if big else 60, values)).astype(np.int64),
        "key_base": rng.integers(-2**62, 2**62, values).astype(np.int64),
        "key_rows": np.where(rng.random(values) < 0.2, WHOLE,
                             rng.integers(1, 80, values)).astype(np.int64),
        "bits": draw(st.sampled_from([1, 2, 20, 32])),
        "key": draw(st.integers(0, 2**64 - 1)),
    }


def owners_by_loop(t: dict) -> tuple[list[int], list[int], list[list[int]]]:
    """csrc/split.h's owner rule, one slot at a time (Python integers: no overflow)."""
    count, width = t["count"], t["width"]
    piece, nodes = [], []
    surplus = [[-int(x) for x in t["targets"]] for _ in range(t["steps"])]
    for i, (v, row) in enumerate(zip(t["at"].tolist(), t["rows"].tolist(), strict=True)):
        index = row // int(t["piece_rows"][v])
        node = (int(t["offsets"][v]) + index) % count
        piece.append(index)
        nodes.append(node)
        surplus[i // width][node] += 1
    return nodes, piece, surplus


@given(tables())
@settings(max_examples=120, deadline=None)
def test_owner_nodes_follow_the_rule_on_both_backends(t: dict) -> None:
    want = owners_by_loop(t)
    for name in _native.available_backends():
        with _native.use(name):
            nodes, piece, surplus = _native.owner_nodes(
                t["at"], t["rows"], t["offsets"], t["piece_rows"], t["targets"], t["width"])
        assert (nodes.tolist(), piece.tolist(), surplus.tolist()) == want, name


@given(tables())
@settings(max_examples=120, deadline=None)
def test_release_moves_are_the_paid_moves_of_the_surplus_slots_on_both_backends(t: dict) -> None:
    nodes, _, surplus = (np.asarray(a, dtype=np.int64) for a in owners_by_loop(t))
    surplus = surplus.reshape(t["steps"], t["count"])
    width = t["width"]
    step = np.arange(nodes.size) // width
    candidate = np.flatnonzero(surplus[step, nodes] > 0) if nodes.size else nodes[:0]
    v = t["at"][candidate]
    keys = [(int(t["key_base"][e]) + int(r) // int(t["key_rows"][e])) % 2**64
            for e, r in zip(v.tolist(), t["rows"][candidate].tolist(), strict=True)]
    hashed = counter_hash(t["key"], np.array(keys, dtype=np.uint64))
    want = rule(nodes, candidate, hashed, surplus, width, t["bits"])
    for name in _native.available_backends():
        got = nodes.copy()
        with _native.use(name):
            _native.release_moves(got, surplus, t["at"], t["rows"], t["key_base"],
                                  t["key_rows"], t["key"], width, t["bits"])
        assert got.tolist() == want.tolist(), name


def _small() -> dict:
    """Two steps of 4 slots over 2 nodes; step 0 gives node 0 one too many (slots 0-2 are its
    candidates), step 1 is balanced."""
    return {"nodes": np.array([0, 0, 0, 1, 0, 1, 0, 1], dtype=np.int64),
            "surplus": np.array([[1, -1], [0, 0]], dtype=np.int64),
            "at": np.array([0, 1, 2, 0, 1, 2, 0, 1], dtype=np.int64),
            "rows": np.arange(8, dtype=np.int64),
            "key_base": np.array([0, 100, 200], dtype=np.int64),
            "key_rows": np.array([1, 1, 1], dtype=np.int64),
            "offsets": np.array([0, 1, 0], dtype=np.int64),
            "piece_rows": np.array([4, 4, 4], dtype=np.int64),
            "targets": np.array([2, 2], dtype=np.int64)}


def _release(a: dict, width: int = 4, bits: int = 20) -> None:
    _native.release_moves(a["nodes"], a["surplus"], a["at"], a["rows"], a["key_base"],
                          a["key_rows"], 12345, width, bits)


def _set(name: str, index: int | tuple, value: int):
    def change(a: dict) -> dict:
        a[name] = a[name].copy()
        a[name][index] = value
        return a
    return change


def _with(name: str, value):
    def change(a: dict) -> dict:
        a[name] = value(a[name])
        return a
    return change


@pytest.mark.parametrize(("change", "message"), [
    (_set("surplus", (1, 0), 1), "step 1's surpluses sum to 1, not 0"),
    (_set("nodes", 5, 2), "slot 5's node 2 is not below 2"),
    (_set("nodes", 3, -1), "slot 3's node -1 is not below 2"),
    (_set("at", 1, 3), "slot 1's entry 3 is not below 3"),
    (_set("at", 2, -4), "slot 2's entry -4 is not below 3"),
    (_set("rows", 0, -1), "slot 0's row -1 or key rows 1 is out of range"),
    (_set("key_rows", 1, 0), "slot 1's row 1 or key rows 0 is out of range"),
    (_set("key_rows", 2, -7), "slot 2's row 2 or key rows -7 is out of range"),
    (_with("surplus", lambda s: np.array([[4, -4], [0, 0]], dtype=np.int64)),
     "node 0 has a surplus of 4 in step 0 but only 3 candidates"),
    (_with("at", lambda a: a[:7]), "at and rows must hold one entry per slot"),
    (_with("key_rows", lambda a: a[:2]), "key_base and key_rows must hold one entry"),
    (_with("surplus", lambda s: s.reshape(1, 4)), "nodes holds 8 slots, the 1 steps"),
    (_with("surplus", lambda s: s[:, :0]), "count must be at least 1"),
    (_with("surplus", lambda s: s.ravel()), "surplus must be an int64 array \\(steps, nodes\\)"),
    (_with("nodes", lambda n: n.astype(np.int32)), "nodes must have dtype int64"),
    (_with("at", lambda a: a.astype(np.uint64)), "at must have dtype int64"),
    (_with("key_base", lambda a: np.repeat(a, 2)[::2]), "key_base must be C-contiguous"),
    (_with("rows", lambda a: a.astype(np.float64)), "rows must have dtype int64"),
])
def test_release_moves_refuse_without_writing(backend: str, change, message: str) -> None:
    a = change(_small())
    before = np.array(a["nodes"]).copy()
    with pytest.raises(NativeError, match=message):
        _release(a)
    assert np.array(a["nodes"]).tolist() == before.tolist()


def test_release_moves_read_only_the_candidates_tables(backend: str) -> None:
    """A slot on a node without a surplus is not a candidate: its entry and row are not read
    (the split passes every slot; only the released ones need a chunk key)."""
    sane = _small()
    _release(sane)
    a = _small()
    a["at"][3] = 99  # (slot 3 is on node 1, short in step 0)
    a["rows"][3] = -5
    a["at"][4:] = -1  # (step 1 is balanced: no candidates)
    _release(a)
    assert a["nodes"].tolist() == sane["nodes"].tolist()
    assert sorted(np.flatnonzero(sane["nodes"] != _small()["nodes"])) == [2]  # one released


def test_release_moves_refuse_a_read_only_output_and_bad_settings(backend: str) -> None:
    a = _small()
    a["nodes"].flags.writeable = False
    with pytest.raises(NativeError, match="nodes must be writable"):
        _release(a)
    a = _small()
    for bits in (0, 33):
        with pytest.raises(NativeError, match="priority_bits must be in"):
            _release(a, bits=bits)
    with pytest.raises(NativeError, match="width must not be negative"):
        _release(a, width=-4)
    assert a["nodes"].tolist() == _small()["nodes"].tolist()


def _owners(a: dict, width: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _native.owner_nodes(a["at"], a["rows"], a["offsets"], a["piece_rows"],
                               a["targets"], width)


def test_owner_nodes_small_case(backend: str) -> None:
    nodes, piece, surplus = _owners(_small())
    assert piece.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert nodes.tolist() == [0, 1, 0, 0, 0, 1, 1, 0]
    assert surplus.tolist() == [[1, -1], [0, 0]]


@pytest.mark.parametrize(("change", "message"), [
    (_set("at", 6, 3), "slot 6's entry 3 is not below 3"),
    (_set("at", 0, -1), "slot 0's entry -1 is not below 3"),
    (_set("rows", 5, -2), "slot 5's row -2 is negative"),
    (_set("piece_rows", 1, 0), "slot 1's piece rows 0 or offset 1 is out of range"),
    (_set("piece_rows", 2, -3), "slot 2's piece rows -3 or offset 0 is out of range"),
    (_set("offsets", 0, 2), "slot 0's piece rows 4 or offset 2 is out of range"),
    (_set("offsets", 1, -1), "slot 1's piece rows 4 or offset -1 is out of range"),
    (_with("rows", lambda a: a[:7]), "at, rows, nodes and piece must hold one entry per slot"),
    (_with("offsets", lambda a: a[:2]), "offsets and piece_rows must hold one entry per value"),
    (_with("targets", lambda a: a[:0]), "count must be at least 1"),
    (_with("at", lambda a: a.astype(np.int32)), "at must have dtype int64"),
    (_with("targets", lambda a: a.astype(np.float32)), "targets must have dtype int64"),
    (_with("piece_rows", lambda a: np.repeat(a, 2)[::2]), "piece_rows must be C-contiguous"),
    (_with("offsets", lambda a: [0, 1, 0]), "offsets must be a numpy array"),
])
def test_owner_nodes_refuse(backend: str, change, message: str) -> None:
    with pytest.raises(NativeError, match=message):
        _owners(change(_small()))


def test_owner_nodes_refuse_steps_that_are_not_whole(backend: str) -> None:
    with pytest.raises(NativeError, match="8 slots are not whole steps of 3"):
        _owners(_small(), width=3)
    with pytest.raises(NativeError, match="8 slots are not whole steps of 0"):
        _owners(_small(), width=0)
    with pytest.raises(NativeError, match="width must not be negative"):
        _owners(_small(), width=-1)
    empty = {k: (v[:0] if k in ("at", "rows") else v) for k, v in _small().items()}
    nodes, piece, surplus = _owners(empty, width=0)
    assert nodes.size == piece.size == surplus.size == 0


@given(tables(), st.integers(0, 2**32 - 1), st.sampled_from(
    ["at", "rows", "offsets", "piece_rows", "key_rows", "nodes", "surplus"]),
    st.sampled_from([-1, 0, 1, 2**31, -2**63, 2**63 - 1]))
@settings(max_examples=150, deadline=None)
def test_a_corrupted_request_gets_the_same_answer_from_both_backends(
        t: dict, seed: int, field: str, value: int) -> None:
    """One value of a valid request replaced by a hostile one: both backends refuse it with
    the same error, or both accept it with the same result (and a refused call writes
    nothing to ``nodes``)."""
    nodes, _, surplus = (np.asarray(a, dtype=np.int64) for a in owners_by_loop(t))
    arrays = dict(t, nodes=nodes, surplus=surplus)
    target = arrays[field]
    if target.size:
        target = target.copy().ravel()
        target[np.random.default_rng(seed).integers(target.size)] = value
        arrays[field] = target
    answers = []
    for name in _native.available_backends():
        got = arrays["nodes"].copy()
        with _native.use(name):
            try:
                owned = _native.owner_nodes(arrays["at"], arrays["rows"], arrays["offsets"],
                                            arrays["piece_rows"], t["targets"], t["width"])
                owners = [a.tolist() for a in owned]
            except NativeError as exc:
                owners = [str(exc), exc.code, exc.item]
            try:
                _native.release_moves(got, arrays["surplus"].reshape(t["steps"], t["count"]),
                                      arrays["at"], arrays["rows"], t["key_base"],
                                      arrays["key_rows"], t["key"], t["width"], t["bits"])
                moved = got.tolist()
            except NativeError as exc:
                assert got.tolist() == arrays["nodes"].tolist(), name
                moved = [str(exc), exc.code, exc.item]
        answers.append((owners, moved))
    assert all(answer == answers[0] for answer in answers), answers
