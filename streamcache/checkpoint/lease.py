"""The lease: one job writes a checkpoint root at a time.

Two jobs saving into one root would each delete the other's checkpoints (retention) and mix
their timelines. The job's rank 0 holds ``root/LEASE.json`` from its first write (a save,
or a rollback) until ``close``, and renews it every ``ttl_s / 3`` from a thread of its own.
Another job that finds the lease held:

- takes it at once when the holder is provably gone: the same host and the holder's
  process no longer exists (a job restarted on its node after SIGKILL), or the same
  ``job_id`` (a restart of the same job, e.g. torchrun's run id);
- otherwise watches it: a renewal means a live holder and the second job is refused with
  :class:`CheckpointError`; no renewal for ``ttl_s`` (by this job's own clock, so clock skew
  between hosts does not matter) means the holder died, and the lease is taken over.

A holder keeps its lease only while the file holds its token. When the renewal finds the
file missing (another job took the root over and released it), holding another job's token,
or no longer a lease at all, the lease is *lost* for good: the next ``save`` and any commit
not yet published fail (:meth:`Lease.confirm` runs right before a marker is published), and
only a new Checkpointer (a restart) may take the root again. A holder that did not renew for
longer than ``ttl_s`` (paused, stalled) reads the file twice, a moment apart, before writing
it again, so that a job taking the lease over at that moment wins and this one loses.
Object stores without conditional writes make the takeover a best effort: after writing the
lease a job reads it back and is refused if another job's write won.

The lease file is untrusted: it is read capped, never through a symlink, and strictly (a
file that is not a lease, e.g. garbage, a JSON list, wrong types, a directory, is a clear
:class:`CheckpointError` telling to delete it if no job writes the root, never a wait).

Thread safety: ``acquire``/``close`` from the training thread; ``confirm`` from the writer
thread; the renewal thread renews. Reads and writes of the file are serialized by a lock.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Any

from ..format.lease import LeaseHolder
from ..processes import process_token
from .errors import CheckpointError
from .tiers import Location, UnreadableFileError

log = logging.getLogger("streamcache.checkpoint")

LEASE_NAME = "LEASE.json"
LEASE_LIMIT = 64 << 10  # bytes: a lease is a few hundred
MAX_TTL_S = 7 * 24 * 3600.0  # a holder's ttl beyond this is not a lease this code wrote
_INVALID_READS = 3  # a file that is no lease is read this many times before it is refused
K_TOKEN, K_JOB, K_HOST, K_PID, K_PROCESS, K_RENEWALS, K_TTL = (
    "token", "job_id", "host", "pid", "process", "renewals", "ttl_s")


class Lease:
    """This job's lease on ``root`` (used by rank 0 only).

    Args:
        root: the checkpoint root.
        ttl_s: how long a lease lives without renewal.
        job_id: an id shared by the restarts of one job; a restart may take the lease of
            an earlier attempt at once.
    """

    def __init__(self, root: Location, ttl_s: float, job_id: str | None) -> None:
        if ttl_s <= 0:
            raise CheckpointError(f"lease_ttl={ttl_s}: give a positive number of seconds")
        if not math.isfinite(ttl_s) or ttl_s > MAX_TTL_S:
            raise CheckpointError(f"lease_ttl={ttl_s}: give at most {MAX_TTL_S:.0f} seconds")
        self.root, self.ttl_s, self.job_id = root, ttl_s, job_id
        self.token = uuid.uuid4().hex
        self._renewals = 0
        self._lost: str | None = None
        self._renewed_at = 0.0  # monotonic time of this job's last write of the lease
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._thread is not None

    def acquire(self) -> None:
        """Take the lease, waiting up to about ``ttl_s`` for a dead holder's to lapse.

        Raises:
            CheckpointError: another live job holds it.
        """
        watched: dict[str, Any] | None = None
        watched_since = time.monotonic()
        vanished = 0
        created = False
        while True:
            current = self._read()
            if current is None:
                if self.root.create_new(LEASE_NAME, self._body()):
                    self._renewed_at = time.monotonic()
                    created = True
                    break
                vanished += 1  # created by another job first, or a store that lists it
                if vanished > 50:  # but cannot read it: do not spin
                    raise CheckpointError(
                        f"{self.root.join(LEASE_NAME)} exists but cannot be read back; check "
                        "the storage (or delete the file if no job writes this root)")
                time.sleep(self._settle_s)
                continue  # another job created it first: look at it
            if self._may_take(current):
                self._write()
                break
            if current.get(K_HOST) == socket.gethostname() and current.get(K_PID) == os.getpid():
                raise self._refused(current, "by another Checkpointer of this process")
            if watched is not None and _renewed(watched, current):
                raise self._refused(current, "and renews it")
            if watched is None:
                watched, watched_since = current, time.monotonic()
                log.warning("checkpoint root %s is leased by %s; waiting up to %.0f s for it to "
                            "lapse (a job that died) or be renewed (a live job)", self.root.url,
                            _holder(current), float(current.get(K_TTL, self.ttl_s)))
            elif time.monotonic() - watched_since > float(current.get(K_TTL, self.ttl_s)):
                log.warning("taking over the lease of %s, not renewed for %.0f s",
                            _holder(current), time.monotonic() - watched_since)
                self._write()
                break
            time.sleep(min(1.0, self.ttl_s / 6))
        if not (created and self.root.is_local):  # O_EXCL there: nobody else can have won
            time.sleep(self._settle_s)  # let a concurrent writer's PUT land, then check
            current = self._read()
            if current is None or current.get(K_TOKEN) != self.token:
                raise self._refused(current or {}, "(it took the lease at the same moment)")
        self._thread = threading.Thread(target=self._renew_loop, name="streamcache-lease",
                                        daemon=True)
        self._thread.start()

    def problem(self) -> str | None:
        """Why this job no longer holds the lease, or None (as last seen; see ``confirm``)."""
        return self._lost

    def confirm(self) -> str | None:
        """Read the lease file now (renewing it when a renewal is due): why this job no
        longer holds the lease, or None. Called right before anything is published under
        the lease."""
        if self._thread is None and self._lost is None:
            return f"this job holds no lease on {self.root.url}"
        return self._renew(write=time.monotonic() - self._renewed_at > self.ttl_s / 3)

    def close(self) -> None:
        """Stop renewing and give the lease back (if it is still ours)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=30)
        self._thread = None
        try:
            current = self._read()
            if current is not None and current.get(K_TOKEN) == self.token:
                self.root.remove(LEASE_NAME)
        except Exception as exc:  # the lease lapses by itself
            log.warning("could not release the lease of %s: %s", self.root.url, exc)

    # ------------------------------------------------------------------ internals

    def _may_take(self, current: dict[str, Any]) -> bool:
        if current.get(K_TOKEN) == self.token:
            return True
        if self.job_id is not None and current.get(K_JOB) == self.job_id:
            return True
        pid, process = current.get(K_PID), current.get(K_PROCESS)
        holder = LeaseHolder(str(current.get(K_TOKEN)), str(current.get(K_HOST)),
                             pid if isinstance(pid, int) else 0, 0.0,
                             process if isinstance(process, str) else "")
        return holder.is_dead_here()  # the same liveness test as the shard writer's lease

    @property
    def _settle_s(self) -> float:
        return min(0.2, self.ttl_s / 10)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            if self._renew() is not None:
                return

    def _renew(self, write: bool = True) -> str | None:
        """Renew the lease (``write``) if the file still holds this job's token; else mark
        it lost."""
        with self._lock:
            if self._lost is not None:
                return self._lost
            try:
                current = self._read()
                if current is not None and current.get(K_TOKEN) == self.token and \
                        time.monotonic() - self._renewed_at > self.ttl_s:
                    # not renewed for a ttl (paused?): a job may be taking it over right now
                    time.sleep(self._settle_s)
                    current = self._read()
            except CheckpointError as exc:
                return self._lose(str(exc))
            except Exception as exc:  # transient: the next renewal tries again
                log.warning("could not renew the lease of %s: %s", self.root.url, exc)
                return None
            if current is None:
                return self._lose(f"the lease file {self.root.join(LEASE_NAME)} disappeared "
                                  "(another job took the root over and released it)")
            if current.get(K_TOKEN) != self.token:
                return self._lose(f"{_holder(current)} took over the lease of {self.root.url}")
            if write:
                try:
                    self._write()
                except Exception as exc:
                    log.warning("could not renew the lease of %s: %s", self.root.url, exc)
            return None

    def _lose(self, why: str) -> str:
        self._lost = (f"this job lost its lease on {self.root.url}: {why}; its saves fail "
                      "from now on (nothing more is published by it). Restart the job (a new "
                      "Checkpointer) if it should write this root again")
        log.error("%s", self._lost)
        return self._lost

    def _write(self) -> None:
        self.root.write_atomic(LEASE_NAME, self._body())
        self._renewed_at = time.monotonic()

    def _body(self) -> bytes:
        """This job's lease, one renewal later than the last one written."""
        self._renewals += 1
        return json.dumps({K_TOKEN: self.token, K_JOB: self.job_id, K_HOST: socket.gethostname(),
                           K_PID: os.getpid(), K_PROCESS: process_token(),
                           K_RENEWALS: self._renewals, K_TTL: self.ttl_s,
                           "time": time.time()}).encode()

    def _read(self) -> dict[str, Any] | None:
        """The lease on the root, or None when there is none.

        Raises:
            CheckpointError: the file is not a lease (garbage, wrong types, a symlink, a
                directory, too large). A lease is published atomically, so this is never a
                torn write: something else wrote it, and taking it over could break a job.
        """
        path = self.root.join(LEASE_NAME)
        for attempt in range(_INVALID_READS):
            try:
                return parse_lease(self.root.read_bytes(LEASE_NAME, LEASE_LIMIT))
            except FileNotFoundError:
                return None
            except (UnreadableFileError, ValueError, RecursionError) as exc:
                if attempt + 1 == _INVALID_READS:
                    raise CheckpointError(
                        f"{path} is not a checkpoint lease ({exc}); it marks which job "
                        f"writes {self.root.url}. If no job is writing this root, delete it "
                        "and save again"
                    ) from exc
                time.sleep(self._settle_s)  # a tool that writes it in place, caught midway
        raise AssertionError("unreachable")

    def _refused(self, current: dict[str, Any], how: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint root {self.root.url} is being written by another job: "
            f"{_holder(current)} holds its lease {how}. Two jobs saving into one root would "
            "delete each other's checkpoints; give this job its own root, or stop the other "
            "job (a job that died releases the lease within lease_ttl seconds)"
        )


