"""Staging: copying the state to be saved into reused host buffers.

Blocking staging (the default) copies everything before ``save`` returns, so no write the
training loop makes afterwards can reach the checkpoint. Background staging (opt-in) copies
the tensors of model and optimizer entries (the bulk of a checkpoint) in the writer thread while
the training loop goes on, and makes the only operations that change them wait until the
copy is done: the optimizers' ``step`` (a step pre-hook) and, for models that have buffers
(BatchNorm statistics change in ``forward``), the model's forward (a forward pre-hook).
Everything else is small and is staged before ``save`` returns. Other in-place writes (EMA,
``.data``) are not guarded: with background staging they can tear the snapshot.

Thread safety: ``stage_now``/``split`` run in the training thread, ``stage_later`` in the
writer thread, never at the same time (a save waits for the previous one first).
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .state import ModelState, ModuleEntry, OptimizerEntry

_MODEL_ENTRIES = (ModelState, ModuleEntry, OptimizerEntry)


class Staging:
    """The reused staging buffers of one Checkpointer, and the guards of background staging.

    Args:
        shared_memory: stage into shared memory (for DCP's checkpoint process).
        background: stage model/optimizer tensors in the writer thread (see module doc).
    """

    def __init__(self, *, shared_memory: bool, background: bool) -> None:
        on_gpu = torch.cuda.is_available()
        self.background = background
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=on_gpu,
            use_shared_memory=shared_memory,
            use_async_staging=False,
            use_non_blocking_copy=on_gpu,
        ))
        self._staged = threading.Event()
        self._staged.set()
        self._hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def split(
        self, state: Mapping[str, Any], state_dict: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(stage now, stage later): later holds the guarded model and optimizer entries.

        ``state`` is the resolved state (:func:`~.state.resolve`): raw modules and
        optimizers appear as their entries.
        """
        if not self.background:
            return state_dict, {}
        later_keys = [k for k, v in state.items() if isinstance(v, _MODEL_ENTRIES)]
        for key in later_keys:
            self._guard(state[key])
        later = {k: _freeze_leaves(state_dict[k]) for k in later_keys}
        now = {k: v for k, v in state_dict.items() if k not in later}
        if later:
            self._staged.clear()
        return now, later

    def stage_now(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = self._stager.stage(state_dict)
        assert isinstance(staged, dict)  # use_async_staging=False returns the dict itself
        return staged

    def stage_later(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Stage in the writer thread; releases the guards even when the copy fails."""
        try:
            return self.stage_now(state_dict) if state_dict else {}
        finally:
            self._staged.set()

    def wait_staged(self) -> None:
        """Block until the save in flight no longer needs the live tensors."""
        self._staged.wait()

    @property
    def stager(self) -> DefaultStager:
        return self._stager

    def close(self) -> None:
        self._staged.set()
        for handles in list(self._hooks.values()):
            for handle in handles:
                handle.remove()
        self._hooks.clear()
        self._stager.close()

    def _guard(self, model_state: ModelState | ModuleEntry | OptimizerEntry) -> None:
        def before(*_: Any) -> None:
            self._staged.wait()

        for optimizer in model_state.optimizers:
            if optimizer not in self._hooks:
                self._hooks[optimizer] = [optimizer.register_step_pre_hook(before)]
        model = model_state.model
        if model not in self._hooks and any(True for _ in model.buffers()):
            self._hooks[model] = [model.register_forward_pre_hook(before)]


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
