"""Batches from worker processes through shared memory that is set up once, not per batch.

torch's worker processes send a tensor by moving its storage into a new shared-memory file
and passing the file's descriptor to the parent through a socket, which maps it again: per
tensor per batch, a file, a descriptor handed over a connection, fresh pages faulted in on
both sides (about half a millisecond a tensor, measured). Here each worker keeps a few slots
in one shared segment, sends the segment (torch's way) once, and then writes each batch's
tensors into a free slot and sends only a small :class:`SharedBatch`: where each tensor lies,
and the batch's other values. The parent makes the tensors as views of its mapping of the
slot (no copy) and gives the slot back to the worker once no tensor of it is alive any more
(the views refer to one owner object per slot, whose reference count says so exactly).

A batch that finds no free slot (the training loop holds many batches) or does not fit
travels as before; a batch of a larger size than the slots makes the worker set up a larger
segment.

Thread safety: a :class:`SlotWriter` belongs to one worker process; a :class:`SlotReader`
to the thread that iterates the loader.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .stats import worker_counters

_ALIGN = 64
_MAX_SEGMENT_BYTES = 1 << 30  # per worker: larger batches travel torch's way


@dataclasses.dataclass(frozen=True)
class TensorAt:
    """A tensor of a shared batch: ``nbytes`` at ``offset`` in its slot."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SharedBatch:
    """What a worker sends for a batch whose tensors are in a slot of its shared segment.

    ``structure`` is the batch with each tensor replaced by its :class:`TensorAt`;
    ``segment`` and ``flags`` (the segment's bytes and its slots' busy flags, shared) come
    with the first batch of a segment only.
    """

    worker: tuple[int, int]  # (process id, segment number)
    slot: int
    slot_bytes: int
    structure: Any
    segment: torch.Tensor | None = None
    flags: torch.Tensor | None = None


def _movable(tensor: torch.Tensor) -> bool:
    """Whether a tensor can be written into a slot (a plain CPU tensor; others travel
    torch's way, which knows what to do with them or refuses them)."""
    return tensor.device.type == "cpu" and tensor.layout is torch.strided and \
        not tensor.is_quantized and not tensor.requires_grad


