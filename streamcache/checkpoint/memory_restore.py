"""The memory tier's restore: what a snapshot is matched and checked against before anything
is applied, and the collective choice of the step every rank restores (docs/recovery.md, "The
memory tier"). The tier's files are memory.py's; their format memory_format.py's.

Thread safety: one training thread per MemoryTier.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from . import rng
from .memory import MemoryTier, Prepared
from .memory_format import RootView, SlotSummary, choose
from .ranks import Ranks
from .state import is_global_state, resolve, validate_state

log = logging.getLogger("streamcache.checkpoint")


def snapshot_entries(entries: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """{key: (kind, value)} of a resolved state (:func:`~.state.resolve`), as a save collects
    it: global states and Stateful entries through ``state_dict()``, plain values as they are.
    """
    collected: dict[str, tuple[str, Any]] = {}
    for key, value in entries.items():
        if is_global_state(value):
            collected[key] = ("global", value.state_dict())
        elif isinstance(value, Stateful):
            collected[key] = ("stateful", value.state_dict())
        else:
            collected[key] = ("plain", value)
    return collected


def match(prepared: Prepared, live: Mapping[str, tuple[str, Any]]) -> dict[str, Any] | str:
    """The snapshot's values shaped as the live state ``live`` (:func:`snapshot_entries` of
    the state restored into) asks (DTensors and devices as the live state's), or a
    description of how they differ."""
    kinds = {k: kind for k, (kind, _) in live.items()}
    saved = {k: kind for k, (kind, _) in prepared.trees.items()}
    if kinds != saved:
        return (f"the snapshot holds entries {sorted(saved.items())}, the state "
                f"{sorted(kinds.items())}")
    shaped: dict[str, Any] = {}
    for key, (kind, value) in live.items():
        tree = prepared.trees[key][1]
        if kind != "stateful":
            shaped[key] = tree
            continue
        problem: list[str] = []
        shaped[key] = _like(tree, value, key, problem)
        if problem:
            return problem[0]
    return shaped


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in a state tree, as a snapshot of it would record them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def _like(saved: Any, live: Any, path: str, problem: list[str]) -> Any:
    """``saved`` with each tensor made like the live tensor at the same place."""
    if problem:
        return None
    if isinstance(live, torch.Tensor):
        local = live.to_local() if isinstance(live, DTensor) else live
        if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(local.shape) \
                or saved.dtype != local.dtype:
            problem.append(f"{path}: the snapshot's value does not have the state's shape and "
                           f"dtype ({tuple(local.shape)}, {local.dtype})")
            return None
        if local.device != saved.device:
            saved = saved.to(local.device)
        if isinstance(live, DTensor):
            return DTensor.from_local(saved, live.device_mesh, live.placements, run_check=False,
                                      shape=live.shape, stride=live.stride())
        return saved
    if isinstance(live, dict):
        if not isinstance(saved, dict) or set(saved) != set(live):
            missing = sorted(map(str, set(live) - set(saved))) if isinstance(saved, dict) else []
            extra = sorted(map(str, set(saved) - set(live))) if isinstance(saved, dict) else []
            problem.append(f"{path}: keys differ (the state asks for {missing[:4]} too, the "
                           f"snapshot holds {extra[:4]} too)")
            return None
        return {k: _like(saved[k], v, f"{path}.{k}", problem) for k, v in live.items()}
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) \
            and len(saved) == len(live):
        return type(saved)(_like(s, v, f"{path}[{i}]", problem)
                           for i, (s, v) in enumerate(zip(saved, live, strict=True)))
    if isinstance(saved, torch.Tensor) != isinstance(live, torch.Tensor) or \
            isinstance(saved, (list, tuple, dict)) != isinstance(live, (list, tuple, dict)):
        problem.append(f"{path}: the snapshot holds a {type(saved).__name__}, the state a "
                       f"{type(live).__name__}")
        return None
    return saved


def refusal(prepared: Prepared, shaped: Mapping[str, Any],
            entries: Mapping[str, Any]) -> str | None:
    """Why the matched snapshot must not be applied (its RNG states, or a global state its
    object refuses), or None; checks everything :func:`apply` would set, sets nothing."""
    try:
        rng.check(prepared.manifest.rng)
    except ValueError as exc:
        return f"its RNG states are malformed ({exc})"
    for key, value in entries.items():
        if is_global_state(value):
            try:
                validate_state(value, shaped[key])
            except Exception as exc:  # the object's own refusal, whatever its type
                return f"{key!r} refuses its state ({type(exc).__name__}: {exc})"
    return None


def apply(shaped: Mapping[str, Any], entries: Mapping[str, Any], state: dict[str, Any],
          rng_state: dict[str, Any]) -> None:
    """Load matched and checked values (:func:`match`, :func:`refusal`) into ``state`` and
    this process's RNGs.

    Global states (the loader's cursor) go first, so that a refusal there leaves the rest
    untouched.
    """
    ordered = sorted(entries, key=lambda k: not is_global_state(entries[k]))
    for key in ordered:
        value = entries[key]
        if isinstance(value, Stateful):
            value.load_state_dict(shaped[key])
        else:
            state[key] = shaped[key]
    rng.restore(rng_state)


def restore_agreed(tier: MemoryTier, ranks: Ranks, root: RootView | None,
                   state: dict[str, Any]) -> tuple[int | None, RootView]:
    """Restore the newest step every rank holds whole in memory (collective).

    ``root`` is what rank 0 read of the root (the other ranks pass None). A rank alone cannot
    know whether its newest slot is whole on the others (a kill may have cut another rank's
    snapshot short), so the ranks exchange their slots' summaries and rank 0's view (one
    small all-gather) and all choose the same step (:func:`~.memory_format.choose`); each
    then reads and verifies its slot (never allocating more than the state it restores into
    holds) and checks everything it would apply, and only when every rank succeeded (one
    all-gather) are the values applied. Slots newer than the step are discarded.

    Returns:
        The step restored (None: use the disk tiers) and rank 0's view of the root, the same
        on every rank.
    """
    found = tier.scan()
    mine = [dataclasses.astuple(s) for _, s in found]
    view = None if root is None else (root.latest, root.root_id)
    gathered = ranks.all_gather((mine, view), ranks.control)
    latest, root_id = gathered[0][1]
    agreed = RootView(None if latest is None else (str(latest[0]), int(latest[1])), root_id)
    per_rank = [[SlotSummary(*fields) for fields in summaries] for summaries, _ in gathered]
    entries = resolve(state)
    live = snapshot_entries(entries)
    limit = sum(tensor_bytes(value) for _, value in live.values())
    while True:  # newest first; a step that fails to verify on any rank is passed over
        step = choose(per_rank, agreed)
        if step is None:
            return None, agreed
        slot, summary = max(((slot, s) for slot, s in found if s.step == step),
                            key=lambda item: item[1].seq)
        outcome, checked = _check_slot(tier, slot, summary, live, entries, limit)
        outcomes = ranks.all_gather(outcome, ranks.control)
        if "other" in outcomes:  # another state than the snapshots': none of them fits
            return None, agreed
        if "damaged" not in outcomes:
            break
        per_rank = [[s for s in summaries if s.step != step] for summaries in per_rank]
    assert checked is not None
    prepared, shaped = checked
    apply(shaped, entries, state, prepared.manifest.rng)
    tier.discard_after(step)
    return step, agreed


def _check_slot(tier: MemoryTier, slot: int, summary: SlotSummary,
                live: Mapping[str, tuple[str, Any]], entries: Mapping[str, Any], limit: int
                ) -> tuple[str, tuple[Prepared, dict[str, Any]] | None]:
    """``("ok", (prepared, shaped))``, ``("damaged", None)`` (the slot does not verify or
    holds values that must not be applied: an older step may do) or ``("other", None)`` (the
    snapshot is of another state than ``entries``)."""
    prepared = tier.prepare(slot, summary, limit)
    if prepared is None:
        return "damaged", None
    shaped = match(prepared, live)
    if isinstance(shaped, str):
        log.warning("memory tier: step %d does not match the given state (%s); loading "
                    "from the disk tiers", summary.step, shaped)
        return "other", None
    problem = refusal(prepared, shaped, entries)
    if problem is not None:
        log.warning("memory tier: not restoring step %d of %s: %s", summary.step,
                    tier.slot_name(slot), problem)
        return "damaged", None
    return "ok", (prepared, shaped)
