"""The memory tier: each rank's newest snapshots in node-local shared memory (``/dev/shm``).

A snapshot outlives the process that took it (a file on tmpfs), not the node. Each rank keeps
two slot files and writes a snapshot into the older one, header last (memory_format.py), so a
kill at any moment leaves the newer slot whole. Writing costs one copy into the slot's
mapping, with non-temporal stores, before :meth:`MemoryTier.write` returns; the checksums,
the manifest and the header follow on a background thread (the training goes on meanwhile;
the slot is whole a few milliseconds later). Nothing is fsynced (tmpfs has no disk and a
process's writes survive its death). Restoring reads and verifies everything before anything
is applied.

Where (``MemoryOptions.directory``, ``/dev/shm`` by default)::

    streamcache-mem-<uid>/           0700, owned by this user (refused otherwise)
        <sha256(root)>-<sha256(job)>/  one folder per checkpoint root and job id: two jobs
                                     never collide, the restarts of one job find their
                                     snapshots (the job id is torchrun's run id by default)
            rank<r>-slot<0|1>        0600, this user's regular files, never followed links

Space: two slots per rank, each about the size of the rank's state (model, optimizer and the
small entries). A clean finish (``Checkpointer.close()`` without an exception) removes this
rank's slots; a job that is killed for good leaves them until the next job on the same root
deletes them (at its first snapshot), or the node reboots. A slot that does not fit the free
space is not written (a warning; the previous slot stays whole) and training goes on with the
disk tiers.

The slot files' format is memory_format.py's; opening them safely and the checksummed reads
and writes of their bytes, memory_files.py's; finishing a snapshot, memory_write.py's; a
restore's checks, memory_restore.py's.

Thread safety: one training thread per MemoryTier (and the tier's own finishing thread, which
every method waits for).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import NativeError
from .errors import CheckpointError
from .guards import Hold
from .memory_files import (
    ReadHandle,
    SlotMap,
    copy_tensor,
    digest,
    file_problem,
    folder_name,
    open_for_write,
    private_dir,
    read_manifest,
    read_tensors,
    remove_sibling_folders,
)
from .memory_format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    K_COMMITTED,
    K_ENTRIES,
    K_KIND,
    K_RANK,
    K_RNG,
    K_ROOT,
    K_ROOT_ID,
    K_STARTED,
    K_STEP,
    K_TENSORS,
    K_TIMELINE,
    K_TREE,
    K_VERSION,
    K_WORLD,
    EmptySlot,
    FormatProblem,
    Manifest,
    SlotSummary,
    align,
    decode_tree,
    encode_tree,
    tensor_record,
    unpack_header,
)
from .memory_write import DeferredCopy, PendingSnapshot
from .staging import rank_cores

log = logging.getLogger("streamcache.checkpoint")

SLOTS = 2


@dataclass(frozen=True)
class MemoryOptions:
    """Options of the memory tier.

    Args:
        directory: a node-local tmpfs (``/dev/shm``); the tier's files live in a folder of
            this user's under it.
        max_bytes: the largest slot this rank may write (None: as much as the free space
            allows); a larger state is not snapshotted (a warning).
        background_copy: (opt-in) copy the model and optimizer entries' tensors on the tier's
            thread after ``snapshot`` returns; only ``optimizer.step()`` (and the forward of
            models with buffers) waits for the copy (guards.py). Any other in-place write of
            those tensors meanwhile moves their version counters and the snapshot is given
            up (a warning), except writes that bypass them (``.data``): call
            ``Checkpointer.wait_staged()`` before such a write. Off, every tensor is copied
            before ``snapshot`` returns.
    """

    directory: str = "/dev/shm"
    max_bytes: int | None = None
    background_copy: bool = False


@dataclass
class Prepared:
    """A verified snapshot, ready to apply (its tensors are private copies)."""

    step: int
    manifest: Manifest
    trees: dict[str, Any]


class MemoryTier:
    """This rank's two snapshot slots for one checkpoint root.

    Raises (constructor):
        CheckpointError: the tier's folder exists but is not this user's private folder (a
            link, another owner, or open to others), or cannot be made.
    """

    def __init__(self, options: MemoryOptions, root_url: str, rank: int, world_size: int,
                 job_id: str | None = None) -> None:
        self.options, self.root_url = options, root_url
        self.rank, self.world_size = rank, world_size
        self.folder = os.path.join(options.directory, f"streamcache-mem-{os.geteuid()}",
                                   folder_name(root_url, job_id))
        self._dir_fd = private_dir(self.folder)
        self._seqs: list[int | None] = [None] * SLOTS  # the valid slots' sequence numbers
        self._maps = [SlotMap() for _ in range(SLOTS)]
        self._finishing: Future[None] | None = None  # the snapshot being finished
        self._copy: DeferredCopy | None = None  # its background copy, checked by ``wait``
        self._finisher: tuple[int, ThreadPoolExecutor] | None = None  # (pid, its thread)
        self._kept = True  # whether the last finished snapshot was kept
        self._warned: set[str] = set()  # the kinds of skip already warned of
        for slot in range(SLOTS):
            self._seqs[slot] = self._header_seq(slot)

    def slot_name(self, slot: int) -> str:
        return f"rank{self.rank}-slot{slot}"

    # ------------------------------------------------------------------ writing

    def write(self, step: int, entries: Mapping[str, tuple[str, Any]], rng_state: dict[str, Any],
              *, timeline: str, started: str | None, committed: str | None,
              root_id: str, later: Collection[str] = (), hold: Hold | None = None) -> bool:
        """Snapshot ``entries`` ({key: (kind, value)}) as ``step`` into the older slot.

        ``started``/``committed`` are the last save started and the last known committed,
        ``root_id`` the root's id (layout.ensure_root_id): what a restore checks that the
        snapshot continues (memory_format.usable).

        The tensors are copied into the slot before this returns (the training may change
        them from then on), except those of the entries in ``later``: the tier's thread
        copies them, then releases ``hold`` (the caller's hold on their updates, guards.py;
        released whatever happens). That thread then writes the checksums, the manifest and
        the header (memory_write.py); until then the slot is not whole, and a kill restores
        the snapshot before. :meth:`wait` waits for it, and says whether it was kept; every
        other method waits for it too.

        Returns False (after a warning) when the snapshot is not taken: the state is larger
        than ``max_bytes``, the tier's filesystem is full, or another process truncated the
        slot file during the copy; the newer slot is then untouched.

        Raises:
            CheckpointError: a value cannot be kept in the memory tier (names it).
        """
        handed = False  # whether the thread took over ``hold``
        try:
            self.wait()
            handed = self._write(step, entries, rng_state, later, hold, {
                K_TIMELINE: timeline, K_STARTED: started, K_COMMITTED: committed,
                K_ROOT_ID: root_id})
            return handed
        finally:
            if not handed and hold is not None:
                hold.release()

    def _write(self, step: int, entries: Mapping[str, tuple[str, Any]],
               rng_state: dict[str, Any], later: Collection[str], hold: Hold | None,
               continues: dict[str, Any]) -> bool:
        tensors: list[torch.Tensor] = []
        deferred: dict[int, str] = {}  # the tensors the thread copies: index -> entry key
        try:
            encoded = {}
            for key, (kind, value) in entries.items():
                first = len(tensors)
                encoded[key] = {K_KIND: kind, K_TREE: encode_tree(value, tensors)}
                if key in later:
                    deferred.update((i, key) for i in range(first, len(tensors)))
            records, data_len = [], 0
            for tensor in tensors:
                records.append(tensor_record(tensor, data_len))
                data_len = align(data_len + records[-1]["nbytes"])
        except TypeError as exc:
            raise CheckpointError(f"snapshot of step {step}: {exc}") from exc
        cap = self.options.max_bytes
        if cap is not None and HEADER_SIZE + data_len > cap:
            return self._skip(step, f"its {data_len} bytes of tensors exceed max_bytes={cap}")
        slot = self._target_slot()
        seq = max((s for s in self._seqs if s is not None), default=0) + 1
        self._seqs[slot] = None
        try:
            fd = open_for_write(self._dir_fd, self.slot_name(slot))
        except OSError as exc:
            return self._skip(step, f"cannot open {self.slot_name(slot)}: {exc}")
        try:
            os.pwrite(fd, bytes(HEADER_SIZE), 0)  # the slot is not whole from here on
            if os.fstat(fd).st_size < HEADER_SIZE + data_len:
                os.posix_fallocate(fd, 0, HEADER_SIZE + data_len)  # ENOSPC here, not a fault
            data = self._maps[slot].array(fd, HEADER_SIZE + data_len)[HEADER_SIZE:]
            threads = rank_cores()
            for index, (tensor, record) in enumerate(zip(tensors, records, strict=True)):
                if index not in deferred:
                    at = record["offset"]
                    copy_tensor(data[at: at + record["nbytes"]], tensor, threads)
        except (OSError, NativeError) as exc:
            os.close(fd)
            return self._failed(step, slot, exc)
        except BaseException:
            os.close(fd)
            raise
        doc = {K_VERSION: FORMAT_VERSION, K_ROOT: self.root_url, K_RANK: self.rank,
               K_WORLD: self.world_size, K_STEP: step, **continues,
               K_ENTRIES: encoded, K_TENSORS: records, K_RNG: rng_state}
        later_copy = DeferredCopy([(tensors[i], records[i], key)
                                   for i, key in deferred.items()], hold)
        try:
            self._finishing = self._finishing_thread().submit(
                self._finish, PendingSnapshot(slot, fd, seq, data, doc, later_copy))
        except BaseException:
            os.close(fd)
            later_copy.release()
            raise
        self._copy = later_copy
        if hold is not None:
            hold.then_verify(later_copy.check.verify)
        return True

    def _finishing_thread(self) -> ThreadPoolExecutor:
        """The thread that finishes snapshots, kept between them (starting one per snapshot
        made the call wait for it to start: about 1 ms, more on busy cores); a forked child
        makes its own (the parent's thread is not in it)."""
        if self._finisher is None or self._finisher[0] != os.getpid():
            self._finisher = (os.getpid(), ThreadPoolExecutor(
                1, thread_name_prefix="streamcache-snapshot"))
        return self._finisher[1]

    def wait(self) -> bool:
        """Wait until the snapshot being finished (if any) is whole or was given up; False
        when it was given up (a warning said why)."""
        finish, self._finishing = self._finishing, None
        # (in a child forked while the parent's thread finished one, that snapshot is the
        # parent's: the child has no thread to wait for)
        later_copy, self._copy = self._copy, None
        if finish is not None and self._finisher is not None and \
                self._finisher[0] == os.getpid():
            if later_copy is not None:
                later_copy.check.verify()  # (the training thread: see guards.VersionCheck)
            finish.result()  # (_finish reports its own errors; it never raises)
        kept, self._kept = self._kept, True
        return kept

    def _finish(self, pending: PendingSnapshot) -> None:
        step = pending.step
        try:
            why = pending.finish(self.options.max_bytes)
            if why is None:
                self._seqs[pending.slot] = pending.seq
            else:
                self._kept = self._skip(step, why, "torn" if pending.torn else "space")
        except (OSError, NativeError) as exc:
            try:
                self._kept = self._failed(step, pending.slot, exc)
            except CheckpointError as error:  # not a full disk: say so, the other slot stays
                log.error("%s (the previous snapshot and the disk tiers are intact)", str(error))
                self._kept = False
        except BaseException as exc:  # never silent: a thread's error has no caller
            log.error("memory tier: snapshot of step %d failed: %r", step, exc)
            self._kept = False
        finally:
            pending.close()

    def _failed(self, step: int, slot: int, exc: BaseException) -> bool:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            return self._skip(step, f"{self.options.directory} is full ({exc.strerror})")
        if isinstance(exc, NativeError):  # its file was truncated under the copy
            return self._skip(step, f"{self.slot_name(slot)}: {exc}")
        raise CheckpointError(f"memory tier: writing {self.slot_name(slot)} failed: {exc}"
                              ) from exc

    def _target_slot(self) -> int:
        """The slot to overwrite: an invalid one, else the one with the older snapshot."""
        for slot, seq in enumerate(self._seqs):
            if seq is None:
                return slot
        return min(range(SLOTS), key=lambda s: self._seqs[s] or 0)

    def _skip(self, step: int, why: str, kind: str = "space") -> bool:
        """Log why a snapshot was not kept: a warning the first time for each ``kind``
        (a full disk, a torn background copy, ...), then at debug level."""
        log_fn = log.debug if kind in self._warned else log.warning
        log_fn("memory tier: snapshot of step %d not kept: %s (the previous snapshot and the "
               "disk tiers are intact; later ones for this reason are logged at debug level)",
               step, why)
        self._warned.add(kind)
        return False

    # ------------------------------------------------------------------ reading

    def scan(self) -> list[tuple[int, SlotSummary]]:
        """(slot, summary) of each whole, valid slot of this rank; problems are logged."""
        self.wait()
        found = []
        for slot in range(SLOTS):
            try:
                with self._open_for_read(slot) as (fd, size):
                    header, manifest = read_manifest(fd, size)
            except FileNotFoundError:
                continue
            except EmptySlot:
                continue  # invalidated, or a snapshot that never finished: nothing to say
            except (OSError, FormatProblem) as exc:
                log.warning("memory tier: ignoring %s: %s", self.slot_name(slot), exc)
                continue
            if manifest.root != self.root_url:
                log.warning("memory tier: ignoring %s: it belongs to root %r",
                            self.slot_name(slot), manifest.root)
                continue
            found.append((slot, SlotSummary(header.step, header.seq, manifest.rank,
                                            manifest.world_size, manifest.started,
                                            manifest.committed, manifest.root_id)))
        return found

    def prepare(self, slot: int, summary: SlotSummary,
                max_tensor_bytes: int | None = None) -> Prepared | None:
        """Read and verify ``slot`` (which :meth:`scan` reported as ``summary``).

        ``max_tensor_bytes`` bounds what is allocated for its tensors (a restore passes the
        bytes of the state it restores into: a slot claiming more cannot match it).

        Returns None (logged) when it changed since the scan, a digest does not match, or
        its tensors or trees are not what a snapshot writes.
        """
        try:
            with self._open_for_read(slot) as (fd, size):
                header, manifest = read_manifest(fd, size)
                if header.seq != summary.seq:
                    raise FormatProblem("it was rewritten since it was scanned")
                claimed = sum(spec.nbytes for spec in manifest.tensors)
                if max_tensor_bytes is not None and claimed > max_tensor_bytes:
                    raise FormatProblem(f"its tensors claim {claimed} bytes, more than the "
                                        f"{max_tensor_bytes} of the state to restore")
                tensors = read_tensors(fd, manifest)
            trees = {k: (kind, decode_tree(tree, tensors))
                     for k, (kind, tree) in manifest.entries.items()}
        except (OSError, FormatProblem, RuntimeError, TypeError, ValueError,
                OverflowError, MemoryError) as exc:  # whatever torch says of a hostile shape
            log.warning("memory tier: not restoring %s: %s", self.slot_name(slot), exc)
            return None
        return Prepared(header.step, manifest, trees)

    def _open_for_read(self, slot: int) -> ReadHandle:
        return ReadHandle(self._dir_fd, self.slot_name(slot))

    def _header_seq(self, slot: int) -> int | None:
        try:
            with self._open_for_read(slot) as (fd, size):
                return unpack_header(os.pread(fd, HEADER_SIZE, 0), size, digest).seq
        except (OSError, FormatProblem):
            return None

    # ------------------------------------------------------------------ housekeeping

    def discard_after(self, step: int) -> None:
        """Invalidate this rank's slots newer than ``step`` (a restore rolls back to it)."""
        for slot, summary in self.scan():
            if summary.step > step:
                self._invalidate(slot)

    def clear(self) -> None:
        """Invalidate both slots (the snapshots no longer continue the root's state)."""
        for slot in range(SLOTS):
            self._invalidate(slot)

    def _invalidate(self, slot: int) -> None:
        self.wait()
        self._seqs[slot] = None
        try:
            fd = os.open(self.slot_name(slot), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=self._dir_fd)
        except OSError:
            return
        try:
            if file_problem(os.fstat(fd)) is None:
                os.pwrite(fd, bytes(HEADER_SIZE), 0)
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Delete this rank's slots (a clean finish), and the root's folder once empty."""
        self.wait()
        for slot in range(SLOTS):
            try:
                os.unlink(self.slot_name(slot), dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("memory tier: could not remove %s: %s", self.slot_name(slot), exc)
        self._seqs = [None] * SLOTS
        with contextlib.suppress(OSError):  # other ranks' slots may still be there
            os.rmdir(self.folder)

    def remove_other_jobs(self) -> None:
        """Delete the folders of earlier jobs on this root (this job holds the root's lease,
        so they are not running): what a killed job left is reclaimed by the next one."""
        remove_sibling_folders(self.folder)

    def close(self) -> None:
        """Finish the snapshot in flight, then release the slots' mappings and the folder."""
        self.wait()
        finisher, self._finisher = self._finisher, None
        if finisher is not None and finisher[0] == os.getpid():
            finisher[1].shutdown()
        for slot_map in self._maps:
            slot_map.close()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
