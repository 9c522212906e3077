"""What goes into a checkpoint: DCP ``Stateful`` objects, global states and plain values.

A *global* state is one whose ``state_dict()`` is small, JSON-able and identical on every
rank (the StreamLoader's cursor is the example). The checkpointer saves it once, in
``global.json``, instead of once per rank through DCP, and checks at save time that every
rank agrees. An object is global when it has a true ``global_state`` attribute (a class
attribute, for classes that are global by nature) or is wrapped in :class:`GlobalState`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

GLOBAL_STATE_ATTR = "global_state"


class GlobalState:
    """Mark a ``Stateful`` whose state is global (the same on all ranks) and JSON-able."""

    global_state = True

    def __init__(self, obj: Stateful) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return dict(self.obj.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


def is_global_state(obj: object) -> bool:
    return bool(getattr(obj, GLOBAL_STATE_ATTR, False)) and isinstance(obj, Stateful)


class ModelState:
    """A ``Stateful`` for a model and its optimizer(s), keyed by parameter names.

    Uses DCP's ``get_state_dict``/``set_state_dict``, so optimizer state is keyed by
    fully-qualified parameter names (not by position) and DTensor/FSDP-sharded parameters
    reshard on load. Prefer it to passing an optimizer directly: a raw
    ``optimizer.state_dict()`` is keyed by parameter index and is empty before the first
    step, so it cannot be loaded into a fresh optimizer.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    ) -> None:
        self.model = model
        self.optimizers = [] if optimizer is None else (
            list(optimizer) if isinstance(optimizer, list) else [optimizer]
        )

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
