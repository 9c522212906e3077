"""The multi-node split's native kernels (``csrc/split.h``), from the C++ extension or its
twin (``streamcache._twin_split``): each slot's owner node and the paid moves that balance
each step. Re-exported by :mod:`streamcache._native`.

Thread safety: each function may be called from any thread; the native ones release the GIL.
"""

from __future__ import annotations

import numpy as np

from . import _native_backend, _twin_checks
from ._native_backend import CODE_INVALID, raise_error, refused
from .errors import NativeError

_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)


def _surplus_table(function: str, surplus: object) -> np.ndarray:
    """``surplus`` as the kernels take it: an int64 ``(steps, nodes)`` array."""
    if not isinstance(surplus, np.ndarray) or surplus.ndim != 2 or surplus.dtype != np.int64:
        shape = getattr(surplus, "shape", None)
        raise NativeError(f"{function}: surplus must be an int64 array (steps, nodes), got "
                          f"{getattr(surplus, 'dtype', type(surplus).__name__)} of shape "
                          f"{shape}", CODE_INVALID)
    return surplus


def owner_nodes(at: np.ndarray, rows: np.ndarray, offsets: np.ndarray, piece_rows: np.ndarray,
                targets: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each slot's piece (``rows // piece_rows[at]``), its node before the steps are balanced
    (``(offsets[at] + piece) % len(targets)``, its piece's owner) and each step's surplus
    (``(steps, nodes)``: the step's slots on each node minus ``targets``), for steps of
    ``width`` slots. ``at`` is each slot's entry in the value tables.

    Raises:
        NativeError: arrays of the wrong dtype or layout, sizes that disagree, an entry out of
            range, a negative row, piece rows below 1 or an offset outside ``[0, nodes)``.
    """
    total = len(at) if isinstance(at, np.ndarray) else 0
    count = len(targets) if isinstance(targets, np.ndarray) else 0
    steps = total // width if width > 0 else 0
    nodes = np.empty(total, dtype=np.int64)
    piece = np.empty(total, dtype=np.int64)
    surplus = np.empty((steps, count), dtype=np.int64)
    try:
        status = _native_backend.active.owner_nodes(at, rows, offsets, piece_rows, targets,
                                                    int(width), nodes, piece,
                                                    surplus.reshape(-1))
    except TypeError as exc:
        refused(exc, _twin_checks.first_problem("owner_nodes", (
            ("at", at, _I64, False), ("rows", rows, _I64, False),
            ("offsets", offsets, _I64, False), ("piece_rows", piece_rows, _I64, False),
            ("targets", targets, _I64, False))))
    raise_error(*status)
    return nodes, piece, surplus


def release_moves(nodes: np.ndarray, surplus: np.ndarray, at: np.ndarray, rows: np.ndarray,
                  key_base: np.ndarray, key_rows: np.ndarray, release_key: int, width: int,
                  priority_bits: int) -> None:
    """:func:`paid_moves` whose candidates are every slot on a node with a surplus in its
    step and whose hashes are their chunks' release hashes: ``counter_hash(release_key,
    key_base[at] + rows // key_rows[at])`` (``nodes`` updated in place).

    Raises:
        NativeError: as :func:`paid_moves`, and for an entry out of range, a negative row or
            key rows below 1 among the candidates; ``nodes`` is then unchanged.
    """
    surplus = _surplus_table("release_moves", surplus)
    try:
        status = _native_backend.active.release_moves(
            nodes, surplus.reshape(-1), at, rows, key_base, key_rows,
            int(release_key) & ((1 << 64) - 1), int(width), surplus.shape[1],
            int(priority_bits))
    except TypeError as exc:
        refused(exc, _twin_checks.first_problem("release_moves", (
            ("nodes", nodes, _I64, True), ("at", at, _I64, False), ("rows", rows, _I64, False),
            ("key_base", key_base, _I64, False), ("key_rows", key_rows, _I64, False))))
    raise_error(*status)


def paid_moves(nodes: np.ndarray, candidate: np.ndarray, hashed: np.ndarray,
               surplus: np.ndarray, width: int, priority_bits: int) -> None:
    """The multi-node split's paid moves (``csrc/split.h``): in every step (``width`` slots of
    ``nodes``, each slot's node, updated in place), each node with a surplus
    (``surplus``: ``(steps, nodes)``) releases that many of its ``candidate`` slots (strictly
    ascending), those of the lowest priority (the top ``priority_bits`` bits of ``hashed``)
    first, then by slot; each goes to its chunk's backup node while that one is short, the
    rest fill the step's remaining shortfalls in node order.

    Raises:
        NativeError: arrays of the wrong dtype or layout, sizes that disagree, or an
            impossible request (slots out of order, a step that does not balance); ``nodes``
            is then unchanged.
    """
    surplus = _surplus_table("paid_moves", surplus)
    count = surplus.shape[1]
    try:
        status = _native_backend.active.paid_moves(nodes, candidate, hashed, surplus.reshape(-1),
                                                   int(width), int(count), int(priority_bits))
    except TypeError as exc:
        refused(exc, _twin_checks.first_problem("paid_moves", (
            ("nodes", nodes, _I64, True),
            ("candidate", candidate, _I64, False),
            ("hashed", hashed, _U64, False))))
    raise_error(*status)


def choose_backups(bounds: np.ndarray, steps: np.ndarray, rows: np.ndarray, owner: np.ndarray,
                   chunks: np.ndarray, surplus: np.ndarray, budget: int) -> np.ndarray:
    """The pieces held twice chosen greedily (``csrc/backups.h``): piece ``p``'s entries
    ``[bounds[p], bounds[p + 1])`` are its rows ``rows`` in steps ``steps``; ``surplus`` (an
    int64 ``(steps, nodes)`` array) is updated. Returns each piece's second node (-1: none).

    Raises:
        NativeError: arrays of the wrong dtype or layout, sizes that disagree, bounds that do
            not rise from 0 to the entries, an entry's step or rows, or a piece's owner or
            chunks, out of range; nothing is then written.
    """
    surplus = _surplus_table("choose_backups", surplus)
    chosen = np.empty(len(owner) if isinstance(owner, np.ndarray) else 0, dtype=np.int64)
    try:
        status = _native_backend.active.choose_backups(
            bounds, steps, rows, owner, chunks, surplus.reshape(-1), surplus.shape[1],
            int(budget), chosen)
    except TypeError as exc:
        refused(exc, _twin_checks.first_problem("choose_backups", (
            ("bounds", bounds, _I64, False), ("steps", steps, _I64, False),
            ("rows", rows, _I64, False), ("owner", owner, _I64, False),
            ("chunks", chunks, _I64, False), ("surplus", surplus.reshape(-1), _I64, True))))
    raise_error(*status)
    return chosen
