"""One memory-tier snapshot after its call returned: what the tier's finishing thread does.

The call (``MemoryTier.write``) zeroes the slot's header and copies the tensors into the
slot's mapping, except those copied in the background (``Checkpointer(memory=
MemoryOptions(background_copy=True))``: the model and optimizer entries' tensors, whose
updates the guards hold back meanwhile, guards.py). The thread then copies those, releases the
guards, checksums every tensor, writes the manifest and, once the training thread found the
copied tensors unchanged (guards.VersionCheck), the header: the slot is whole only from that
write on (memory_format.py).

Thread safety: a :class:`PendingSnapshot` is built in the training thread and finished in the
tier's thread; nothing else touches it in between.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .guards import Hold, VersionCheck
from .memory_files import copy_tensor, digest, piece_digests, pwrite_all
from .memory_format import HEADER_SIZE, K_STEP, K_TENSORS, Header, pack_header
from .staging import rank_cores


class DeferredCopy:
    """The tensors a snapshot's thread copies, the check that they were not written to
    meanwhile (guards.VersionCheck), and the hold on their updates, released once they are
    copied."""

    def __init__(self, items: list[tuple[torch.Tensor, dict[str, Any], str]],
                 hold: Hold | None) -> None:
        self.items = items  # (tensor, its record in the manifest, its entry's key)
        self.check = VersionCheck((tensor, key) for tensor, _, key in items)
        self._hold = hold

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
        self.items = []
        self.check.copied()
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()


class PendingSnapshot:
    """A snapshot whose call returned: its slot's fd and mapped data, and its manifest so far."""

    def __init__(self, slot: int, fd: int, seq: int, data: Any, doc: dict[str, Any],
                 later: DeferredCopy) -> None:
        self.slot, self.fd, self.seq, self.data, self.doc = slot, fd, seq, data, doc
        self.later = later
        self.torn = False  # given up because the copied tensors were written to meanwhile

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
        changed = self.later.check.changed()  # (the training thread decides: at once, or a step on)
        if changed:
            self.torn = True
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
