"""The Checkpointer's modes (how a save is written, what a save does while the previous one
is written) and the timings of a save."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


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
