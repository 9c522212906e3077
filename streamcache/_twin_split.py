"""The pure-Python twin of ``csrc/split.cpp``: the multi-node split's owners and paid moves,
in numpy (the same results as the extension, and its statement; ``csrc/split.h`` has the
rule).

Returns ``(code, item, message)`` as the extension does; a refused call writes nothing.
"""

from __future__ import annotations

import numpy as np

from ._mix import counter_hash
from ._twin_checks import INVALID, OK, Status, first_problem

_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)
_MASK64 = (1 << 64) - 1


def owner_nodes(at: np.ndarray, rows: np.ndarray, offsets: np.ndarray, piece_rows: np.ndarray,
                targets: np.ndarray, width: int, nodes: np.ndarray, piece: np.ndarray,
                surplus: np.ndarray) -> Status:
    """Each slot's piece, its node before balancing and each step's surplus (csrc/split.h)."""
    refused = first_problem("owner_nodes", (
        ("at", at, _I64, False), ("rows", rows, _I64, False), ("offsets", offsets, _I64, False),
        ("piece_rows", piece_rows, _I64, False), ("targets", targets, _I64, False),
        ("nodes", nodes, _I64, True), ("piece", piece, _I64, True),
        ("surplus", surplus, _I64, True)))
    if refused is not None:
        return refused
    total, count = at.size, targets.size
    problem = None
    if width < 0:
        problem = "width must not be negative"
    elif not rows.size == nodes.size == piece.size == total:
        problem = "at, rows, nodes and piece must hold one entry per slot"
    elif offsets.size != piece_rows.size:
        problem = "offsets and piece_rows must hold one entry per value"
    elif count == 0:
        problem = "count must be at least 1"
    elif total and (width == 0 or total % width):
        problem = f"{total} slots are not whole steps of {width}"
    elif surplus.size != (total // width if width else 0) * count:
        problem = "surplus must hold steps * count entries"
    if problem is not None:
        return INVALID, -1, problem
    if total == 0:
        return OK, -1, ""
    values = offsets.size
    bad_at = (at < 0) | (at >= values)
    v = np.where(bad_at, 0, at)
    size, offset = piece_rows[v] if values else v, offsets[v] if values else v
    bad_row = ~bad_at & (rows < 0)
    bad_value = ~bad_at & ~bad_row & ((size < 1) | (offset < 0) | (offset >= count))
    bad = np.flatnonzero(bad_at | bad_row | bad_value)
    if bad.size:
        i = int(bad[0])
        if bad_at[i]:
            return INVALID, i, f"slot {i}'s entry {int(at[i])} is not below {values}"
        if bad_row[i]:
            return INVALID, i, f"slot {i}'s row {int(rows[i])} is negative"
        return INVALID, i, (f"slot {i}'s piece rows {int(size[i])} or offset {int(offset[i])} "
                            f"is out of range (rows >= 1, offset below {count})")
    piece[:] = rows // size
    nodes[:] = ((offset.astype(np.uint64) + piece.astype(np.uint64))
                % np.uint64(count)).astype(np.int64)
    group = np.arange(total, dtype=np.int64) // width * count + nodes
    surplus[:] = (np.bincount(group, minlength=surplus.size).reshape(-1, count)
                  - targets).ravel()
    return OK, -1, ""


def release_moves(nodes: np.ndarray, surplus: np.ndarray, at: np.ndarray, rows: np.ndarray,
                  key_base: np.ndarray, key_rows: np.ndarray, release_key: int, width: int,
                  count: int, priority_bits: int) -> Status:
    """The paid moves of the slots on nodes with a surplus, hashed by their chunk keys
    (csrc/split.h)."""
    refused = first_problem("release_moves", (
        ("nodes", nodes, _I64, True), ("surplus", surplus, _I64, False),
        ("at", at, _I64, False), ("rows", rows, _I64, False),
        ("key_base", key_base, _I64, False), ("key_rows", key_rows, _I64, False)))
    if refused is not None:
        return refused
    if count < 1:
        return INVALID, -1, "count must be at least 1"
    if not at.size == rows.size == nodes.size:
        return INVALID, -1, "at and rows must hold one entry per slot"
    if key_base.size != key_rows.size:
        return INVALID, -1, "key_base and key_rows must hold one entry per value"
    problem = sizes_problem(nodes.size, 0, 0, surplus.size, width, count)
    if problem is not None:
        return INVALID, -1, problem
    if not 1 <= priority_bits <= 32:
        return INVALID, -1, "priority_bits must be in [1, 32]"
    if width >= 1 << 31:
        return INVALID, -1, "width must be below 2**31"
    if nodes.size == 0:
        return _release_problem(nodes, surplus, at, rows, key_rows, width, count)
    values = key_base.size
    need = surplus.reshape(-1, count)
    known = (nodes >= 0) & (nodes < count)
    node = np.where(known, nodes, 0)
    step = np.arange(nodes.size, dtype=np.int64) // width
    wanted = known & (need[step, node] > 0)
    listed = (at >= 0) & (at < values)
    v = np.where(listed & wanted, at, 0)
    size = key_rows[v] if values else v
    in_range = listed & (rows >= 0) & (size >= 1)
    have = np.bincount(step[wanted] * count + node[wanted], minlength=need.size)
    if (need.sum(axis=1).any() or not known.all() or (wanted & ~in_range).any()
            or (have < need.ravel()).any()):
        return _release_problem(nodes, surplus, at, rows, key_rows, width, count)
    if count == 1:
        return OK, -1, ""
    candidate = np.flatnonzero(wanted)
    which = v[candidate]
    keys = key_base[which].astype(np.uint64) + (rows[candidate] // size[candidate]).astype(
        np.uint64)
    hashed = counter_hash(release_key & _MASK64, keys)
    return paid_moves(nodes, candidate, hashed, surplus, width, count, priority_bits)


def _release_problem(nodes: np.ndarray, surplus: np.ndarray, at: np.ndarray, rows: np.ndarray,
                     key_rows: np.ndarray, width: int, count: int) -> Status:
    """release_moves' checks step by step, in the extension's order: the first problem."""
    values = key_rows.size
    need = surplus.reshape(-1, count)
    for step in range(need.shape[0]):
        total = int(need[step].sum())
        if total:
            return INVALID, step, f"step {step}'s surpluses sum to {total}, not 0"
        have = [0] * count
        for i in range(step * width, (step + 1) * width):
            node = int(nodes[i])
            if not 0 <= node < count:
                return INVALID, i, f"slot {i}'s node {node} is not below {count}"
            if need[step, node] <= 0:
                continue
            have[node] += 1
            v = int(at[i])
            if not 0 <= v < values:
                return INVALID, i, f"slot {i}'s entry {v} is not below {values}"
            if rows[i] < 0 or key_rows[v] < 1:
                return INVALID, i, (f"slot {i}'s row {int(rows[i])} or key rows "
                                    f"{int(key_rows[v])} is out of range (row >= 0, key rows "
                                    ">= 1)")
        for node in range(count):
            if have[node] < need[step, node]:
                return INVALID, step, (f"node {node} has a surplus of {need[step, node]} in "
                                       f"step {step} but only {have[node]} candidates")
    return OK, -1, ""


def paid_moves(nodes: np.ndarray, candidate: np.ndarray, hashed: np.ndarray,
               surplus: np.ndarray, width: int, count: int, priority_bits: int) -> Status:
    """Balance the steps of ``nodes`` (``steps * width``, updated) over ``count`` nodes by
    moving released candidates (see csrc/split.h)."""
    refused = first_problem("paid_moves", (("nodes", nodes, _I64, True),
                                           ("candidate", candidate, _I64, False),
                                           ("hashed", hashed, _U64, False),
                                           ("surplus", surplus, _I64, False)))
    if refused is not None:
        return refused
    problem = sizes_problem(nodes.size, candidate.size, hashed.size, surplus.size, width, count)
    if problem is not None:
        return INVALID, -1, problem
    steps = surplus.size // count
    status = _check(nodes, steps, width, count, candidate, surplus, priority_bits)
    if status[0] != OK or count == 1 or candidate.size == 0:
        return status
    need = surplus.reshape(steps, count)
    owners = nodes[candidate]
    released = _released(candidate, owners, hashed, width, need, priority_bits)
    nodes[candidate[released]] = _receivers(
        owners[released], hashed[released], candidate[released] // width, np.maximum(0, -need))
    return OK, -1, ""


def sizes_problem(nodes: int, candidates: int, hashes: int, surpluses: int, width: int,
                  count: int) -> str | None:
    """What is wrong with the arguments' sizes (the extension's binding asks the same), or
    None."""
    if count < 1:
        return "count must be at least 1"
    if width < 0:
        return "width must not be negative"
    if surpluses % count:
        return f"surplus holds {surpluses} entries, not a multiple of count ({count})"
    if nodes != surpluses // count * width:
        return (f"nodes holds {nodes} slots, the {surpluses // count} steps of surplus "
                f"{surpluses // count * width}")
    if hashes != candidates:
        return f"hashed holds {hashes} entries for {candidates} candidates"
    return None


def _check(nodes: np.ndarray, steps: int, width: int, count: int, candidate: np.ndarray,
           surplus: np.ndarray, priority_bits: int) -> Status:
    """csrc/split.cpp's checks: all at once, then the first failure exactly as it finds it."""
    if not 1 <= priority_bits <= 32:
        return INVALID, -1, "priority_bits must be in [1, 32]"
    if width >= 1 << 31:
        return INVALID, -1, "width must be below 2**31"
    need = surplus.reshape(steps, count)
    ordered = candidate.size == 0 or (
        int(candidate[0]) >= 0 and bool(np.all(np.diff(candidate) > 0))
        and int(candidate[-1]) < steps * width)
    if ordered:
        owners = nodes[candidate]
        if not np.all((owners >= 0) & (owners < count)):
            ordered = False
        elif not need.sum(axis=1).any():
            have = np.bincount(candidate // max(width, 1) * count + owners,
                               minlength=need.size).reshape(need.shape)
            if np.all(have >= need):
                return OK, -1, ""
    return _first_failure(nodes, steps, width, count, candidate, need)


def _first_failure(nodes: np.ndarray, steps: int, width: int, count: int,
                   candidate: np.ndarray, need: np.ndarray) -> Status:
    """The extension's check, step by step (only called when something is wrong)."""
    j, m = 0, candidate.size
    for step in range(steps):
        total = int(need[step].sum())
        if total:
            return INVALID, step, f"step {step}'s surpluses sum to {total}, not 0"
        have = [0] * count
        while j < m and int(candidate[j]) < (step + 1) * width:
            if int(candidate[j]) < 0 or (j > 0 and candidate[j] <= candidate[j - 1]):
                return INVALID, j, "candidates must be strictly ascending slots from 0"
            owner = int(nodes[candidate[j]])
            if not 0 <= owner < count:
                return INVALID, j, f"a candidate's node {owner} is not below {count}"
            have[owner] += 1
            j += 1
        for node in range(count):
            if have[node] < need[step, node]:
                return INVALID, step, (f"node {node} has a surplus of {need[step, node]} in "
                                       f"step {step} but only {have[node]} candidates")
    if j < m:
        return INVALID, j, f"a candidate slot is not below steps * width ({steps * width})"
    return OK, -1, ""


def _released(candidate: np.ndarray, owners: np.ndarray, hashed: np.ndarray, width: int,
              need: np.ndarray, priority_bits: int) -> np.ndarray:
    """Which candidates (indices, ascending) their node gives away: in each (step, node), as
    many as its surplus, lowest priority first, then by slot. Only the candidates whose
    priority is below a bound that their group almost surely needs are ranked (a few times
    its surplus); a group that the bound leaves short is ranked whole: the same result."""
    count = need.shape[1]
    group = (candidate // width) * count + owners
    needed = need.ravel()
    size = np.bincount(group, minlength=needed.size)
    priority = (hashed >> np.uint64(64 - priority_bits)).astype(np.int64)
    wanted = needed + 2 * np.sqrt(np.maximum(needed, 0)).astype(np.int64) + 2
    bound = np.minimum(1 << priority_bits, (wanted << priority_bits) // np.maximum(size, 1))
    low = priority < bound[group]
    short = np.bincount(group[low], minlength=needed.size) < needed
    if short.any():  # (rare: this group's lowest priorities came out high; rank it whole)
        low |= short[group]
    picked = np.flatnonzero(low)
    ranked, ranked_group = sorted_by(group[picked], priority[picked], priority_bits)
    ranked = picked[ranked]
    rank_in_group = np.arange(ranked.size) - np.searchsorted(ranked_group, ranked_group)
    return np.sort(ranked[rank_in_group < needed[ranked_group]])


def _receivers(owners: np.ndarray, hashed: np.ndarray, steps: np.ndarray,
               deficit: np.ndarray) -> np.ndarray:
    """The node each released sample (in (step, slot) order) goes to: its chunk's backup while
    that node is short in that step, in slot order; the rest fill each step's remaining
    shortfalls in node order."""
    count = deficit.shape[1]
    backup = (owners + 1 + (hashed % np.uint64(count - 1)).astype(np.int64)) % count
    group = steps * count + backup
    order = np.argsort(group, kind="stable")
    grouped = group[order]
    accept_sorted = np.arange(grouped.size) - np.searchsorted(grouped, grouped) < \
        deficit.ravel()[grouped]
    accept = np.empty(grouped.size, dtype=bool)
    accept[order] = accept_sorted
    receiver = np.empty(owners.size, dtype=np.int64)
    receiver[accept] = backup[accept]
    room = deficit.ravel() - np.bincount(group[accept], minlength=deficit.size)
    receiver[~accept] = np.repeat(np.tile(np.arange(count), deficit.shape[0]), room)
    return receiver


def sorted_by(major: np.ndarray, minor: np.ndarray, minor_bits: int,
              ) -> tuple[np.ndarray, np.ndarray]:
    """The indices that sort by (major, minor, index), non-negative int64 arrays with
    ``minor < 2**minor_bits``, and ``major`` in that order: a sort of packed keys (cheaper
    than an argsort) where they fit 63 bits, else a lexsort."""
    index_bits = max(1, int(major.size).bit_length())
    if int(major.max(initial=0)).bit_length() + minor_bits + index_bits <= 63:
        keys = (major << np.int64(minor_bits + index_bits)) | (minor << np.int64(index_bits))
        keys |= np.arange(major.size, dtype=np.int64)
        keys.sort()
        return keys & np.int64((1 << index_bits) - 1), keys >> np.int64(minor_bits + index_bits)
    order = np.lexsort((np.arange(major.size), minor, major))
    return order, major[order]
