"""One memory-tier snapshot after its call returned: what the tier's finishing thread does.

The call (``MemoryTier.write``) zeroes the slot's header and copies the tensors into the
slot's mapping, except those copied in the background (``Checkpointer(memory=
MemoryOptions(background_copy=True))``: the model and optimizer entries' tensors, whose
updates the guards hold back meanwhile, guards.py). The thread then copies those, releases the
guards, checksums every tensor, writes the manifest and, once the training thread found the
copied tensors unchanged (:class:`DeferredCopy`), the header: the slot is whole only from that
write on (memory_format.py).

Thread safety: a :class:`PendingSnapshot` is built in the training thread and finished in the
tier's thread; nothing else touches it in between.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import torch

from .guards import Hold
from .memory_files import copy_tensor, digest, piece_digests, pwrite_all
from .memory_format import HEADER_SIZE, K_STEP, K_TENSORS, Header, pack_header
from .staging import rank_cores


class DeferredCopy:
    """The tensors a snapshot's thread copies, their version counters as the snapshot call saw
    them, and the hold on their updates (released once they are copied).

    Whether the copy is true is decided in the training thread (:meth:`verify`, after the
    copy, at its next guarded operation or wait): there, every in-place write that thread
    started before the copy ended has finished and moved its tensors' counters; checked on
    the copying thread, a write still running at the copy's end would be missed.
    """

    def __init__(self, items: list[tuple[torch.Tensor, dict[str, Any], str]],
                 hold: Hold | None) -> None:
        self.items = items  # (tensor, its record in the manifest, its entry's key)
        self.versions = [tensor._version for tensor, _, _ in items]
        self._hold = hold
        self._done = threading.Event()  # copied, failed, or never to run
        self._verdict = threading.Event()
        self._changed: list[str] = []
        if not items:
            self._done.set()
            self._verdict.set()

    def run(self, data: Any) -> None:
        """Copy into the slot's data (the tier's thread).

        Raises:
            NativeError: the slot's file was cut short during the copy (another process).
        """
        try:
            threads = rank_cores()
            for tensor, record, _ in self.items:
                at = record["offset"]
                copy_tensor(data[at: at + record["nbytes"]], tensor, threads)
        finally:
            self.release()

    def release(self) -> None:
        """The live tensors are no longer read (any thread, idempotent)."""
        self._done.set()
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()

    def verify(self) -> None:
        """Training thread, after :meth:`release`: compare the version counters (once)."""
        if self._verdict.is_set():
            return
        self._done.wait()
        self._changed = sorted({key for (tensor, _, key), version in zip(
            self.items, self.versions, strict=True) if tensor._version != version})
        self.items = []
        self._verdict.set()

    def changed(self) -> list[str]:
        """The tier's thread: the entries whose tensors were written to during the copy
        (none: the copy is true); waits for :meth:`verify`."""
        self._verdict.wait()
        return self._changed


class PendingSnapshot:
    """A snapshot whose call returned: its slot's fd and mapped data, and its manifest so far."""

    def __init__(self, slot: int, fd: int, seq: int, data: Any, doc: dict[str, Any],
                 later: DeferredCopy) -> None:
        self.slot, self.fd, self.seq, self.data, self.doc = slot, fd, seq, data, doc
        self.later = later

    @property
    def step(self) -> int:
        return int(self.doc[K_STEP])

    def finish(self, max_bytes: int | None) -> str | None:
        """Copy what is left, checksum, write the manifest and then the header; None when the
        slot is whole, else why the snapshot was given up (the slot's header stays zero).

        Raises:
            OSError, NativeError: writing failed, or the file was cut short under a read.
        """
        self.later.run(self.data)
        for record in self.doc[K_TENSORS]:
            at = record["offset"]
            record["digests"] = piece_digests(self.data[at: at + record["nbytes"]])
        manifest = json.dumps(self.doc, separators=(",", ":")).encode()
        m_off = HEADER_SIZE + len(self.data)
        needed = m_off + len(manifest)
        if max_bytes is not None and needed > max_bytes:
            return f"a slot of {needed} bytes exceeds max_bytes={max_bytes}"
        if os.fstat(self.fd).st_size < needed:
            os.posix_fallocate(self.fd, 0, needed)
        pwrite_all(self.fd, manifest, m_off)
        changed = self.later.changed()  # (the training thread decides: at once, or a step on)
        if changed:
            return ("tensors of " + ", ".join(repr(key) for key in changed) + " changed "
                    "while they were copied in the background (an in-place write other than "
                    "optimizer.step() or the model's forward: call Checkpointer.wait_staged() "
                    "before such a write, or snapshot without background_copy)")
        header = Header(self.seq, self.step, len(self.data), m_off, len(manifest),
                        digest(manifest))
        pwrite_all(self.fd, pack_header(header, digest), 0)
        return None

    def close(self) -> None:
        """Release the hold (if the copy never ran) and the fd."""
        self.later.release()
        os.close(self.fd)
