"""The Checkpointer: DCP saves of model, optimizer, loader, RNG and extras, async and tiered.

One save runs in five phases; only the first two block the training loop:

1. *collect* (caller's thread): ``state_dict()`` of every entry (raw modules and optimizers
   through DCP's ``get_*_state_dict``), RNG states, global states (checked identical on all
   ranks);
2. *stage* (caller's thread, async modes): copy tensors into reused host buffers, so later
   writes to the live tensors never reach the checkpoint (opt-in: model and optimizer
   tensors in the writer thread, see ``background_staging``);
3. *write* (background): DCP writes each rank's files to a local directory through the
   one-pass writer (``writer.py``: direct I/O, checksummed while written), whose CPU work
   yields to a busy training thread (``pace.py``);
4. *upload* (background, tiered or remote roots): each rank copies its files to ``root``;
5. *commit* (background, collective on the checkpointer's own gloo group): rank 0 gathers
   every rank's file list, checks it against DCP's metadata and publishes ``COMMIT.json``
   last; any failure anywhere publishes nothing, and every rank raises it at its next
   ``save`` or ``wait``.
"""

from __future__ import annotations

import builtins
import datetime
import logging
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..elastic import warn_restart_hazard
from . import layout
from .collect import collect
from .commit import Committer, SaveJob
from .errors import CheckpointError
from .guards import UpdateGuard
from .layout import CheckpointInfo
from .lease import Lease
from .memory import MemoryOptions, MemoryTier
from .modes import AsyncMode, IfBusy, SaveStats
from .pace import Pace
from .ranks import Ranks
from .restore import Restorer
from .root_claim import RootClaim
from .snapshots import Snapshots
from .staging import Staging
from .state import resolve
from .tiers import Location

log = logging.getLogger("streamcache.checkpoint")

# DCP's warning on every save and load without a process group: that is what a Checkpointer
# in one process means (ignored only where no process group exists)
_DCP_ONE_PROCESS_WARNING = ("torch.distributed is disabled, unavailable or uninitialized, "
                            "assuming the intent")


