"""Balancing a step's nodes with samples that two nodes hold: a small max flow per step.

With several nodes a fraction of the pieces is held by two nodes, its owner and a backup
(docs/multinode.md): a sample of such a piece may be read on either node at no cost. When a
step gives some nodes more samples of their own pieces than their ranks take (a surplus) and
others fewer (a deficit), these flexible samples are moved from owner to backup so that as
much of the imbalance as possible disappears for free. Which node pairs can trade is a graph
that changes every step; moving a sample from a surplus node to a node that is already
balanced, which then moves another to a deficit node, counts too (paths of several hops).
:func:`flexible_moves` finds the most samples that can move (a maximum flow from the surplus
nodes to the deficit nodes, all the steps of a batch of steps at once) and which samples:
those of the lowest priority in each (step, owner, backup) group.

Pure and vectorized across steps: the work is a few array passes per augmenting round over
``(steps, nodes, nodes)`` arrays, so pieces are held twice only up to :data:`FLOW_MAX_NODES`
nodes (plan/locality.py).
"""

from __future__ import annotations

import numpy as np

#: Largest node count balanced by a max flow (beyond: direct moves only).
FLOW_MAX_NODES = 16


def flexible_moves(steps: np.ndarray, owners: np.ndarray, backups: np.ndarray,
                   priority: np.ndarray, surplus: np.ndarray) -> np.ndarray:
    """Which flexible samples move from their owner to their backup.

    Args:
        steps, owners, backups, priority: one entry per flexible sample (int64; owner !=
            backup; priority a non-negative tie-break, lowest moves first).
        surplus: ``(num_steps, num_nodes)`` samples each node has beyond what its ranks take
            (negative: a deficit); summing to 0 in every step.

    Returns:
        Indices of the samples to move (ascending).
    """
    num_steps, count = surplus.shape
    if owners.size == 0 or not surplus.any():
        return np.zeros(0, dtype=np.int64)
    group = (steps * count + owners) * count + backups
    capacity = np.bincount(group, minlength=num_steps * count * count).reshape(
        num_steps, count, count)
    net = direct_flow(capacity, surplus)  # (most of it, in closed form)
    left = surplus - net.sum(axis=2) + net.sum(axis=1)
    net = max_flow(capacity, left, flow=net)
    moving = np.flatnonzero(net.ravel()[group] > 0)  # (only these groups are ranked)
    order = moving[np.lexsort((moving, priority[moving], group[moving]))]
    ranked = group[order]
    rank_in_group = np.arange(ranked.size) - np.searchsorted(ranked, ranked)
    return np.sort(order[rank_in_group < net.ravel()[ranked]])


def max_flow(capacity: np.ndarray, excess: np.ndarray, rounds: int | None = None,
             flow: np.ndarray | None = None) -> np.ndarray:
    """The net flow ``(steps, nodes, nodes)`` of a maximum flow in every step from the nodes
    with ``excess > 0`` to those with ``excess < 0`` over edges of ``capacity`` (shortest
    augmenting paths, one per step per round, every step at once), from ``flow`` on (a
    feasible flow; ``excess`` is what it leaves). ``excess`` is consumed."""
    count = capacity.shape[1]
    flow = np.zeros_like(capacity) if flow is None else flow.copy()
    for _ in range(rounds if rounds is not None else 4 * count * count):
        active = np.flatnonzero((excess > 0).any(axis=1) & (excess < 0).any(axis=1))
        if active.size == 0:
            break
        residual = capacity[active] - flow[active] + flow[active].transpose(0, 2, 1)
        found, paths, bottleneck = _shortest_paths(residual, excess[active])
        if not found.any():
            break
        steps = active[found]
        for hop_from, hop_to in paths:
            live = hop_from >= 0
            flow[steps[live], hop_from[live], hop_to[live]] += bottleneck[live]
        excess[steps, _path_source(paths)] -= bottleneck
        excess[steps, paths[0][1]] += bottleneck  # (the deficit node each path reached)
    return np.maximum(0, flow - flow.transpose(0, 2, 1))


def _shortest_paths(residual: np.ndarray, excess: np.ndarray,
                    ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """One shortest path per step (breadth-first from every surplus node at once) to a
    deficit node: whether one was found, its hops from the deficit end back (``(from, to)``
    arrays over the found steps, -1 past a path's start) and its bottleneck."""
    num_steps, count, _ = residual.shape
    source, sink = excess > 0, excess < 0
    parent = np.full((num_steps, count), -1, dtype=np.int64)
    visited = source.copy()
    frontier = source.copy()
    target = np.full(num_steps, -1, dtype=np.int64)
    open_edges = residual > 0
    for _ in range(count):
        edge = frontier[:, :, None] & open_edges & ~visited[:, None, :]
        reach = edge.any(axis=1)
        if not reach.any():
            break
        parent = np.where(reach, edge.argmax(axis=1), parent)
        visited |= reach
        hit = reach & sink & (target < 0)[:, None]
        newly = hit.any(axis=1)
        target[newly] = hit[newly].argmax(axis=1)
        frontier = reach & (target < 0)[:, None]
        if not frontier.any():
            break
    found = target >= 0
    steps = np.flatnonzero(found)
    current = target[steps]
    bottleneck = -excess[steps, current]
    paths: list[tuple[np.ndarray, np.ndarray]] = []
    for _ in range(count):
        back = parent[steps, np.maximum(current, 0)]
        live = (current >= 0) & ~source[steps, np.maximum(current, 0)]
        hop_from = np.where(live, back, -1)
        if not live.any():
            break
        bottleneck = np.where(live, np.minimum(
            bottleneck, residual[steps, np.maximum(hop_from, 0), np.maximum(current, 0)]),
            bottleneck)
        paths.append((hop_from, np.where(live, current, -1)))
        current = np.where(live, back, current)
    bottleneck = np.minimum(bottleneck, excess[steps, current])  # (current: each source)
    return found, paths, bottleneck


def _path_source(paths: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The surplus node each path starts from (its last live ``from``)."""
    source = paths[0][0].copy()
    for hop_from, _ in paths[1:]:
        source = np.where(hop_from >= 0, hop_from, source)
    return source


def direct_flow(capacity: np.ndarray, surplus: np.ndarray) -> np.ndarray:
    """Moves from surplus owners straight to deficit backups only (one hop), in node order:
    every deficit node takes what its surplus askers offer, each asker giving at most its
    surplus."""
    give = np.maximum(0, surplus)[:, :, None]
    take = np.maximum(0, -surplus)[:, None, :]
    possible = np.minimum(capacity, np.minimum(give, take))
    # each owner gives at most its surplus, in backup order; each backup takes at most its
    # deficit, in owner order
    given = np.minimum(possible, np.maximum(0, give - (np.cumsum(possible, axis=2) - possible)))
    taken = np.minimum(given, np.maximum(0, take - (np.cumsum(given, axis=1) - given)))
    return taken


__all__ = ["FLOW_MAX_NODES", "direct_flow", "flexible_moves", "max_flow"]
