"""The Checkpointer: DCP saves of model, optimizer, loader, RNG and extras, async and tiered.

One save runs in five phases; only the first two block the training loop:

1. *collect* (caller's thread): ``state_dict()`` of every entry, RNG states, global states
   (checked identical on all ranks);
2. *stage* (caller's thread, async modes): copy tensors into reused host buffers;
3. *write* (background): DCP writes each rank's files to a local directory;
4. *upload* (background, tiered or remote roots): each rank checksums its files and copies
   them to ``root``;
5. *commit* (background, collective on the checkpointer's own gloo group): rank 0 gathers
   every rank's file list, checks it against DCP's metadata and publishes ``COMMIT.json``
   last; any failure anywhere publishes nothing, and every rank raises it at its next
   ``save`` or ``wait``.
"""

from __future__ import annotations

import builtins
import datetime
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from ..checksum import checksum_bytes
from . import layout, rng
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from .layout import GLOBAL_NAME, MARKER_NAME, CheckpointInfo, FileEntry
from .staging import Staging
from .state import is_global_state
from .tiers import Location

log = logging.getLogger("streamcache.checkpoint")

_RANK_FILE_RE = re.compile(r"^__(\d+)_")


class AsyncMode(str, Enum):
    """How a save's write phase runs.

    ``SYNC``: ``save`` returns when the checkpoint is committed (durable).
    ``THREAD``: stage to reused host buffers, write in a background thread of this process.
    ``PROCESS``: stage to reused shared-memory buffers, write in DCP's checkpoint process.
    """

    SYNC = "sync"
    THREAD = "thread"
    PROCESS = "process"


class IfBusy(str, Enum):
    """What ``save`` does while the previous save is still being written.

    ``WAIT``: block until it is committed, then save. ``SKIP``: skip this save (all ranks
    agree) and return False. A write in flight is never cancelled: DCP's collectives cannot be
    abandoned half way, and its staging buffers are reused by the next save.
    """

    WAIT = "wait"
    SKIP = "skip"


@dataclass(frozen=True)
class SaveStats:
    """Timings of one save, in seconds, on this rank."""

    step: int
    blocked_s: float
    durable_s: float | None = None


@dataclass
class _Job:
    step: int
    name: str
    write_dir: Location
    state: dict[str, Any] | None
    global_bytes: bytes
    started: float
    blocked_s: float
    dcp_future: Any = None
    stage_later: dict[str, Any] | None = None
    error: BaseException | None = None
    durable_s: float | None = None