class Checkpointer:
    """Save and load training state with DCP: async, tiered, committed last, elastic.

    Every rank constructs it (in the same order relative to other process-group creations)
    and calls ``save``/``load``/``wait``/``close`` the same number of times. Without an
    initialized ``torch.distributed`` it works as a single process. One job at a time writes
    a root: the first save takes a lease on it (``lease_ttl``, ``job_id``); loading alone
    does not.

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
        background_staging: (thread mode, opt-in) copy the tensors of model and optimizer
            entries in the writer thread instead of before ``save`` returns; only
            ``optimizer.step()`` of the state's optimizers (and the forward of its models
            with buffers) waits for the copy. Any other in-place write before the copy is
            done (an EMA update, an optimizer outside the state) fails the save (version
            counters); a ``.data`` write tears it unless the loop calls :meth:`wait_staged`
            first. Off (the default), every tensor is copied to host memory before ``save``
            returns, so nothing the loop does afterwards reaches the checkpoint.
        storage_options: fsspec options for ``root`` (credentials, endpoint).
        lease_ttl: seconds the lease on ``root`` lives without renewal (see ``lease.py``):
            a second job writing the same root is refused; a job that died stops blocking
            a restart on its node at once, elsewhere after this long.
        job_id: an id shared by the restarts of one job, which may take the lease of an
            earlier attempt at once (default: torchrun's ``TORCHELASTIC_RUN_ID`` when set).
        writer_nice: (thread mode, Linux) scheduling niceness of the writer thread and the
            threads it starts (default 0, the training's priority). A higher value lets
            anything else on the machine delay the checkpoint's durability (19 made it 2.5x
            slower than a synchronous save under load); the training loop is protected by
            ``writer_cpu_share`` instead.
        writer_cpu_share: (thread mode) while the training thread is busy, the writer's CPU
            work (checksumming the bytes it writes; the writes themselves are direct I/O)
            takes at most this share of a core, yielding the rest to the loop (default
            0.25; 1 never yields). While the loop waits, the writer runs at full speed.
        device_snapshot: (thread mode, CUDA) copy CUDA tensors to reused buffers on their GPU
            before ``save`` returns, where free GPU memory allows, and to host memory in the
            writer thread: ``save`` then blocks for a device-to-device copy only. Off by
            default; not yet exercised on a GPU by the project's tests.
        memory: the memory tier (``True`` or :class:`~.memory.MemoryOptions`): each rank's
            newest snapshots in node-local shared memory (``/dev/shm``), taken by
            :meth:`snapshot` (and by every ``save``) and restored by ``load`` when every rank
            holds a step at least as new as ``root``'s newest and the world is unchanged
            (docs/recovery.md). Off by default.

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
        background_staging: bool = False,
        writer_nice: int = 0,
        writer_cpu_share: float = 0.25,
        device_snapshot: bool = False,
        lease_ttl: float = 60.0,
        job_id: str | None = None,
        storage_options: dict[str, Any] | None = None,
        memory: bool | MemoryOptions = False,
    ) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: keep at least 1 checkpoint")
        if not 0 < writer_cpu_share <= 1:
            raise CheckpointError(f"writer_cpu_share={writer_cpu_share}: give a share of a "
                                  "core in (0, 1]")
        self.root = Location(root, storage_options)
        from ..loading.options import check_local_folder  # here: it imports the loading stack

        if self.root.is_local:  # a file at or above it is a clear error, not a raw OSError
            check_local_folder("root", self.root.path)
        if local_dir is not None:
            check_local_folder("local_dir", local_dir)
        self.async_mode = AsyncMode(async_mode)
        self.if_busy = IfBusy(if_busy)
        self.writer_nice = writer_nice
        self._ranks = Ranks(timeout)
        warn_restart_hazard()  # (a torchrun setup whose restarts fail to connect)
        self.rank, self.world_size = self._ranks.rank, self._ranks.world_size
        if self.async_mode is AsyncMode.PROCESS and not self._ranks.distributed:
            raise CheckpointError(
                "async_mode='process' needs torch.distributed to be initialized (DCP's "
                "checkpoint process joins its own process group); use async_mode='thread'"
            )
        self._sequence = 0
        self._private_tmp: str | None = None
        if local_dir is not None:
            write_base = Location(local_dir)
        elif self.root.is_local:
            write_base = self.root
        else:  # files are checksummed on local disk before they are uploaded
            self._private_tmp = tempfile.mkdtemp(prefix="streamcache-ckpt-")
            write_base = Location(self._private_tmp)
        self._guard = UpdateGuard()  # (background staging and background snapshot copies)
        self._staging: Staging | None = None
        if self.async_mode is not AsyncMode.SYNC:
            self._staging = Staging(
                guard=self._guard,
                shared_memory=self.async_mode is AsyncMode.PROCESS,
                background=background_staging and self.async_mode is AsyncMode.THREAD,
                device_snapshot=device_snapshot and self.async_mode is AsyncMode.THREAD,
            )
        if job_id is None and os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
            job_id = os.environ["TORCHELASTIC_RUN_ID"]
        self._lease = Lease(self.root, lease_ttl, job_id) if self.rank == 0 else None
        self._pace = Pace(writer_cpu_share)
        self._committer = Committer(
            self._ranks, self.root, write_base, keep_last, write_threads, self._staging,
            self._private_tmp is not None,
            confirm_lease=self._lease.confirm if self._lease is not None else None,
            pace=self._pace if self.async_mode is AsyncMode.THREAD else None)
        self._restorer = Restorer(self._ranks, self.root, write_base, seed)
        if not self._ranks.distributed:  # DCP warns on every call that it assumes one process
            warnings.filterwarnings("ignore", message=_DCP_ONE_PROCESS_WARNING)
        self._claim = RootClaim(self._ranks, self.root, self._lease)
        self._thread: threading.Thread | None = None
        self._job: SaveJob | None = None
        self._closed = False
        self.last_save: SaveStats | None = None
        if self.rank == 0:
            self.root.makedirs()
        write_base.makedirs()
        self._memory: MemoryTier | None = None
        self._snapshots: Snapshots | None = None
        if memory:
            options = memory if isinstance(memory, MemoryOptions) else MemoryOptions()
            self._memory = MemoryTier(options, self.root.url, self.rank, self.world_size,
                                      job_id)
            self._snapshots = Snapshots(self._memory, self._ranks, self.root,
                                        self._guard if options.background_copy else None)

    # ------------------------------------------------------------------ public API

    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Checkpoint ``state`` as ``step``; all ranks call it with the same keys.

        Blocks while the state is collected and copied to host memory (async modes; with
        ``background_staging`` only the small entries are copied here) or until the
        checkpoint is committed (sync mode): the checkpoint holds the values of this call,
        whatever the loop writes into the tensors afterwards. Raw ``nn.Module`` and
        ``Optimizer`` values are saved as :class:`ModelState` saves them (an optimizer with
        the one module of ``state`` that holds its parameters). Returns False if the save
        was skipped (``if_busy="skip"``).

        Raises:
            CheckpointWriteError: the *previous* async save failed on some rank (nothing was
                published for it); this save was not started.
            CheckpointError: a global state differs between ranks or is not JSON-able, a
                raw optimizer cannot be paired with exactly one module of ``state``, another
                live job holds the lease on ``root``, or this job lost it (another job took
                the root over while this one stalled: every later save fails too).
        """
        self._check_open()
        self._claim.ensure()
        started = time.perf_counter()
        if self._job is not None and self.if_busy is IfBusy.SKIP:
            busy = self._thread is not None and self._thread.is_alive()
            if self._ranks.any_true(busy, self._ranks.control):
                return False
        self.wait()
        name = layout.dir_name(step, self._ranks.run_id, self._sequence)
        self._sequence += 1
        entries = resolve(state)
        state_dict, global_bytes = collect(entries, self._ranks, self._lease)
        if self._snapshots is not None:
            self._snapshots.started(name)
            self._snapshot(step, entries)
        job = SaveJob(step, name, self._committer.write_base.child(name), None, global_bytes,
                      started, timeline=self._claim.timeline)
        self._pace.watch()  # the writer yields to this thread while it is busy
        if self.async_mode is AsyncMode.SYNC:
            job.state = state_dict
            self._committer.run(job)
            self._finish(job)
            return True
        assert self._staging is not None
        if self.async_mode is AsyncMode.PROCESS:
            job.dcp_future = dcp.async_save(
                state_dict,
                storage_writer=self._committer.writer(job.write_dir),
                process_group=self._ranks.writer,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self._staging.stager,
            )
        else:
            job.state, job.stage_later = self._staging.stage(entries, state_dict)
        job.blocked_s = time.perf_counter() - started
        self.last_save = SaveStats(step, job.blocked_s)
        self._job = job
        self._thread = threading.Thread(
            target=self._run_in_thread, args=(job,), name=f"streamcache-checkpoint-{step}",
            daemon=True,
        )
        self._thread.start()
        return True

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed or has failed, and the newest
        memory-tier snapshot is whole.

        Raises:
            CheckpointWriteError: that save failed on some rank; nothing was published.
        """
        self._guard.wait()  # a background copy's check is this thread's (guards.VersionCheck)
        if self._memory is not None:
            self._memory.wait()
        job, thread = self._job, self._thread
        if job is None or thread is None:
            return
        thread.join()
        self._job, self._thread = None, None
        self._finish(job)

    @property
    def in_flight(self) -> bool:
        """Whether a save's background part (staging, writing, commit) still runs: True
        until :meth:`wait` would return at once. Does not raise a failed save's error
        (:meth:`wait` and the next :meth:`save` do)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """Snapshot ``state`` as ``step`` into the memory tier only: no collective, no disk.

        Meant for every step or few (docs/recovery.md): it copies this rank's state into
        node-local shared memory before it returns (one copy, into a mapping reused from one
        snapshot to the next); a background thread checksums it and marks it whole a few
        milliseconds later (a kill before that restores the snapshot before; :meth:`wait`
        waits for it). A restart on the same world restores the newest step every rank holds.
        Disk and ``root`` get only what :meth:`save` writes. All ranks call it at the same
        steps. Returns False when the memory tier is off or the snapshot did not fit (a
        warning; the previous one stays).

        Raises:
            CheckpointError: a value of ``state`` cannot be kept in the memory tier, or
                another live job holds the lease on ``root``.
        """
        self._check_open()
        if self._snapshots is None:
            return False
        self._claim.ensure()
        return self._snapshot(step, resolve(state))

    def wait_staged(self) -> None:
        """Block until the save or snapshot in flight no longer reads the live model and
        optimizer tensors.

        Only needed with ``background_staging`` or ``MemoryOptions(background_copy=True)``
        before changing model or optimizer state by other means than ``optimizer.step()`` or
        the model's forward (which wait by themselves), e.g. editing weights in place.
        """
        self._guard.wait()

    def load(self, state: dict[str, Any], step: int | None = None) -> int | None:
        """Load the newest complete checkpoint (or ``step``) into ``state`` in place.

        Stateful entries get ``load_state_dict``, raw modules and optimizers are set as
        :class:`ModelState` sets them, plain values are replaced in ``state``; this rank's
        RNG states are restored (or derived from ``seed`` if this rank did not exist). The
        newest checkpoint is that of the live timeline's history: ``load(step=N)`` of an
        older checkpoint is a rollback and starts a new timeline (the checkpoints after it
        are abandoned: kept, not loaded by a plain ``load``, not counted by retention).
        Every file is verified against the marker's checksums first (transient read errors
        are retried); a proven-damaged newest checkpoint is refused and the previous complete
        one is loaded instead. Everything is checked before anything is applied (keys,
        shapes, each global state against its object's ``validate_state_dict``, every
        non-tensor value, RNG states), so a refusal leaves ``state`` as it was. All ranks
        call it.

        Returns:
            The step loaded, or None when ``root`` holds no complete checkpoint (and ``step``
            was not given).

        Raises:
            CheckpointNotFoundError: ``step`` was given and has no complete checkpoint.
            CheckpointCorruptError: every candidate failed verification.
            CheckpointError: the state and the checkpoint do not hold the same values, reads
                kept failing, or (a rollback) another job holds the lease on ``root``.
            CheckpointUnsafeError: a pickle in the checkpoint is more than plain values, or
                its metadata reads files the commit marker does not list.
            CursorMismatchError: (from the StreamLoader) the loader state is another
                dataset's.
        """
        self._check_open()
        self.wait()
        if self._snapshots is not None and step is None:
            restored = self._snapshots.restore(state)
            if restored is not None:
                return restored
        loaded = self._restorer.load(state, step)
        if loaded is None:
            return None
        info, rollback = loaded
        if self._snapshots is not None:
            self._snapshots.loaded(info.name, rollback=rollback)
        if rollback:
            self._claim.start_timeline(info)
        return info.step

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint under ``root`` (cheap check), or None. Any rank."""
        return layout.latest(self.root)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every checkpoint directory under ``root``, oldest first, with completeness."""
        return layout.list_checkpoints(self.root)

    def close(self) -> None:
        """Wait for the save in flight, then release buffers, hooks and process groups; a
        clean finish also removes this rank's memory-tier snapshots."""
        self._close(finished=True)

    def _close(self, *, finished: bool) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._memory is not None:
                if finished:
                    self._memory.remove()
                self._memory.close()
            if self._staging is not None:
                self._staging.close()
            self._guard.close()
            if self._lease is not None:
                self._lease.close()
            self._ranks.close()
            if self._private_tmp is not None:
                Location(self._private_tmp).remove_tree()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the memory tier's snapshots stay: a restart restores them
            self._close(finished=False)
        except CheckpointError as close_error:  # do not mask the original exception
            log.error("while closing after an error: %s", close_error)

    # ------------------------------------------------------------------ internals

    def _snapshot(self, step: int, entries: Mapping[str, Any]) -> bool:
        assert self._snapshots is not None
        return self._snapshots.write(step, entries, timeline=self._claim.timeline,
                                     root_id=self._claim.root_id)

    def _run_in_thread(self, job: SaveJob) -> None:
        if self.writer_nice and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.writer_nice)
            except OSError as exc:
                log.warning("could not lower the writer thread's priority: %s", exc)
        self._committer.run(job)

    def _finish(self, job: SaveJob) -> None:
        if job.error is not None:
            raise job.error
        if self._snapshots is not None:
            self._snapshots.committed(job.name)
        if job.durable_s is not None:
            self.last_save = SaveStats(job.step, job.blocked_s or job.durable_s, job.durable_s)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; create a new one")
