"""Loading: pick the newest complete checkpoint, verify every file, load it in place.

All ranks run it together (collectives on the control group): rank 0's list of candidates is
broadcast so every rank tries the same ones in the same order; each file's checksum is
verified by one rank and the first problem is shared; a damaged candidate is skipped.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from . import layout, rng
from .commit import describe
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .layout import GLOBAL_NAME, K_RANK_KEYS, K_STATES, CheckpointInfo
from .ranks import Ranks
from .state import is_global_state, resolve
from .tiers import READ_ATTEMPTS, Location
from .unpickle import SafeFileSystemReader, SafeFsspecReader, SafeLoadPlanner

log = logging.getLogger("streamcache.checkpoint")

MISSING_ATTEMPTS = 3  # a listed file that is not there: looked for this many times


@dataclass
class Restorer:
    ranks: Ranks
    root: Location
    write_base: Location
    seed: int

    @property
    def tiered(self) -> bool:
        return self.write_base.url != self.root.url

    def load(self, state: dict[str, Any],
             step: int | None) -> tuple[CheckpointInfo, bool] | None:
        """Load the newest complete checkpoint of the live history (or of ``step``).

        ``step`` is looked for in the live timeline's history first, then in abandoned
        timelines. Returns the checkpoint loaded and whether loading it is a rollback (it
        is not the newest of the live history), or None when there is none.
        """
        plan: tuple[list[str], str | None] = ([], None)
        if self.ranks.rank == 0:
            found = layout.complete_newest_first(self.root, step)
            if not found and step is not None:  # asked for by its step: an abandoned one
                found = layout.complete_newest_first(self.root, step, everywhere=True)
            newest = layout.latest(self.root) if step is not None else None
            plan = ([info.name for info in found], newest.name if newest else None)
        names, newest_name = self.ranks.broadcast(plan, self.ranks.control)
        candidates: list[str] = names
        if not candidates:
            if step is None:
                return None
            raise CheckpointNotFoundError(
                f"no complete checkpoint of step {step} under {self.root.url}; "
                f"`streamcache checkpoints {self.root.url}` lists the steps there"
            )
        problems = []
        for name in candidates:
            info = layout.check_cheaply(self.root, name)
            source, problem = self.verified_source(info)
            if source is None:
                log.error("refusing checkpoint %s: %s", info.url, problem)
                problems.append(f"{name}: {problem}")
                if step is not None:
                    break
                continue
            self.load_from(source, info, state)
            return info, step is not None and info.name != newest_name
        raise CheckpointCorruptError(
            "no loadable checkpoint: " + "; ".join(problems) + ". The files do not match "
            "their commit markers; restore them from a backup or delete these directories"
        )

    def verified_source(self, info: CheckpointInfo) -> tuple[Location | None, str | None]:
        """The local copy if complete and identical on every rank, else root; or a problem."""
        assert info.marker is not None
        if self.tiered:
            local = self.write_base.child(info.name)
            local_ok = layout.size_problem(info.marker, local.list_sizes()) is None
            all_local = self.ranks.all_true(local_ok, self.ranks.control)
            if all_local and self.verify(local, info) is None:
                return local, None
        root_copy = self.root.child(info.name)
        problem = self.verify(root_copy, info)
        return (root_copy, None) if problem is None else (None, problem)

    def verify(self, location: Location, info: CheckpointInfo) -> str | None:
        """Full checksum verification, the files split across ranks; the first problem.

        A problem is proven damage only: a checksum mismatch, or a file still missing after
        a few tries. Transient read errors are retried (:func:`~.tiers.retrying`); one that
        outlasts the retries raises on every rank instead of condemning the checkpoint.

        Raises:
            CheckpointError: a file could not be read on some rank after the retries.
        """
        assert info.marker is not None
        names = sorted(info.marker.files)
        problem, unreadable = None, None
        for name in names[self.ranks.rank :: self.ranks.world_size]:
            expected = info.marker.files[name].checksum
            try:
                actual = checksum_present(location, name)
            except FileNotFoundError:
                problem = f"{name} is missing"
                break
            except OSError as exc:
                unreadable = f"{location.join(name)}: {type(exc).__name__}: {exc}"
                break
            if actual != expected:
                problem = (f"{name} is corrupt: checksum {actual}, the commit marker says "
                           f"{expected}")
                break
        outcomes = self.ranks.all_gather((problem, unreadable), self.ranks.control)
        errors = [u for _, u in outcomes if u is not None]
        if errors:
            raise CheckpointError(
                f"could not read checkpoint {info.url} to verify it ({errors[0]}), after "
                f"{READ_ATTEMPTS} attempts; it is not known to be damaged, so no older "
                "checkpoint was loaded instead. Check the storage and load again"
            )
        return next((p for p, _ in outcomes if p is not None), None)

    def load_from(self, source: Location, info: CheckpointInfo, state: dict[str, Any]) -> None:
        """Load ``source`` into ``state``: everything it holds, or raise before changing it.

        Raises:
            CheckpointError: the state and the checkpoint do not hold the same values (a
                partial load), or DCP failed.
            CheckpointUnsafeError: a pickle in the checkpoint is more than plain values.
        """
        reader = (SafeFileSystemReader(source.local_path()) if source.is_local
                  else SafeFsspecReader(source.url, **source.storage_options))
        metadata = reader.read_metadata()
        saved = json.loads(source.read_bytes(GLOBAL_NAME))
        entries = resolve(state)
        requested = {k: (v.state_dict() if isinstance(v, Stateful) else v)
                     for k, v in entries.items() if not is_global_state(v)}
        global_names = [k for k, v in entries.items() if is_global_state(v)]
        check_complete(requested, global_names, saved, metadata, self.ranks.rank, info.url)
        key = rng.rng_key(self.ranks.rank)
        has_rng = key in metadata.state_dict_metadata
        if has_rng:
            requested[key] = ""
        planner = SafeLoadPlanner()
        try:
            dcp.load(requested, storage_reader=reader, planner=planner,
                     process_group=self.ranks.control, no_dist=not self.ranks.distributed)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            if planner.refused is not None:
                raise planner.refused from None
            raise CheckpointError(f"could not load {info.url}: {describe(exc, self.ranks.rank)}"
                                  ) from exc
        for k, value in entries.items():
            if isinstance(value, Stateful) and not is_global_state(value):
                value.load_state_dict(requested[k])
            elif not is_global_state(value):
                state[k] = requested[k]
        for k in global_names:
            entries[k].load_state_dict(saved[K_STATES][k])
        if has_rng:
            rng.restore(rng.decode(str(requested[key])))
        else:
            rng.derive(self.seed, self.ranks.rank, info.step)


def checksum_present(location: Location, name: str) -> str:
    """``location.checksum(name)``, a missing file tried again a few times first.

    Raises:
        FileNotFoundError: still missing (proven damage); OSError: unreadable after retries.
    """
    for attempt in range(MISSING_ATTEMPTS):
        try:
            return location.checksum(name)
        except FileNotFoundError:
            if attempt + 1 == MISSING_ATTEMPTS:
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def check_complete(requested: dict[str, Any], global_names: list[str], saved: dict[str, Any],
                   metadata: Metadata, rank: int, where: str) -> None:
    """Raise unless the state asks for exactly what the checkpoint holds (for this rank).

    Compared: the top-level keys (each saving rank's, recorded in ``global.json``; a rank
    that did not save takes the keys every saving rank had), the global states, and every
    value inside each DCP entry (names and tensor shapes, as DCP's metadata lists them).

    Raises:
        CheckpointError: naming what one side has and the other lacks.
    """
    saved_states = saved.get(K_STATES, {})
    rank_keys = saved.get(K_RANK_KEYS)
    left_out: list[str] = []
    absent = sorted(set(global_names) - set(saved_states))
    if rank_keys:
        mine = set(rank_keys[rank]) if rank < len(rank_keys) else set.intersection(
            *(set(keys) for keys in rank_keys))
        left_out += sorted((mine - set(requested)) | (set(saved_states) - set(global_names)))
        absent += sorted(set(requested) - mine)
    flat, _ = flatten_state_dict(requested)
    saved_fqns = metadata.state_dict_metadata
    tops = [k for k in requested if k not in absent]
    left_out += sorted(fqn for fqn in saved_fqns if fqn not in flat and
                       any(fqn == k or fqn.startswith(k + ".") for k in tops))
    absent += sorted(fqn for fqn in flat if fqn not in saved_fqns and
                     not any(fqn == k or fqn.startswith(k + ".") for k in absent))
    shapes = []
    for fqn, value in flat.items():
        saved_value = saved_fqns.get(fqn)
        if (isinstance(value, torch.Tensor) and isinstance(saved_value, TensorStorageMetadata)
                and saved_value.size != value.shape):
            shapes.append(f"{fqn} {list(saved_value.size)} saved, {list(value.shape)} here")
    if not (left_out or absent or shapes):
        return
    problems = []
    if left_out:
        problems.append(f"the checkpoint holds {_few(left_out)} which are not in the given "
                        "state")
    if absent:
        problems.append(f"the given state asks for {_few(absent)} which are not in the "
                        "checkpoint")
    if shapes:
        problems.append(f"shapes differ: {_few(shapes)}")
    raise CheckpointError(
        f"{where}: the checkpoint does not match the given state (a load would be partial), "
        "nothing was loaded: " + "; ".join(problems) +
        ". Load with the keys, models and optimizers the checkpoint was saved with "
        "(torch.distributed.checkpoint.load loads a part of a checkpoint on purpose)"
    )


def _few(items: list[str], shown: int = 4) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return f"{items[:shown]}{more}"
