"""Staging: copying the state to be saved into reused host buffers.

Blocking staging (the default) copies everything before ``save`` returns, so no write the
training loop makes afterwards can reach the checkpoint. Background staging (opt-in) copies
the tensors of model and optimizer entries (the bulk of a checkpoint) in the writer thread while
the training loop goes on, and makes the only operations that change them wait until the
copy is done (guards.py: the optimizers' ``step`` and, for models that have buffers, the
model's forward). Everything else is small and is staged before ``save`` returns. Other
in-place writes (EMA, weight clipping) are not held back but detected by the tensors' version
counters (guards.VersionCheck): such a save fails (nothing is published for it, the next
``save`` or ``wait`` raises, saying so). Writes through ``.data`` move no counter: with
background staging they can tear the checkpoint unless the loop calls ``wait_staged`` first.

Copies run at memory speed as states grow: a blocking copy on the CPU uses this rank's share
of the cores (torch's intra-op threads, raised for the copy when the job runs with fewer,
as torchrun's ``OMP_NUM_THREADS=1`` does), and CUDA tensors are copied into pinned host
buffers. With ``device_snapshot`` and enough free GPU memory, CUDA tensors are first copied
to reused buffers on their GPU (device to device, milliseconds), so ``save`` returns after
that copy and the copy to host memory runs in the writer thread (:meth:`Staging.to_host`);
later kernels of the loop are ordered after the snapshot's copies on the stream.
(The CUDA paths are written for GPU hosts and not exercised by the CPU-only tests.)

Thread safety: ``stage_now``/``split`` run in the training thread, ``stage_later`` and
``to_host`` in the writer thread, never at the same time (a save waits for the previous one
first).
"""

from __future__ import annotations

import contextlib
import copy
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ..processes import usable_cores
from .guards import Hold, UpdateGuard, VersionCheck, guarded_keys
from .host_buffers import HostBuffers


