"""How background checkpoint work shares the CPU with the training loop.

The writer runs at the training's priority (a niced writer starved whenever anything else
kept the cores busy: 2.5x the synchronous save's time to durable under load). What it must
not do is take the training thread's core while the loop runs. Its I/O costs almost no CPU
(direct I/O); its CPU work is hashing, which :class:`Pace` bounds: after each part it asks
whether the training thread was busy (its CPU clock advanced for at least half of the time
since the last look) and if so sleeps long enough that the background work keeps at most
``share`` of a core. While the loop waits (in ``wait()``, on I/O, between steps) or is not
running, nothing is slowed down. The sleeps fall inside the disk time of the parts already
submitted, so on a disk slower than the bounded hashing they cost no time to durable.

Thread safety: ``after`` may be called from several background threads.
"""

from __future__ import annotations

import threading
import time

BUSY = 0.5  # the training thread is busy when its CPU clock advanced this share of the time


class Pace:
    """Bounds background CPU use to ``share`` of a core while the training thread is busy.

    Args:
        share: the bound, in (0, 1]; 1 disables the bound.
    """

    def __init__(self, share: float) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share={share}: give a fraction in (0, 1]")
        self.share = share
        self._clock: int | None = None
        self._ident: int | None = None
        self._lock = threading.Lock()
        self._seen = (0.0, 0.0)  # (wall time, training thread CPU time) at the last look
        self._busy = False
        self.slept_s = 0.0  # total time given back to the loop (for tests and stats)

    def watch(self, thread_ident: int | None = None) -> None:
        """Take the calling thread (or ``thread_ident``) as the training thread."""
        ident = threading.get_ident() if thread_ident is None else thread_ident
        try:
            clock = time.pthread_getcpuclockid(ident)
            self._seen = (time.monotonic(), time.clock_gettime(clock))
        except (AttributeError, OSError):  # no per-thread CPU clocks here: never slow down
            clock = None
        with self._lock:
            self._clock, self._ident = clock, ident

    def busy(self) -> bool:
        """Whether the training thread kept a core busy since the last look."""
        with self._lock:
            if self._clock is None or self.share >= 1:
                return False
            now = time.monotonic()
            try:
                cpu = time.clock_gettime(self._clock)
            except OSError:  # the thread is gone
                self._clock = None
                return False
            wall_s, cpu_s = now - self._seen[0], cpu - self._seen[1]
            if wall_s >= 0.002:  # a shorter look says nothing: keep the last verdict
                self._busy = cpu_s >= BUSY * wall_s
                self._seen = (now, cpu)
            return self._busy

    def after(self, cpu_s: float) -> None:
        """Called by a background thread after it used ``cpu_s`` of CPU time (the training
        thread itself never waits for itself)."""
        if cpu_s > 0 and threading.get_ident() != self._ident and self.busy():
            pause = cpu_s * (1 - self.share) / self.share
            self.slept_s += pause
            time.sleep(pause)
