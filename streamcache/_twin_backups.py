"""The pure-Python twin of ``csrc/backups.cpp``: the greedy choice of the pieces two nodes hold
(plan/backup_plan.py), in numpy (the same results as the extension; ``csrc/backups.h`` has the
rule).

Returns ``(code, item, message)`` as the extension does; a refused call writes nothing.
"""

from __future__ import annotations

import heapq

import numpy as np

from ._twin_checks import INVALID, OK, Status, first_problem

_I64 = np.dtype(np.int64)


def choose_backups(bounds: np.ndarray, steps: np.ndarray, rows: np.ndarray, owner: np.ndarray,
                   chunks: np.ndarray, surplus: np.ndarray, nodes: int, budget: int,
                   chosen: np.ndarray) -> Status:
    """The pieces held twice chosen greedily (csrc/backups.h): ``surplus`` (steps * nodes)
    updated and each piece's second node (-1: none) into ``chosen``."""
    refused = first_problem("choose_backups", (
        ("bounds", bounds, _I64, False), ("steps", steps, _I64, False),
        ("rows", rows, _I64, False), ("owner", owner, _I64, False),
        ("chunks", chunks, _I64, False), ("surplus", surplus, _I64, True),
        ("chosen", chosen, _I64, True)))
    if refused is not None:
        return refused
    pieces = owner.size
    problem = None
    if nodes < 1:
        problem = "nodes must be at least 1"
    elif bounds.size != pieces + 1 or chunks.size != pieces or chosen.size != pieces:
        problem = ("bounds must hold pieces + 1 entries; owner, chunks and chosen one per "
                   "piece")
    elif steps.size != rows.size:
        problem = "steps and rows must hold one value per entry"
    elif surplus.size % nodes:
        problem = "surplus must hold steps * nodes entries"
    if problem is not None:
        return INVALID, -1, problem
    found = _problem(bounds, steps, rows, owner, chunks, surplus.size // nodes, nodes)
    if found is not None:
        return found
    table = surplus.reshape(-1, nodes)
    chosen[:] = -1
    for piece, node in _greedy(bounds, steps, rows, owner, chunks, table, budget).items():
        chosen[piece] = node
    return OK, -1, ""


def _problem(bounds: np.ndarray, steps: np.ndarray, rows: np.ndarray, owner: np.ndarray,
             chunks: np.ndarray, num_steps: int, nodes: int) -> Status | None:
    """The extension's checks, in its order: the first problem."""
    entries = steps.size
    if bounds[0] != 0 or bounds[-1] != entries or (np.diff(bounds) < 0).any():
        return INVALID, -1, f"bounds must rise from 0 to the {entries} entries"
    bad = np.flatnonzero((steps < 0) | (steps >= num_steps) | (rows < 0))
    if bad.size:
        e = int(bad[0])
        return INVALID, e, (f"entry {e}'s step {int(steps[e])} or rows {int(rows[e])} is out "
                            f"of range (step below {num_steps}, rows >= 0)")
    bad = np.flatnonzero((owner < 0) | (owner >= nodes) | (chunks < 0))
    if bad.size:
        p = int(bad[0])
        return INVALID, p, (f"piece {p}'s owner {int(owner[p])} or chunks {int(chunks[p])} is "
                            f"out of range (owner below {nodes}, chunks >= 0)")
    return None


def _greedy(bounds: np.ndarray, steps: np.ndarray, rows: np.ndarray, owner: np.ndarray,
            chunks: np.ndarray, surplus: np.ndarray, budget: int) -> dict[int, int]:
    """Piece -> second node (csrc/backups.h's rule); ``surplus`` (steps, nodes) updated."""
    count, nodes = owner.size, surplus.shape[1]
    if budget <= 0 or count == 0:
        return {}
    # every pair's count before any is chosen: a pass over all entries per node
    piece_of = np.repeat(np.arange(count), np.diff(bounds))
    movable = np.minimum(rows, np.maximum(surplus[steps, owner[piece_of]], 0))
    under = np.maximum(-surplus, 0)
    first = np.zeros((count, nodes), dtype=np.int64)
    for node in range(nodes):  # (exact: counts far below 2**53)
        first[:, node] = np.bincount(piece_of, np.minimum(movable, under[steps, node]),
                                     minlength=count)
    first[np.arange(count), owner] = -1
    heap = [(-int(v), p) for p, v in enumerate(first.max(axis=1).tolist())
            if chunks[p] > 0 and v > chunks[p]]
    heapq.heapify(heap)
    chosen: dict[int, int] = {}
    held = np.zeros(nodes, dtype=np.int64)  # chunks each node holds twice so far
    while heap and len(chosen) < budget:
        _, p = heapq.heappop(heap)
        at = steps[bounds[p]:bounds[p + 1]]
        source = int(owner[p])
        moves = np.minimum(rows[bounds[p]:bounds[p + 1]], np.maximum(surplus[at, source], 0))
        pair = np.minimum(moves[:, None], np.maximum(-surplus[at], 0)).sum(axis=0)
        pair[source] = -1
        node = int(np.argmax(pair * (held.sum() + 1) - held))
        gain = int(pair[node])
        if gain <= chunks[p]:
            continue
        if heap and gain < -heap[0][0]:
            heapq.heappush(heap, (-gain, p))
            continue
        moved = np.minimum(moves, np.maximum(-surplus[at, node], 0))
        surplus[at, source] -= moved
        surplus[at, node] += moved
        held[node] += chunks[p]
        chosen[p] = node
    return chosen


__all__ = ["choose_backups"]