class Staging:
    """The reused staging buffers of one Checkpointer, and the guards of background staging.

    Args:
        shared_memory: stage into shared memory (for DCP's checkpoint process).
        background: stage model/optimizer tensors in the writer thread (see module doc).
        guard: the Checkpointer's guard of those tensors' updates (its owner closes it).
        device_snapshot: snapshot CUDA tensors on their GPU first where memory allows.
    """

    def __init__(self, *, shared_memory: bool, background: bool, guard: UpdateGuard,
                 device_snapshot: bool = False) -> None:
        on_gpu = torch.cuda.is_available()
        self.background = background
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=on_gpu,
            use_shared_memory=shared_memory,
            use_async_staging=False,
            use_non_blocking_copy=on_gpu,
        ))
        self._snapshot = DeviceSnapshot() if device_snapshot and on_gpu else None
        # a CPU state is copied into buffers kept with its staged tensors (host_buffers.py);
        # pinned and shared memory are DCP's stager's job
        self.copy_threads = rank_cores()
        self._host = HostBuffers(self.copy_threads) if not on_gpu and not shared_memory \
            else None
        self._guard = guard
        self._hold: Hold | None = None
        self._check: VersionCheck | None = None  # the save in flight's later entries

    def split(
        self, state: Mapping[str, Any], state_dict: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(stage now, stage later): later holds the guarded model and optimizer entries.

        ``state`` is the resolved state (:func:`~.state.resolve`): raw modules and
        optimizers appear as their entries.
        """
        if not self.background:
            return state_dict, {}
        later_keys = guarded_keys(state)
        later = {k: _freeze_leaves(state_dict[k]) for k in later_keys}
        now = {k: v for k, v in state_dict.items() if k not in later}
        if later:
            self._check = VersionCheck.of(later)
            self._hold = self._guard.hold(state[k] for k in later_keys)
            self._hold.then_verify(self._check.verify)
        return now, later

    def stage(self, state: Mapping[str, Any], state_dict: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the state staged now, the entries left to :meth:`stage_later`): :meth:`split`,
        then :meth:`stage_now`; a failure of the copy now releases the guards of the
        entries left for later (no writer will copy them)."""
        now, later = self.split(state, state_dict)
        try:
            return self.stage_now(now), later
        except BaseException:
            self.release_later()
            raise

    def stage_now(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` before ``save`` returns (CUDA tensors possibly only to their
        GPU: then :meth:`to_host` finishes the copy in the writer thread)."""
        if self._snapshot is not None:
            snapped = self._snapshot.take(state_dict)
            if snapped is not None:
                return snapped
        with self._copy_threads():
            if self._host is not None:
                return self._host.stage(state_dict)
            staged = self._stager.stage(state_dict)
        assert isinstance(staged, dict)  # use_async_staging=False returns the dict itself
        return staged

    def to_host(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Writer thread: the host copy of a state ``stage_now`` left on the GPU."""
        if self._snapshot is None or not self._snapshot.holds(state_dict):
            return state_dict
        staged = self._stager.stage(state_dict)
        assert isinstance(staged, dict)
        return staged

    def stage_later(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Stage in the writer thread; releases the guards even when the copy fails."""
        try:
            return self.stage_now(state_dict) if state_dict else {}
        finally:
            self.release_later()

    def release_later(self) -> None:
        """The later entries are no longer read (copied, or never to be): the guards let
        their updates through (any thread, idempotent)."""
        if self._check is not None:
            self._check.copied()
        self._release()

    def changed_while_staged(self) -> list[str]:
        """Writer thread, after :meth:`stage_later`: the later entries written to during
        their copy (none: the staged state is the one of the ``save`` call). Waits for the
        training thread's check (its next guarded operation or wait, guards.VersionCheck)."""
        check, self._check = self._check, None
        return check.changed() if check is not None else []

    @property
    def stager(self) -> DefaultStager:
        return self._stager

    def close(self) -> None:
        self.release_later()
        self._stager.close()
        if self._host is not None:
            self._host.close()
        self._snapshot = None

    def _release(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()

    @contextlib.contextmanager
    def _copy_threads(self) -> Iterator[None]:
        """Torch's intra-op threads raised to this rank's share of the cores for a copy."""
        before = torch.get_num_threads()
        if before >= self.copy_threads:
            yield
            return
        torch.set_num_threads(self.copy_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def _freeze_leaves(value: Any) -> Any:
    """Copy every non-tensor leaf now, so the writer thread sees the values of this step."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        return {k: _freeze_leaves(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_freeze_leaves(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_freeze_leaves(v) for v in value)
    return copy.deepcopy(value)


def rank_cores() -> int:
    """This rank's share of the machine's cores (torchrun's LOCAL_WORLD_SIZE ranks share it)."""
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, usable_cores() // ranks)


class DeviceSnapshot:
    """Reused GPU buffers holding a copy of a state's CUDA tensors (see the module doc).

    A snapshot is taken only when its buffers exist or fit in the GPU's free memory with
    a tenth of the device to spare; otherwise :meth:`take` returns None and the caller
    copies to host memory directly.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._taken: weakref.WeakSet[Any] = weakref.WeakSet()

    def take(self, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        missing = sum(t.numel() * t.element_size()
                      for path, t in _cuda_leaves(state_dict, ()) if not self._fits(path, t))
        if missing:
            free, total = torch.cuda.mem_get_info()
            if missing > free - total // 10:
                return None
        snapped = self._copy(state_dict, ())
        holder = _Snapped(snapped)
        self._taken.add(holder)
        return holder

    def holds(self, state_dict: Any) -> bool:
        return state_dict in self._taken

    def _fits(self, path: tuple[Any, ...], tensor: torch.Tensor) -> bool:
        buffer = self._buffers.get(path)
        return buffer is not None and buffer.shape == tensor.shape and \
            buffer.dtype == tensor.dtype and buffer.device == tensor.device

    def _buffer(self, path: tuple[Any, ...], tensor: torch.Tensor) -> torch.Tensor:
        if not self._fits(path, tensor):
            self._buffers[path] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        buffer = self._buffers[path]
        buffer.copy_(tensor, non_blocking=True)  # on the current stream: ordered before
        return buffer                            # the loop's later kernels

    def _copy(self, value: Any, path: tuple[Any, ...]) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            local = value.to_local()
            if not local.is_cuda:
                return _freeze_leaves(value)
            return DTensor.from_local(self._buffer(path, local), value.device_mesh,
                                      value.placements, run_check=False, shape=value.shape,
                                      stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._buffer(path, value) if value.is_cuda else value
        if isinstance(value, dict):
            return {k: self._copy(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v, (*path, i)) for i, v in enumerate(value))
        return copy.deepcopy(value)


class _Snapped(dict[str, Any]):
    """A state dict whose CUDA tensors are snapshot buffers (weak-referenceable)."""


def _cuda_leaves(value: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...],
                                                                      torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        if local.is_cuda:
            yield path, local
    elif isinstance(value, torch.Tensor):
        if value.is_cuda:
            yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _cuda_leaves(v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _cuda_leaves(v, (*path, i))