_FIELDS: dict[str, tuple[type, ...]] = {
    K_TOKEN: (str,), K_JOB: (str, type(None)), K_HOST: (str,), K_PID: (int,),
    K_PROCESS: (str,), K_RENEWALS: (int,), K_TTL: (int, float), "time": (int, float),
}


def parse_lease(data: bytes) -> dict[str, Any]:
    """A lease file's content, checked field by field (ValueError naming what is wrong).

    ``process`` and ``time`` may be absent (leases of earlier versions); every other field
    must be there with its type, ``ttl_s`` positive and at most :data:`MAX_TTL_S`.
    """
    lease = json.loads(data)
    if not isinstance(lease, dict):
        raise ValueError(f"a JSON {type(lease).__name__}, not an object")
    for key, types in _FIELDS.items():
        if key not in lease:
            if key in (K_PROCESS, "time"):
                continue
            raise ValueError(f"no {key!r}")
        value = lease[key]
        if not isinstance(value, types) or isinstance(value, bool):
            raise ValueError(f"{key!r} is {value!r}")
    ttl = float(lease[K_TTL])
    if not (0 < ttl <= MAX_TTL_S):
        raise ValueError(f"ttl_s {ttl!r} is not in (0, {MAX_TTL_S:.0f}]")
    return lease


def _renewed(before: dict[str, Any], now: dict[str, Any]) -> bool:
    return (now.get(K_TOKEN), now.get(K_RENEWALS)) != (before.get(K_TOKEN), before.get(K_RENEWALS))


def _holder(lease: dict[str, Any]) -> str:
    job = f" (job {lease[K_JOB]})" if lease.get(K_JOB) else ""
    return f"process {lease.get(K_PID)} on {lease.get(K_HOST)}{job}"
