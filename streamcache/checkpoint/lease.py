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

A holder that finds its lease taken (after a pause longer than ``ttl_s``) fails its next
``save``. Object stores without conditional writes make the takeover a best effort: after
writing the lease a job reads it back and is refused if another job's write won.

Thread safety: ``acquire``/``problem``/``close`` from the training thread; the renewal
thread only writes the lease file.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from ..format.lease import LeaseHolder
from ..processes import process_token
from .errors import CheckpointError
from .tiers import Location

log = logging.getLogger("streamcache.checkpoint")

LEASE_NAME = "LEASE.json"
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
        self.root, self.ttl_s, self.job_id = root, ttl_s, job_id
        self.token = uuid.uuid4().hex
        self._renewals = 0
        self._lost: str | None = None
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
        while True:
            current = self._read()
            if current is None:
                if self.root.create_new(LEASE_NAME, self._body()):
                    break
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
        time.sleep(min(0.2, self.ttl_s / 10))  # let a concurrent writer's PUT land, then check
        current = self._read()
        if current is None or current.get(K_TOKEN) != self.token:
            raise self._refused(current or {}, "(it took the lease at the same moment)")
        self._thread = threading.Thread(target=self._renew_loop, name="streamcache-lease",
                                        daemon=True)
        self._thread.start()

    def problem(self) -> str | None:
        """Why this job no longer holds the lease, or None."""
        return self._lost

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

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                current = self._read()
                if current is not None and current.get(K_TOKEN) != self.token:
                    self._lost = (f"{_holder(current)} took over the lease of "
                                  f"{self.root.url} (this job did not renew it for {self.ttl_s} s)")
                    log.error("%s", self._lost)
                    return
                self._write()
            except Exception as exc:
                log.warning("could not renew the lease of %s: %s", self.root.url, exc)

    def _write(self) -> None:
        self.root.write_atomic(LEASE_NAME, self._body())

    def _body(self) -> bytes:
        """This job's lease, one renewal later than the last one written."""
        self._renewals += 1
        return json.dumps({K_TOKEN: self.token, K_JOB: self.job_id, K_HOST: socket.gethostname(),
                           K_PID: os.getpid(), K_PROCESS: process_token(),
                           K_RENEWALS: self._renewals, K_TTL: self.ttl_s,
                           "time": time.time()}).encode()

    def _read(self) -> dict[str, Any] | None:
        try:
            value = json.loads(self.root.read_bytes(LEASE_NAME))
        except FileNotFoundError:
            return None
        except ValueError:  # a torn or foreign file: nobody holds a valid lease
            return None
        return value if isinstance(value, dict) else None

    def _refused(self, current: dict[str, Any], how: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint root {self.root.url} is being written by another job: "
            f"{_holder(current)} holds its lease {how}. Two jobs saving into one root would "
            "delete each other's checkpoints; give this job its own root, or stop the other "
            "job (a job that died releases the lease within lease_ttl seconds)"
        )


def _renewed(before: dict[str, Any], now: dict[str, Any]) -> bool:
    return (now.get(K_TOKEN), now.get(K_RENEWALS)) != (before.get(K_TOKEN), before.get(K_RENEWALS))


def _holder(lease: dict[str, Any]) -> str:
    job = f" (job {lease[K_JOB]})" if lease.get(K_JOB) else ""
    return f"process {lease.get(K_PID)} on {lease.get(K_HOST)}{job}"