def _tensors(batch: Any) -> list[torch.Tensor]:
    """The movable tensors of a batch (in dicts, lists, tuples, namedtuples), in order."""
    if isinstance(batch, torch.Tensor):
        return [batch] if _movable(batch) else []
    if isinstance(batch, dict):
        return [t for value in batch.values() for t in _tensors(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in _tensors(value)]
    return []


def _share_memory(tensors: list[torch.Tensor]) -> bool:
    """Whether two of ``tensors`` (not empty) are views of one storage."""
    storages = [t.untyped_storage().data_ptr() for t in tensors if t.numel()]
    return len(set(storages)) < len(storages)


def _replace(batch: Any, placed: dict[int, TensorAt]) -> Any:
    """``batch`` with each tensor whose ``id`` is in ``placed`` replaced by its place."""
    if isinstance(batch, torch.Tensor):
        return placed.get(id(batch), batch)
    if isinstance(batch, dict):
        return {key: _replace(value, placed) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_replace(value, placed) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_replace(value, placed) for value in batch)
    return batch


class SlotWriter:
    """A worker's shared segment: ``slots`` slots, each the size of the largest batch seen
    (with a quarter to spare)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._segment: torch.Tensor | None = None
        self._bytes: np.ndarray | None = None
        self._flags: np.ndarray | None = None
        self._flags_tensor: torch.Tensor | None = None
        self._slot_bytes = 0
        self._number = 0
        self._announced = False

    def pack(self, batch: Any) -> Any:
        """``batch`` as a :class:`SharedBatch` in a free slot, else ``batch`` as it is (also
        when its tensors hold no bytes, as a split tail's empty part: the worker may have no
        segment yet, and there is nothing to move)."""
        tensors = _tensors(batch)
        if not tensors or _share_memory(tensors):
            return batch  # (tensors that share memory keep sharing it only torch's way)
        offsets, used = [], 0
        for tensor in tensors:
            offsets.append(used)
            used += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        if not used:
            return batch
        if used > self._slot_bytes and not self._grow(used):
            return batch
        assert self._bytes is not None and self._flags is not None
        free = np.flatnonzero(self._flags == 0)
        if not len(free):
            return batch  # every slot is in the parent's hands
        slot = int(free[0])
        self._flags[slot] = 1
        base = slot * self._slot_bytes
        placed: dict[int, Any] = {}
        for tensor, offset in zip(tensors, offsets, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            start = base + offset
            target = torch.from_numpy(self._bytes[start:start + nbytes])
            target.view(tensor.dtype).view(tensor.shape).copy_(tensor)
            placed[id(tensor)] = TensorAt(offset, nbytes, tensor.dtype, tuple(tensor.shape))
        first = not self._announced
        self._announced = True
        return SharedBatch((os.getpid(), self._number), slot, self._slot_bytes,
                           _replace(batch, placed), self._segment if first else None,
                           self._flags_tensor if first else None)

    def _grow(self, needed: int) -> bool:
        """A new segment with slots of ``needed`` bytes and a quarter more (False: too large;
        the old segment stays with the parent while its batches live)."""
        slot_bytes = -(-(needed + needed // 4) // _ALIGN) * _ALIGN
        if slot_bytes * self.slots > _MAX_SEGMENT_BYTES:
            return False
        self._segment = torch.empty(slot_bytes * self.slots, dtype=torch.uint8).share_memory_()
        self._flags_tensor = torch.zeros(self.slots, dtype=torch.uint8).share_memory_()
        self._bytes = self._segment.numpy()
        self._flags = self._flags_tensor.numpy()
        self._slot_bytes = slot_bytes
        self._number += 1
        self._announced = False
        return True


class SlotReader:
    """The parent's side: tensors of :class:`SharedBatch` es as views of the workers'
    segments, and slots given back once their tensors are gone."""

    def __init__(self) -> None:
        # (pid, segment number) -> (flags, the owner of each slot's bytes)
        self._segments: dict[tuple[int, int], tuple[np.ndarray, list[np.ndarray]]] = {}
        self._lent: list[_Lent] = []
        self.shared = 0  # batches that came through a slot
        self.copied = 0  # batches that came torch's way (no free slot, too large, no tensor)
        # An owner nothing else refers to, held as _lent holds one: its count means "free".
        probe = np.frombuffer(np.zeros(1, np.uint8).data, dtype=np.uint8)
        self._free_count = _Lent(probe, np.zeros(1, np.uint8), 0).count()

    def unpack(self, item: Any) -> Any:
        """The batch ``item`` stands for (``item`` itself when it is no :class:`SharedBatch`)."""
        self.give_back()
        if not isinstance(item, SharedBatch):
            self.copied += 1
            return item
        self.shared += 1
        if item.segment is not None and item.flags is not None:
            whole = item.segment.numpy().data  # a memoryview: slices of it do not collapse
            owners = [np.frombuffer(whole[k * item.slot_bytes:(k + 1) * item.slot_bytes],
                                    dtype=np.uint8) for k in range(len(item.flags))]
            self._segments[item.worker] = (item.flags.numpy(), owners)
        flags, owners = self._segments[item.worker]
        self._lent.append(_Lent(owners[item.slot], flags, item.slot))
        return _rebuild(item.structure, owners[item.slot])

    def give_back(self) -> None:
        """Mark the slots whose tensors are all gone free for their workers."""
        kept = []
        for lent in self._lent:
            if lent.count() == self._free_count:
                lent.flags[lent.slot] = 0
            else:
                kept.append(lent)
        self._lent = kept

    def forget(self) -> None:
        """Drop the segments (the pass ended; tensors still alive keep their mapping)."""
        self._segments.clear()
        self._lent.clear()


@dataclasses.dataclass
class _Lent:
    """A slot whose batch the parent handed out: free once ``owner`` has no other referrer
    than the segment's list and this record (every tensor made from the slot refers to it)."""

    owner: np.ndarray
    flags: np.ndarray
    slot: int

    def count(self) -> int:
        return sys.getrefcount(self.owner)


def _rebuild(structure: Any, owner: np.ndarray) -> Any:
    if isinstance(structure, TensorAt):
        flat = torch.from_numpy(owner[structure.offset:structure.offset + structure.nbytes])
        return flat.view(structure.dtype).view(structure.shape)
    if isinstance(structure, dict):
        return {k: _rebuild(v, owner) for k, v in structure.items()}
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(_rebuild(v, owner) for v in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(_rebuild(v, owner) for v in structure)
    return structure


@dataclasses.dataclass
class WorkerBatch:
    """A worker's batch and what that worker process counted so far (cumulative:
    :func:`~streamcache.loading.stats.worker_counters`), so the loader's statistics count the
    reads and transforms its workers did."""

    batch: Any
    process: int  # the worker's pid: counters of one worker process replace its earlier ones
    counters: dict[str, Any]


class SharedBatchDataset(IterableDataset):
    """What the worker processes iterate: ``dataset``'s batches, packed into shared slots,
    each with the worker's counters (:class:`WorkerBatch`)."""

    def __init__(self, dataset: Any, slots: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.slots = slots

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is None:  # not in a worker: nothing to move
            yield from self.dataset
            return
        # The worker's copy of the dataset is closed when the worker exits (its prefetch
        # threads stopped, its native objects freed): torch's worker loop returns without
        # closing it, and what is left alive at exit is reported by the extension as leaked.
        atexit.register(self.dataset.close)
        writer = SlotWriter(self.slots)
        for batch in self.dataset:
            yield WorkerBatch(writer.pack(batch), os.getpid(), worker_counters(self.dataset))
