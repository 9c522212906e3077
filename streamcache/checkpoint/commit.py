"""The background part of a save: write, checksum, upload, commit, retention.

Runs on every rank (in the writer thread, or in the caller's thread in sync mode) and ends
with collectives on the writer group: rank 0 gathers every rank's file list and error,
publishes the marker only if there is no error and the files cover everything DCP's metadata
refers to, and broadcasts the outcome so that every rank reports the same failure.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..format.checksum import checksum_bytes
from . import layout
from .errors import CheckpointWriteError
from .layout import GLOBAL_NAME, MARKER_NAME, FileEntry
from .pace import Pace
from .ranks import Ranks
from .staging import Staging
from .tiers import Location
from .unpickle import SafeFileSystemReader
from .writer import OnePassWriter

log = logging.getLogger("streamcache.checkpoint")

_RANK_FILE_RE = re.compile(r"^__(\d+)_")


@dataclass
class SaveJob:
    """One save attempt, from staging to commit."""

    step: int
    name: str
    write_dir: Location
    state: dict[str, Any] | None
    global_bytes: bytes
    started: float
    blocked_s: float = 0.0
    dcp_future: Any = None
    stage_later: dict[str, Any] | None = None
    error: CheckpointWriteError | None = None
    durable_s: float | None = None
    timeline: str = ""
    # this rank's files whose size and checksum the writer knows (no second read needed)
    known_files: dict[str, FileEntry] = field(default_factory=dict)


@dataclass
class Committer:
    """Everything the background part of a save needs; shared by all saves of a Checkpointer."""

    ranks: Ranks
    root: Location
    write_base: Location
    keep_last: int
    write_threads: int
    staging: Staging | None
    private_tmp: bool
    # rank 0: why this job may no longer publish under the root's lease (None: it may);
    # asked right before the marker is written and before retention deletes anything
    confirm_lease: Callable[[], str | None] | None = None
    # where the writer's hashing yields to a busy training thread (pace.py)
    pace: Pace | None = None

    @property
    def tiered(self) -> bool:
        return self.write_base.url != self.root.url

    def writer(self, write_dir: Location) -> dcp.FileSystemWriter:
        """DCP's own writer, for DCP's checkpoint process (``async_mode="process"``)."""
        # A tier's copy need not be durable: root's copy is, and a restart verifies the
        # local copy against the marker before trusting it.
        return dcp.FileSystemWriter(write_dir.local_path(), sync_files=not self.tiered,
                                    thread_count=self.write_threads, overwrite=False)

    def one_pass_writer(self, write_dir: Location) -> OnePassWriter:
        """The writer of this process's saves: one pass over the bytes (writer.py)."""
        return OnePassWriter(write_dir.local_path(), durable=not self.tiered,
                             thread_count=self.write_threads, pace=self.pace)

    def run(self, job: SaveJob) -> None:
        """Write, upload and commit ``job``; sets ``job.error`` or ``job.durable_s``."""
        files: dict[str, FileEntry] = {}
        error: str | None = None
        try:
            self._write(job)
            if self.ranks.rank == 0:
                job.write_dir.write_atomic(GLOBAL_NAME, job.global_bytes)
                job.known_files[GLOBAL_NAME] = FileEntry(len(job.global_bytes),
                                                         checksum_bytes(job.global_bytes))
            files = self._checksum_and_upload(job)
            error = self._torn(job)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            error = describe(exc, self.ranks.rank)
            log.error("checkpoint step %d failed on this rank: %s", job.step, error)
        finally:
            if self.staging is not None:
                self.staging.release_later()  # (a write that failed before staging them)
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
            return
        job.durable_s = time.perf_counter() - job.started
        self._after_commit(job)

    def _torn(self, job: SaveJob) -> str | None:
        """Why the state staged in the background is not the ``save`` call's, or None."""
        changed = self.staging.changed_while_staged() if self.staging is not None else []
        if not changed:
            return None
        error = (f"rank {self.ranks.rank}: tensors of {', '.join(map(repr, changed))} changed "
                 "while they were staged in the background (an in-place write other than "
                 "optimizer.step() or the model's forward, after save() and before its copy): "
                 "call Checkpointer.wait_staged() before such a write, or save without "
                 "background_staging")
        log.error("checkpoint step %d failed on this rank: %s", job.step, error)
        return error

    def _write(self, job: SaveJob) -> None:
        """Write this rank's DCP files (and note in ``job`` those whose checksum is known)."""
        if job.dcp_future is not None:  # process mode: DCP's checkpoint process writes
            job.dcp_future.result()
            return
        assert job.state is not None
        if self.staging is not None:
            job.state = self.staging.to_host(job.state)  # a GPU snapshot's copy to host
        if job.stage_later is not None:
            assert self.staging is not None
            job.state.update(self.staging.stage_later(job.stage_later))
            job.stage_later = None
        writer = self.one_pass_writer(job.write_dir)
        dcp.save(job.state, storage_writer=writer, process_group=self.ranks.writer,
                 no_dist=not self.ranks.distributed)
        job.state = None  # the staging buffers are reused by the next save
        job.known_files.update(writer.written)

    def _own_files(self, write_dir: Location) -> list[str]:
        """The files of this attempt this rank answers for (DCP names them __<rank>_...)."""
        owned = []
        for name in write_dir.list_sizes():
            match = _RANK_FILE_RE.match(name)
            if match is not None:
                if int(match.group(1)) == self.ranks.rank:
                    owned.append(name)
            elif self.ranks.rank == 0 and ".tmp" not in name:
                owned.append(name)
        return sorted(owned)

    def _checksum_and_upload(self, job: SaveJob) -> dict[str, FileEntry]:
        """This rank's files with their sizes and checksums (those not ``known`` read back:
        DCP's checkpoint process writes without telling), uploaded when tiered."""
        files = {}
        target = self.root.child(job.name)
        if self.tiered:
            target.makedirs()
        for name in self._own_files(job.write_dir):
            path = job.write_dir.local_path(name)
            entry = job.known_files.get(name)
            if entry is None or entry.size != os.path.getsize(path):
                entry = FileEntry(os.path.getsize(path), job.write_dir.checksum(name))
            files[name] = entry
            if self.tiered:
                upload_file(target, path, name)
        return files

    def _commit(self, job: SaveJob, files: dict[str, FileEntry], error: str | None) -> str | None:
        gathered = self.ranks.gather((files, error), self.ranks.writer)
        outcome: str | None = None
        if self.ranks.rank == 0:
            try:
                outcome = self._publish(job, gathered)
            except Exception as exc:
                outcome = f"rank 0 could not publish the marker: {type(exc).__name__}: {exc}"
        result: str | None = self.ranks.broadcast(outcome, self.ranks.writer)
        return result

    def _publish(self, job: SaveJob, gathered: list[Any]) -> str | None:
        errors = [err for _, err in gathered if err is not None]
        if errors:
            return "; ".join(dict.fromkeys(errors))  # DCP reports one failure on every rank
        merged: dict[str, FileEntry] = {}
        for files, _ in gathered:
            merged.update(files)
        missing = sorted(dcp_files(job.write_dir) - merged.keys())
        if missing:
            claimed = {rank: sorted(files) for rank, (files, _) in enumerate(gathered)}
            return f"files written by DCP but claimed by no rank: {missing} (claimed: {claimed})"
        marker = layout.new_marker(job.step, self.ranks.world_size, merged, job.timeline)
        lost = self.confirm_lease() if self.confirm_lease is not None else None
        if lost is not None:  # another job writes the root now: publish nothing
            return lost
        layout.write_marker(self.root.child(job.name), marker)
        return None

    def _after_commit(self, job: SaveJob) -> None:
        """Retention on root (rank 0) and on this rank's local tier; failures only log.

        Counts only the live timeline's history (this job's); checkpoints of abandoned
        timelines are neither counted nor deleted. Rank 0 always reaches the broadcast (a
        failure there means "delete nothing"), so the ranks' collectives stay in step.
        """
        keep_names: list[str] | None = None  # None: delete nothing
        if self.ranks.rank == 0:
            try:
                keep_names = self._retained(job)
            except Exception as exc:
                log.warning("checkpoint retention skipped (checkpoints are intact): %s", exc)
        try:
            keep_names = self.ranks.broadcast(keep_names, self.ranks.writer)
            if keep_names is not None:
                if self.ranks.rank == 0:
                    prune(self.root, set(keep_names), job.step)
                if self.tiered:
                    prune(self.write_base, set(keep_names), job.step)
            if self.private_tmp:
                job.write_dir.remove_tree()
        except Exception as exc:
            log.warning("checkpoint retention failed (checkpoints are intact): %s", exc)

    def _retained(self, job: SaveJob) -> list[str] | None:
        """Rank 0: the names retention keeps, or None when this job may not delete anything
        (it lost the root's lease)."""
        lost = self.confirm_lease() if self.confirm_lease is not None else None
        if lost is not None:
            return None
        every = layout.complete_newest_first(self.root, everywhere=True)
        timelines = layout.read_timelines(self.root)
        history = [i.name for i in every if layout.in_history(i, timelines)]
        abandoned = [i.name for i in every if i.name not in history]
        return [*history[: self.keep_last], job.name, *abandoned]


def prune(location: Location, keep: set[str], newest_step: int) -> None:
    """Delete checkpoints not kept that are older than the newest complete step.

    Directories of newer steps are left alone (never delete one being written); a complete
    checkpoint loses its marker before its files, so it is never seen half deleted as complete.
    """
    for step, name, _, _ in layout.scan(location):
        if name in keep or step > newest_step:
            continue
        location.child(name).remove(MARKER_NAME)
        location.child(name).remove_tree()


def describe(exc: BaseException, rank: int) -> str:
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


def dcp_files(write_dir: Location) -> set[str]:
    """Every file DCP's metadata refers to, plus the metadata and global.json themselves."""
    metadata = SafeFileSystemReader(write_dir.local_path()).read_metadata()
    storage = metadata.storage_data or {}
    paths = {info.relative_path for info in storage.values()}
    return paths | {layout.DCP_METADATA_NAME, GLOBAL_NAME}