class Checkpointer:
    """Save and load training state with DCP: async, tiered, committed last, elastic.

    Every rank constructs it (in the same order relative to other process-group creations)
    and calls ``save``/``load``/``wait``/``close`` the same number of times. Without an
    initialized ``torch.distributed`` it works as a single process.

    Args:
        root: where checkpoints live: a local path or any fsspec URL (``s3://...``).
        local_dir: fast node-local directory (NVMe). Each rank writes there first and the
            checkpoint is uploaded to ``root`` in the background; a restart on the same node
            loads from it when it is complete and identical to ``root``'s copy.
        keep_last: how many complete checkpoints to keep (at least 1).
        async_mode: ``"thread"`` (default), ``"process"`` or ``"sync"``; see :class:`AsyncMode`.
        if_busy: ``"wait"`` (default) or ``"skip"``; see :class:`IfBusy`.
        seed: base seed for RNG states of ranks that did not exist when a checkpoint was saved.
        timeout: timeout of the checkpointer's collectives.
        write_threads: DCP writer threads per rank.
        background_staging: (thread mode) copy the tensors of :class:`ModelState` entries in
            the writer thread; ``optimizer.step()`` (and the forward of models with buffers)
            waits until the copy is done. See :meth:`wait_staged`.
        storage_options: fsspec options for ``root`` (credentials, endpoint).
        writer_nice: (thread mode, Linux) scheduling niceness of the writer thread, so that
            the background write takes CPU time the training loop leaves idle.

    Thread safety: call from one thread (the training loop); the background work has its own
    thread and its own gloo process group.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        local_dir: str | os.PathLike[str] | None = None,
        keep_last: int = 3,
        async_mode: AsyncMode | str = AsyncMode.THREAD,
        if_busy: IfBusy | str = IfBusy.WAIT,
        seed: int = 0,
        timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        write_threads: int = 1,
        background_staging: bool = True,
        writer_nice: int = 0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least 1 checkpoint")
        self.root = Location(root, storage_options)
        self.async_mode = AsyncMode(async_mode)
        self.if_busy = IfBusy(if_busy)
        self.keep_last = keep_last
        self.seed = seed
        self.write_threads = write_threads
        self.writer_nice = writer_nice
        self._distributed = dist.is_available() and dist.is_initialized()
        self._control_pg: Any = None
        self._ckpt_pg: Any = None
        self.rank, self.world_size = 0, 1
        run_id = secrets.token_hex(3)
        if self._distributed:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            # Two groups: one for the caller's thread, one owned by the background write,
            # so neither ever races the other or the training's own collectives.
            self._control_pg = dist.new_group(backend="gloo", timeout=timeout)
            self._ckpt_pg = dist.new_group(backend="gloo", timeout=timeout)
            holder = [run_id]
            dist.broadcast_object_list(holder, src=0, group=self._control_pg)
            run_id = holder[0]
        if self.async_mode is AsyncMode.PROCESS and not self._distributed:
            raise CheckpointError(
                "async_mode='process' needs torch.distributed to be initialized (DCP's "
                "checkpoint process joins its own process group); use async_mode='thread'"
            )
        self._run_id = run_id
        self._sequence = 0
        self._private_tmp: str | None = None
        if local_dir is not None:
            self._write_base = Location(local_dir)
        elif self.root.is_local:
            self._write_base = self.root
        else:
            self._private_tmp = tempfile.mkdtemp(prefix="streamcache-ckpt-")
            self._write_base = Location(self._private_tmp)
        self._tiered = self._write_base.url != self.root.url
        self._staging: Staging | None = None
        if self.async_mode is not AsyncMode.SYNC:
            self._staging = Staging(
                shared_memory=self.async_mode is AsyncMode.PROCESS,
                background=background_staging and self.async_mode is AsyncMode.THREAD,
            )
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None
        self._closed = False
        self.last_save: SaveStats | None = None
        if self.rank == 0:
            self.root.makedirs()
        self._write_base.makedirs()

    # ------------------------------------------------------------------ public API

    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Checkpoint ``state`` as ``step``; all ranks call it with the same keys.

        Blocks while the state is collected and staged (async modes) or until the checkpoint
        is committed (sync mode). Returns False if the save was skipped (``if_busy="skip"``).

        Raises:
            CheckpointWriteError: the *previous* async save failed on some rank (nothing was
                published for it); this save was not started.
            CheckpointError: a global state differs between ranks or is not JSON-able.
        """
        self._check_open()
        started = time.perf_counter()
        if self._job is not None and self.if_busy is IfBusy.SKIP and self._any_rank_busy():
            return False
        self.wait()
        name = layout.dir_name(step, self._run_id, self._sequence)
        self._sequence += 1
        state_dict, global_bytes = self._collect(state)
        job = _Job(step, name, self._write_base.child(name), None, global_bytes, started, 0.0)
        if self.async_mode is AsyncMode.SYNC:
            job.state = state_dict
            self._run_job(job)
            self._raise_if_failed(job)
            return True
        if self.async_mode is AsyncMode.PROCESS:
            job.dcp_future = dcp.async_save(
                state_dict,
                storage_writer=self._writer(job.write_dir),
                process_group=self._ckpt_pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self._staging.stager if self._staging else None,
                no_dist=not self._distributed,
            )
        else:
            assert self._staging is not None
            now, job.stage_later = self._staging.split(state, state_dict)
            job.state = self._staging.stage_now(now)
        job.blocked_s = time.perf_counter() - started
        self.last_save = SaveStats(step, job.blocked_s)
        self._job = job
        self._thread = threading.Thread(
            target=self._run_job_in_thread, args=(job,), name=f"streamcache-checkpoint-{step}", daemon=True
        )
        self._thread.start()
        return True

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed or has failed.

        Raises:
            CheckpointWriteError: that save failed on some rank; nothing was published.
        """
        job, thread = self._job, self._thread
        if job is None or thread is None:
            return
        thread.join()
        self._job, self._thread = None, None
        self._raise_if_failed(job)

    def wait_staged(self) -> None:
        """Block until the save in flight no longer reads the live model/optimizer tensors.

        Only needed with ``background_staging`` before changing model or optimizer state by
        other means than ``optimizer.step()`` or the model's forward (which wait by
        themselves), e.g. editing weights in place.
        """
        if self._staging is not None:
            self._staging.wait_staged()

    def load(self, state: dict[str, Any], step: int | None = None) -> int | None:
        """Load the newest complete checkpoint (or ``step``) into ``state`` in place.

        Stateful entries get ``load_state_dict``; plain values are replaced in ``state``;
        this rank's RNG states are restored (or derived from ``seed`` if this rank did not
        exist). Every file is verified against the marker's checksums first; a damaged
        newest checkpoint is refused and the previous complete one is loaded instead.
        All ranks call it.

        Returns:
            The step loaded, or None when ``root`` holds no complete checkpoint (and ``step``
            was not given).

        Raises:
            CheckpointNotFoundError: ``step`` was given and has no complete checkpoint.
            CheckpointCorruptError: every candidate failed verification.
        """
        self._check_open()
        self.wait()
        candidates = self._agree(
            [info.name for info in layout.complete_newest_first(self.root, step)]
        )
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
            source, problem = self._verified_source(info)
            if source is None:
                log.error("refusing checkpoint %s: %s", info.url, problem)
                problems.append(f"{name}: {problem}")
                if step is not None:
                    break
                continue
            self._load_from(source, info, state)
            return info.step
        raise CheckpointCorruptError(
            "no loadable checkpoint: " + "; ".join(problems) + ". The files do not match "
            "their commit markers; restore them from a backup or delete these directories"
        )

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint under ``root`` (cheap check), or None. Any rank."""
        return layout.latest(self.root)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every checkpoint directory under ``root``, oldest first, with completeness."""
        return layout.list_checkpoints(self.root)

    def close(self) -> None:
        """Wait for the save in flight, then release buffers and process groups."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._staging is not None:
                self._staging.close()
            for group in (self._ckpt_pg, self._control_pg):
                if group is not None:
                    dist.destroy_process_group(group)
            if self._private_tmp is not None:
                Location(self._private_tmp).remove_tree()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as close_error:  # do not mask the original exception
            log.error("while closing after an error: %s", close_error)

    # ------------------------------------------------------------------ save internals

    def _collect(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], bytes]:
        state_dict: dict[str, Any] = {}
        global_states: dict[str, Any] = {}
        for key, value in state.items():
            if key.startswith("_streamcache"):
                raise CheckpointError(f"state key {key!r}: keys starting with _streamcache "
                                      "are reserved; rename it")
            if is_global_state(value):
                global_states[key] = value.state_dict()
            elif isinstance(value, Stateful):
                state_dict[key] = value.state_dict()
            else:
                state_dict[key] = value
        state_dict[rng.rng_key(self.rank)] = rng.encode(rng.capture())
        try:
            global_bytes = layout.json_bytes({"version": 1, "states": global_states})
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"a global state is not JSON-able ({exc}); global states "
                "(global_state=True or GlobalState) must be small JSON-able dicts"
            ) from exc
        if self._distributed and global_states:
            self._check_same_on_all_ranks(global_bytes)
        return state_dict, global_bytes

    def _check_same_on_all_ranks(self, global_bytes: bytes) -> None:
        digests: builtins.list[Any] = [None] * self.world_size
        dist.all_gather_object(digests, checksum_bytes(global_bytes),
                               group=self._control_pg)
        if len(set(digests)) != 1:
            differing = [r for r, d in enumerate(digests) if d != digests[0]]
            raise CheckpointError(
                f"global states differ between ranks (ranks {differing} differ from rank 0); "
                "a global state must be identical on every rank: wrap only rank-independent "
                "state in GlobalState"
            )

    def _any_rank_busy(self) -> bool:
        busy = self._thread is not None and self._thread.is_alive()
        if not self._distributed:
            return busy
        flag = torch.tensor([1 if busy else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control_pg)
        return bool(flag.item())

    def _writer(self, write_dir: Location) -> dcp.FileSystemWriter:
        # A tier's copy need not be durable: root's copy is, and a restart verifies the
        # local copy against the marker before trusting it.
        return dcp.FileSystemWriter(
            write_dir.local_path(),
            sync_files=not self._tiered,
            thread_count=self.write_threads,
            overwrite=False,
        )

    def _run_job_in_thread(self, job: _Job) -> None:
        if self.writer_nice and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.writer_nice)
            except OSError as exc:
                log.warning("could not lower the writer thread's priority: %s", exc)
        self._run_job(job)

    def _run_job(self, job: _Job) -> None:
        """Write, upload and commit one save; runs on every rank, ends with one collective."""
        files: dict[str, FileEntry] = {}
        error: str | None = None
        try:
            if job.dcp_future is not None:
                job.dcp_future.result()
            else:
                if job.stage_later is not None and job.state is not None:
                    assert self._staging is not None
                    job.state.update(self._staging.stage_later(job.stage_later))
                    job.stage_later = None
                dcp.save(
                    job.state,
                    storage_writer=self._writer(job.write_dir),
                    process_group=self._ckpt_pg,
                    no_dist=not self._distributed,
                )
            job.state = None  # staged buffers are reused; drop the references now
            if self.rank == 0:
                job.write_dir.write_atomic(GLOBAL_NAME, job.global_bytes)
            files = self._checksum_and_upload(job)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            error = _describe(exc, self.rank)
            log.error("checkpoint step %d failed on this rank: %s", job.step, error)
        try:
            outcome = self._commit(job, files, error)
        except Exception as exc:  # a rank died or the group broke: nothing was published
            outcome = f"the commit collective failed ({type(exc).__name__}: {exc})"
        if outcome is not None:
            job.error = CheckpointWriteError(
                f"checkpoint of step {job.step} was not committed: {outcome}. Nothing was "
                "published for it; fix the cause (disk space, permissions, network) and save "
                "again, older checkpoints are intact"
            )
        else:
            job.durable_s = time.perf_counter() - job.started
            self.last_save = SaveStats(job.step, job.blocked_s or job.durable_s, job.durable_s)
            self._after_commit(job)

    def _own_files(self, write_dir: Location) -> builtins.list[str]:
        """The files of this attempt this rank is responsible for (DCP names them __<rank>_)."""
        owned = []
        for name in write_dir.list_sizes():
            match = _RANK_FILE_RE.match(name)
            if match is not None:
                if int(match.group(1)) == self.rank:
                    owned.append(name)
            elif self.rank == 0 and ".tmp" not in name:
                owned.append(name)
        return sorted(owned)

    def _checksum_and_upload(self, job: _Job) -> dict[str, FileEntry]:
        files = {}
        target = self.root.child(job.name)
        if self._tiered:
            target.makedirs()
        for name in self._own_files(job.write_dir):
            path = job.write_dir.local_path(name)
            files[name] = FileEntry(os.path.getsize(path), job.write_dir.checksum(name))
            if self._tiered:
                upload_file(target, path, name)
        return files

    def _commit(self, job: _Job, files: dict[str, FileEntry], error: str | None) -> str | None:
        """Gather every rank's files on rank 0, publish the marker last; returns the error."""
        gathered: builtins.list[Any] = [(files, error)]
        if self._distributed:
            gathered = [None] * self.world_size if self.rank == 0 else []
            dist.gather_object((files, error), gathered if self.rank == 0 else None, dst=0,
                               group=self._ckpt_pg)
        outcome: str | None = None
        if self.rank == 0:
            try:
                outcome = self._publish(job, gathered)
            except Exception as exc:
                outcome = f"rank 0 could not publish the marker: {type(exc).__name__}: {exc}"
        if self._distributed:
            holder = [outcome]
            dist.broadcast_object_list(holder, src=0, group=self._ckpt_pg)
            outcome = holder[0]
        return outcome

    def _publish(self, job: _Job, gathered: builtins.list[Any]) -> str | None:
        errors = [err for _, err in gathered if err is not None]
        if errors:
            return "; ".join(dict.fromkeys(errors))  # DCP reports one failure on every rank
        merged: dict[str, FileEntry] = {}
        for files, _ in gathered:
            merged.update(files)
        expected = _dcp_files(job.write_dir)
        missing = sorted(expected - merged.keys())
        if missing:
            claimed = {rank: sorted(files) for rank, (files, _) in enumerate(gathered)}
            return f"files written by DCP but claimed by no rank: {missing} (claimed: {claimed})"
        marker = layout.new_marker(job.step, self.world_size, merged)
        layout.write_marker(self.root.child(job.name), marker)
        return None

    def _after_commit(self, job: _Job) -> None:
        """Retention on root (rank 0) and on this rank's local tier; failures only log."""
        try:
            keep = self._retention_keep_names(job)
            if self.rank == 0:
                self._prune(self.root, keep, job.step)
            if self._tiered:
                self._prune(self._write_base, keep, job.step)
            if self._private_tmp is not None:
                job.write_dir.remove_tree()
        except Exception as exc:
            log.warning("checkpoint retention failed (checkpoints are intact): %s", exc)

    def _retention_keep_names(self, job: _Job) -> set[str]:
        names: builtins.list[Any] = [None]
        if self.rank == 0:
            complete = layout.complete_newest_first(self.root)
            names = [[*sorted(info.name for info in complete[:self.keep_last]), job.name]]
        if self._distributed:
            dist.broadcast_object_list(names, src=0, group=self._ckpt_pg)
        return set(names[0])

    def _prune(self, location: Location, keep: set[str], newest_step: int) -> None:
        """Delete checkpoints not kept that are older than the newest complete step.

        Directories of newer steps are left alone (never delete one being written); a
        complete checkpoint loses its marker before its files, so it is never seen half
        deleted as complete.
        """
        for step, name, _, _ in layout.scan(location):
            if name in keep or step > newest_step:
                continue
            location.child(name).remove(MARKER_NAME)
            location.child(name).remove_tree()

    def _raise_if_failed(self, job: _Job) -> None:
        if job.error is not None:
            raise job.error

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")

    # ------------------------------------------------------------------ load internals

    def _agree(self, names: builtins.list[str]) -> builtins.list[str]:
        """Rank 0's view of the candidates, so every rank tries the same ones in order."""
        if not self._distributed:
            return names
        holder = [names]
        dist.broadcast_object_list(holder, src=0, group=self._control_pg)
        return list(holder[0])

    def _verified_source(self, info: CheckpointInfo) -> tuple[Location | None, str | None]:
        """The local copy if complete and identical on every rank, else root; or a problem."""
        assert info.marker is not None
        if self._tiered:
            local = self._write_base.child(info.name)
            local_ok = layout.size_problem(info.marker, local.list_sizes()) is None
            if self._all_ranks(local_ok) and self._verify(local, info) is None:
                return local, None
        root_copy = self.root.child(info.name)
        problem = self._verify(root_copy, info)
        return (root_copy, None) if problem is None else (None, problem)

    def _verify(self, location: Location, info: CheckpointInfo) -> str | None:
        """Full checksum verification, the files split across ranks; the first problem."""
        assert info.marker is not None
        names = sorted(info.marker.files)
        problem = None
        for name in names[self.rank :: self.world_size]:
            expected = info.marker.files[name].checksum
            try:
                actual = location.checksum(name)
            except OSError as exc:
                problem = f"{name}: unreadable ({exc})"
                break
            if actual != expected:
                problem = (f"{name} is corrupt: checksum {actual}, the commit marker says "
                           f"{expected}")
                break
        if not self._distributed:
            return problem
        problems: builtins.list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self._control_pg)
        return next((p for p in problems if p is not None), None)

    def _all_ranks(self, flag: bool) -> bool:
        if not self._distributed:
            return flag
        value = torch.tensor([1 if flag else 0])
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self._control_pg)
        return bool(value.item())

    def _load_from(self, source: Location, info: CheckpointInfo, state: dict[str, Any]) -> None:
        reader: dcp.FileSystemReader = (
            dcp.FileSystemReader(source.local_path()) if source.is_local
            else FsspecReader(source.url, **source.storage_options)
        )
        metadata = reader.read_metadata()
        dcp_state = {k: v for k, v in state.items() if not is_global_state(v)}
        key = rng.rng_key(self.rank)
        has_rng = key in metadata.state_dict_metadata
        if has_rng:
            dcp_state[key] = ""
        dcp.load(dcp_state, storage_reader=reader, process_group=self._control_pg,
                 no_dist=not self._distributed)
        for k, value in state.items():
            if not is_global_state(value) and not isinstance(value, Stateful):
                state[k] = dcp_state[k]
        self._load_global(source, state)
        if has_rng:
            rng.restore(rng.decode(dcp_state[key]))
        else:
            rng.derive(self.seed, self.rank, info.step)

    def _load_global(self, source: Location, state: dict[str, Any]) -> None:
        saved = json.loads(source.read_bytes(GLOBAL_NAME))["states"]
        for key, value in state.items():
            if not is_global_state(value):
                continue
            if key not in saved:
                raise CheckpointError(
                    f"global state {key!r} is not in the checkpoint (it has "
                    f"{sorted(saved)}); load with the keys it was saved with"
                )
            value.load_state_dict(saved[key])


def _describe(exc: BaseException, rank: int) -> str:
    """One line per failing rank; DCP's exception carries every rank's failure."""
    if isinstance(exc, CheckpointException):
        parts = []
        for failed_rank, failure in sorted(exc.failures.items()):
            # a _WrappedException locally, an (exception, frames) tuple from other ranks
            inner = failure[0] if isinstance(failure, tuple) else failure
            inner = getattr(inner, "exception", inner)
            parts.append(f"rank {failed_rank}: {type(inner).__name__}: {inner}")
        return "; ".join(parts)
    return f"rank {rank}: {type(exc).__name__}: {exc}"


def upload_file(target: Location, local_file: str, name: str) -> None:
    """Copy one finished file to ``root`` (a seam of its own: crash tests kill inside it)."""
    target.put_file(local_file, name)


def _dcp_files(write_dir: Location) -> set[str]:
    """Every file DCP's metadata refers to, plus the metadata and global.json themselves."""
    metadata = dcp.FileSystemReader(write_dir.local_path()).read_metadata()
    storage = metadata.storage_data or {}
    paths = {info.relative_path for info in storage.values()}
    return paths | {layout.DCP_METADATA_NAME, GLOBAL_NAME}
