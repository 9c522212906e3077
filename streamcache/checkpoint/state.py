"""What goes into a checkpoint: DCP ``Stateful`` objects, global states and plain values.

Raw ``nn.Module`` (plain, DDP, FSDP2) and ``torch.optim.Optimizer`` values are accepted and
handled as :class:`ModelState` handles them (DCP's ``get_*_state_dict``/``set_*_state_dict``):
:func:`resolve` wraps each in a :class:`ModuleEntry` or :class:`OptimizerEntry`, pairing an
optimizer with the one module of the state that holds all of its parameters.

A *global* state is one whose ``state_dict()`` is small, JSON-able and identical on every
rank (the StreamLoader's cursor is the example). The checkpointer saves it once, in
``global.json``, instead of once per rank through DCP, and checks at save time that every
rank agrees. An object is global when it has a true ``global_state`` attribute (a class
attribute, for classes that are global by nature) or is wrapped in :class:`GlobalState`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from .errors import CheckpointError

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

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        validate_state(self.obj, state_dict)


def is_global_state(obj: object) -> bool:
    return bool(getattr(obj, GLOBAL_STATE_ATTR, False)) and isinstance(obj, Stateful)


def validate_state(obj: object, state_dict: Any) -> None:
    """Raise what ``obj.load_state_dict(state_dict)`` would raise, changing nothing.

    Objects that can tell (``validate_state_dict``, as the StreamLoader has) are asked; for
    the others nothing is known before they load.
    """
    validate = getattr(obj, "validate_state_dict", None)
    if callable(validate):
        validate(state_dict)


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


class ModuleEntry:
    """A raw ``nn.Module`` of the state: its state dict keyed by DCP's parameter names.

    ``get_model_state_dict`` drops wrapper prefixes (DDP's ``module.``) and keeps FSDP2's
    DTensors sharded, so a checkpoint loads into the bare, the DDP-wrapped or the sharded
    model alike. Loading is strict: a parameter or buffer missing on either side raises.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.optimizers: list[torch.optim.Optimizer] = []

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerEntry:
    """A raw optimizer of the state, keyed by its model's parameter names (not positions).

    DCP's ``get_optimizer_state_dict`` initializes the state of an optimizer that has not
    stepped yet, so a fresh optimizer receives the saved state instead of silently nothing.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizers = [optimizer]

    def state_dict(self) -> dict[str, Any]:
        return dict(get_optimizer_state_dict(self.model, self.optimizers[0]))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizers[0], state_dict)


def resolve(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with raw modules and optimizers replaced by their DCP entries.

    Every other value is kept as it is. An optimizer is paired with the one raw module of
    the state that holds all of its parameters.

    Raises:
        CheckpointError: an optimizer has no such module, or several (ambiguous).
    """
    modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    resolved: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            resolved[key] = ModuleEntry(value)
        elif isinstance(value, torch.optim.Optimizer):
            resolved[key] = OptimizerEntry(_owner(key, value, modules), value)
        else:
            resolved[key] = value
    return resolved


def _owner(key: str, optimizer: torch.optim.Optimizer,
           modules: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [name for name, module in modules.items()
              if wanted <= {id(p) for p in module.parameters()}]
    hint = (f"pass the model and its optimizer together instead: "
            f"{{{key!r}: ModelState(model, optimizer)}}")
    if not owners:
        raise CheckpointError(
            f"state key {key!r}: an optimizer is saved by its model's parameter names, and no "
            f"nn.Module in the state holds all of its parameters (modules: {sorted(modules)}); "
            + hint)
    if len(owners) > 1:
        raise CheckpointError(
            f"state key {key!r}: the optimizer's parameters are held by several modules of "
            f"the state ({owners}), so its parameter names are ambiguous; " + hint)
    return modules[owners[0]]
