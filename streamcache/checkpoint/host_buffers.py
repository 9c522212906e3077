"""The host copy of a CPU state, in buffers kept from one save to the next.

A blocking save's floor is one copy of the state's tensors into memory that is already
allocated. DCP's ``DefaultStager`` reuses its storages too, but rebuilds every tensor of the
copy on every save through a generic deep copy (``new_empty`` through DTensor's dispatch, the
DTensor's spec copied attribute by attribute, a grad-mode switch per object): about 15 ms for
the 64 tensors of a 2-rank FSDP2 model and its Adam state, 1.5x the copy itself at 256 MB a
rank (issue #38's measurement). Here the staged state of the previous save is kept by its
place in the state dict: where a tensor there has the same type, shape, strides, dtype and
(for a DTensor) mesh and placements as before, the staged tensor is reused and only its
bytes are copied; the containers and every non-tensor leaf are built anew (they may change
from save to save).

Reusing the staged tensors is safe because a save waits for the previous one to finish
writing before it stages (``Checkpointer.save`` calls ``wait`` first), so no writer reads a
buffer while it is overwritten.

The bytes of a plain contiguous tensor are copied by the native core
(:func:`~streamcache._native.stream_copy`: non-temporal stores, since the writer reads the
buffers back only after they have left the caches; the GIL released; the rank's share of the
cores): 15 ms against torch's 27 ms for 256 MB here, and the training loop's working set stays
in the caches. Other tensors (strided, conjugate views, small ones) use ``Tensor.copy_``.

Used for CPU states (no GPU, no shared memory for DCP's checkpoint process); the other cases
keep DCP's stager (pinned and shared memory are its job). Thread safety: one stager per
Checkpointer, called by one thread at a time (see staging.py).
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import torch

from .. import _native

_Path = tuple[Any, ...]

NATIVE_COPY_BYTES = 64 << 10  # smaller tensors: Tensor.copy_ (the call costs the same)


class HostBuffers:
    """Copies of a state dict's CPU tensors into buffers reused across saves.

    Args:
        threads: threads a large copy may use (the rank's share of the cores).
    """

    def __init__(self, threads: int = 1) -> None:
        self.threads = max(1, threads)
        self._staged: dict[_Path, tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]] = {}
        self._seen: set[_Path] = set()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict``: its tensors copied into this stager's buffers, every
        other leaf deep-copied. Buffers of places the state no longer has are released."""
        self._seen = set()
        with torch.no_grad():
            staged = self._copy(state_dict, ())
        for path in [p for p in self._staged if p not in self._seen]:
            del self._staged[path]
        return staged

    def close(self) -> None:
        self._staged.clear()

    def _copy(self, value: Any, path: _Path) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if type(value) in (dict, collections.OrderedDict):  # (a module's state dict: ordered)
            return type(value)((k, self._copy(v, (*path, k))) for k, v in value.items())
        if type(value) in (list, tuple):
            return type(value)(self._copy(v, (*path, i)) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, path: _Path) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        sharding: tuple[Any, ...] | None = None
        local = tensor
        if isinstance(tensor, DTensor):
            local = tensor.to_local()
            sharding = (tensor.device_mesh, tuple(tensor.placements))
        signature = (type(tensor), tensor.shape, tensor.stride(), tensor.dtype,
                     local.shape, local.stride(), local.device, sharding)
        self._seen.add(path)
        found = self._staged.get(path)
        if found is None or found[0] != signature:
            buffer = torch.empty_like(local, device="cpu")
            staged = buffer
            if isinstance(tensor, DTensor):
                dtensor = DTensor.from_local(buffer, tensor.device_mesh, tensor.placements,
                                             run_check=False, shape=tensor.shape,
                                             stride=tensor.stride())
                staged, buffer = dtensor, dtensor.to_local()
            found = (signature, staged, buffer)
            self._staged[path] = found
        _, staged, buffer = found
        copy_into(buffer, local, self.threads)
        return staged


def copy_into(buffer: torch.Tensor, tensor: torch.Tensor, threads: int) -> None:
    """``buffer.copy_(tensor)`` for a CPU ``buffer`` made by ``torch.empty_like(tensor)``;
    natively where both are plain, contiguous and large."""
    nbytes = tensor.numel() * tensor.element_size()
    if (nbytes < NATIVE_COPY_BYTES or type(tensor) is not torch.Tensor
            or tensor.device.type != "cpu" or tensor.layout != torch.strided
            or tensor.is_conj() or tensor.is_neg() or not tensor.is_contiguous()
            or not buffer.is_contiguous() or buffer.dtype != tensor.dtype
            or buffer.shape != tensor.shape):
        buffer.copy_(tensor)
        return
    _native.stream_copy(_bytes_of(tensor), _bytes_of(buffer), threads)


def _bytes_of(tensor: torch.Tensor) -> Any:
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


__all__ = ["HostBuffers", "copy_into"]
