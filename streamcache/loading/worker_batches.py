"""A pass's steps made by worker processes (torch's DataLoader machinery, ``num_workers>0``
with a transform): the workers' seeding, the check that they can hand batches over, and the
batches as they arrive, in step order."""

from __future__ import annotations

import multiprocessing.context
import os
import tempfile
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..errors import ConfigError
from ..plan import Cursor
from ..plan.bijection import derive_key
from ..plan.mixture_cursor import MixtureCursor
from .dataset import StreamDataset
from .pinning import pinned
from .schedule import Schedule
from .shared_batches import SharedBatchDataset, SlotReader, WorkerBatch
from .stats import StepCounters

_WORKER_SEED_TAG = 0x574B_5253  # distinguishes worker base seeds from every other derived key


def worker_generator(cursor: Cursor | MixtureCursor) -> torch.Generator:
    """The generator a pass's DataLoader draws its workers' base seed from.

    Seeded from the plan (seed, epoch, samples consumed), so starting worker processes draws
    nothing from the training loop's torch RNG: the loop's random stream continues exactly
    after a resume, and a pass's workers are seeded the same in a rerun.
    """
    key = derive_key(cursor.seed, cursor.epoch, cursor.samples_consumed, _WORKER_SEED_TAG)
    return torch.Generator().manual_seed(key % (1 << 63))


# multiprocessing's socket for passing file descriptors: <tmp>/pymp-XXXXXXXX/listener-XXXXXXXX
_SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
_SUN_PATH = 108  # bytes of sockaddr_un.sun_path on Linux (CPython refuses longer paths)


def check_socket_folder() -> None:
    """Refuse worker processes that could not hand their batches over.

    With torch's default sharing strategy (``file_descriptor``) a worker passes its shared
    memory to the loop over a Unix socket that multiprocessing makes in the temporary
    folder. When ``TMPDIR`` is too long for a socket path, that fails in the worker's queue
    thread, which only prints it: the batch never arrives and the loop waits forever.
    """
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    folder = tempfile.gettempdir()
    if len(os.fsencode(folder)) + _SOCKET_SUFFIX > _SUN_PATH:
        raise ConfigError(
            f"worker processes cannot hand batches to the training loop: the temporary folder "
            f"{folder} ({len(os.fsencode(folder))} bytes) is too long for the Unix socket "
            f"torch passes shared memory through (at most {_SUN_PATH - _SOCKET_SUFFIX} bytes); "
            "set TMPDIR to a shorter folder, or call "
            "torch.multiprocessing.set_sharing_strategy('file_system'), or use num_workers=0")


class WorkerBatches:
    """Steps made by worker processes (torch's DataLoader machinery), in step order; their
    tensors arrive in shared slots set up once per worker (:mod:`.shared_batches`)."""

    def __init__(self, dataset: StreamDataset, schedule: Schedule, *, num_workers: int,
                 prefetch: int, timeout: float,
                 multiprocessing_context: str | multiprocessing.context.BaseContext | None,
                 pin: bool, counters: StepCounters) -> None:
        check_socket_folder()
        self._pin = pin
        self._counters = counters
        self._slots = SlotReader()
        torch_loader = DataLoader(
            SharedBatchDataset(dataset, slots=prefetch + 3), batch_size=None,
            num_workers=num_workers, prefetch_factor=prefetch,
            persistent_workers=False, timeout=timeout,
            multiprocessing_context=multiprocessing_context,
            generator=worker_generator(schedule.cursor),
        )
        self._batches = iter(torch_loader)

    def __next__(self) -> Any:
        item = next(self._batches)
        if isinstance(item, WorkerBatch):  # (and the worker's counters so far)
            self._counters.worker(item.process, item.counters)
            item = item.batch
        batch = self._slots.unpack(item)
        return pinned(batch) if self._pin else batch

    def close(self) -> None:
        shutdown = getattr(self._batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._slots.forget()
