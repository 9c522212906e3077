"""Loading: pick the newest complete checkpoint, verify every file, load it in place.

All ranks run it together (collectives on the control group): rank 0's list of candidates is
broadcast so every rank tries the same ones in the same order; each file's checksum is
verified by one rank and the first problem is shared; a damaged candidate is skipped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from . import layout, rng
from .commit import describe
from .dcp_metadata import check_metadata
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .layout import GLOBAL_NAME, K_RANK_KEYS, K_STATES, CheckpointInfo
from .ranks import Ranks
from .state import is_global_state, resolve, validate_state
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
            CheckpointUnsafeError: a pickle in the checkpoint is more than plain values, or
                its metadata reads files the commit marker does not list.
            Whatever a global state's ``validate_state_dict`` raises (the StreamLoader's
                CursorMismatchError: a state of another dataset).
        """
        self.prepare(source, info, state).apply()

    def prepare(self, source: Location, info: CheckpointInfo,
                state: dict[str, Any]) -> Prepared:
        """Read and check everything of ``info`` against ``state``; change nothing in it.

        Checked, on every rank, before any value is applied: the metadata (confined to the
        marker's files), ``global.json``, the keys and shapes, every global state against
        its object (``validate_state_dict``), the non-tensor values (read through the
        restricted unpickler) and this rank's RNG states. A refusal on any rank is raised on
        every rank. Tensors are read by :meth:`Prepared.apply`, in place.
        """
        assert info.marker is not None
        reader = (SafeFileSystemReader(source.local_path()) if source.is_local
                  else SafeFsspecReader(source.url, **source.storage_options))
        entries = resolve(state)
        checked: tuple[Any, ...] | None = None

        def check_locally() -> None:
            nonlocal checked
            checked = self._check(reader, source, info, entries)

        self._agree(check_locally, info.url)
        assert checked is not None
        saved, requested, has_rng = checked
        flat, mappings = flatten_state_dict(requested)
        values = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        self._dcp_load(values, reader, info)
        rng_state: dict[str, Any] | None = None

        def check_rng() -> None:
            nonlocal rng_state
            if has_rng:
                try:
                    rng_state = rng.decode(str(values.pop(rng.rng_key(self.ranks.rank))))
                    rng.check(rng_state)
                except ValueError as exc:
                    raise CheckpointError(f"{info.url}: the RNG states of rank "
                                          f"{self.ranks.rank} are malformed ({exc})") from exc

        self._agree(check_rng, info.url)
        return Prepared(self, reader, info, state, entries, requested, mappings, values,
                        tensors, saved.get(K_STATES, {}), rng_state)

    def _check(self, reader: Any, source: Location, info: CheckpointInfo,
               entries: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bool]:
        """This rank's checks of :meth:`prepare` before DCP reads anything."""
        assert info.marker is not None
        metadata = reader.read_metadata()
        check_metadata(metadata, info.marker.files, info.url)
        reader.keep_metadata(metadata)  # DCP's reads use these checked entries, not a re-read
        saved = read_global(source, info.url)
        requested = {k: (v.state_dict() if isinstance(v, Stateful) else v)
                     for k, v in entries.items() if not is_global_state(v)}
        global_names = [k for k, v in entries.items() if is_global_state(v)]
        check_complete(requested, global_names, saved, metadata, self.ranks.rank, info.url)
        for name in global_names:
            validate_state(entries[name], saved[K_STATES][name])
        key = rng.rng_key(self.ranks.rank)
        has_rng = key in metadata.state_dict_metadata
        if has_rng:
            requested[key] = ""
        return saved, requested, has_rng

    def _agree(self, check: Callable[[], None], where: str) -> None:
        """Run ``check`` on every rank; if it raised on any, raise on every rank.

        A rank whose own check failed raises its own exception; the others raise
        :class:`CheckpointError` naming the first failing rank, so that no rank goes on into
        a collective the failing one never joins.
        """
        error: Exception | None = None
        try:
            check()
        except Exception as exc:
            error = exc
        outcome = None if error is None else f"{type(error).__name__}: {error}"
        outcomes = self.ranks.all_gather(outcome, self.ranks.control)
        if error is not None:
            raise error
        failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
        if failed:
            rank, message = failed[0]
            raise CheckpointError(f"{where}: rank {rank} refused the checkpoint, nothing was "
                                  f"loaded: {message}")

    def _dcp_load(self, values: dict[str, Any], reader: Any, info: CheckpointInfo) -> None:
        """DCP's load of ``values`` (flat names) in place, through the restricted unpickler."""
        planner = SafeLoadPlanner()
        try:
            dcp.load(values, storage_reader=reader, planner=planner,
                     process_group=self.ranks.control, no_dist=not self.ranks.distributed)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            if planner.refused is not None:
                raise planner.refused from None
            raise CheckpointError(f"could not load {info.url}: {describe(exc, self.ranks.rank)}"
                                  ) from exc


@dataclass
class Prepared:
    """A checkpoint read and checked against a state by :meth:`Restorer.prepare`: nothing of
    the state has changed yet. :meth:`apply` reads the tensors into the state's own tensors
    (DCP loads in place) and hands every value to its object. All ranks call it."""

    restorer: Restorer
    reader: Any
    info: CheckpointInfo
    state: dict[str, Any]
    entries: dict[str, Any]
    requested: dict[str, Any]
    mappings: dict[str, Any]
    values: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    global_states: dict[str, Any]
    rng_state: dict[str, Any] | None

    def apply(self) -> None:
        """Load the tensors and apply everything.

        Raises:
            CheckpointError: reading the tensors failed (an I/O error after the files were
                verified); tensors may then be partly loaded, say the message.
        """
        try:
            self.restorer._dcp_load(self.tensors, self.reader, self.info)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (tensors of the state may be partly loaded: load "
                                  "again before training)") from exc
        for fqn, value in self.values.items():
            set_element(self.requested, self.mappings[fqn], value)
        for key, value in self.entries.items():
            if is_global_state(value):
                continue
            if isinstance(value, Stateful):
                value.load_state_dict(self.requested[key])
            else:
                self.state[key] = self.requested[key]
        for key, value in self.entries.items():
            if is_global_state(value):
                value.load_state_dict(self.global_states[key])
        if self.rng_state is not None:
            rng.restore(self.rng_state)
        else:
            rng.derive(self.restorer.seed, self.restorer.ranks.rank, self.info.step)


def read_global(source: Location, where: str) -> dict[str, Any]:
    """``global.json`` of a checkpoint, checked for shape (its checksum was verified).

    Raises:
        CheckpointCorruptError: not a dict of global states and each rank's keys.
    """
    try:
        saved = json.loads(source.read_bytes(GLOBAL_NAME, layout.GLOBAL_LIMIT))
        states, rank_keys = saved.get(K_STATES, {}), saved.get(K_RANK_KEYS)
        if not isinstance(states, dict) or not (rank_keys is None or (
                isinstance(rank_keys, list) and all(
                    isinstance(keys, list) and all(isinstance(k, str) for k in keys)
                    for keys in rank_keys))):
            raise ValueError("unexpected layout")
    except (ValueError, AttributeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where}: {GLOBAL_NAME} is not a checkpoint's global "
                                     f"states ({exc}); it cannot be loaded") from exc
    return dict(saved)


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
