"""Checkpointing of training state through PyTorch Distributed Checkpoint (DCP).

Public names: :class:`Checkpointer`, :class:`GlobalState`, :class:`ModelState`,
:class:`CheckpointInfo`, :class:`AsyncMode`, :class:`IfBusy`, :class:`SaveStats`,
:class:`MemoryOptions` (the memory tier's options) and the errors.
``add_arguments``/``run`` implement ``streamcache checkpoints``.
Design and measured defaults: docs/checkpoint.md.
"""

from __future__ import annotations

from .checkpointer import Checkpointer
from .cli import add_arguments, run
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointUnsafeError,
    CheckpointWriteError,
)
from .layout import CheckpointInfo
from .memory import MemoryOptions
from .modes import AsyncMode, IfBusy, SaveStats
from .state import GlobalState, ModelState, is_global_state

__all__ = [
    "AsyncMode",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointUnsafeError",
    "CheckpointWriteError",
    "Checkpointer",
    "GlobalState",
    "IfBusy",
    "MemoryOptions",
    "ModelState",
    "SaveStats",
    "add_arguments",
    "is_global_state",
    "run",
]
