"""Batches in page-locked (pinned) memory, for ``pin_memory=True``: the gather's pool of
pinned buffers, and pinning what was not gathered into it."""

from __future__ import annotations

from typing import Any

import torch

from ..format.buffers import BufferPool

_pinned_pool: BufferPool | None = None


def pinned_pool() -> BufferPool:
    """The gather's pool of page-locked (pinned) buffers (needs CUDA), made on first use."""
    global _pinned_pool
    if _pinned_pool is None:
        _pinned_pool = BufferPool(min_bytes=0, allocate=_page_locked)
    return _pinned_pool


def _page_locked(nbytes: int) -> Any:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def pinned(batch: Any) -> Any:
    """``batch`` with every tensor in page-locked memory (``pin_memory()`` returns a tensor
    that already is, such as one gathered into :func:`pinned_pool`, as it is)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: pinned(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(pinned(v) for v in batch)
    return batch

