"""Hugging Face Accelerate and streamcache: pass the StreamLoader, never a DataLoader over the
StreamDataset.

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # cpu=True without GPUs
    loader = StreamLoader(StreamDataset(url, global_batch_size=256, seed=0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # loader: as is
    accelerator.register_for_checkpointing(loader)   # save_state/load_state keep its cursor
    for epoch in range(loader.epoch, epochs):
        for batch in loader:
            batch = {k: v.to(accelerator.device) for k, v in batch.items() if k != "__id__"}

``Accelerator.prepare`` wraps only ``torch.utils.data.DataLoader`` objects; a StreamLoader is
not one, so it comes back unchanged and every rank reads its own part of each global batch,
once. Accelerate's data-loader settings (``dispatch_batches``, ``split_batches``,
``even_batches``, ``use_seedable_sampler``) do not apply to it: the global batch is the
dataset's ``global_batch_size`` (or ``batch_size`` per rank), every rank gets the same
number of steps, and the order is the plan's. Batches stay on the CPU (pinned with
``pin_memory=True``): move them with ``.to(accelerator.device)``.

A DataLoader over the StreamDataset, prepared by Accelerate (as ``Trainer(train_dataset=
StreamDataset(...))`` does too), would be wrong in every mode: dispatching reads rank 0's
part only and splits it again across the ranks; sharding splits each rank's part again;
and the DataLoader batches whole batches. :func:`refuse_accelerate_wrapping`, called when a
pass of the dataset starts, refuses that with an error that says what to do.

On a machine without GPUs, ``Accelerator()`` without ``cpu=True`` runs every process of an
``accelerate launch --multi_gpu`` job alone (``DistributedType.NO``, one process, no DDP,
each process the main one) although the launcher made a job of several: each process would
train its own model on its share of every global batch. :func:`refuse_accelerate_world_mismatch`,
called when streamcache takes the world size from the process group or the launcher's
environment, refuses that, naming ``cpu=True``.
"""

from __future__ import annotations

import sys

from ..errors import ConfigError

_ACCELERATE_MODULES = ("accelerate.data_loader",)
_MAX_FRAMES = 64


def wrapped_by_accelerate() -> bool:
    """Whether the running code is iterating under one of Accelerate's data loaders
    (its frames are on this thread's stack). A stack walk, once per pass."""
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "") in _ACCELERATE_MODULES:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def refuse_accelerate_wrapping() -> None:
    """Raise when a StreamDataset is iterated by a DataLoader that Accelerate prepared.

    Raises:
        ConfigError: saying to pass a StreamLoader to ``accelerator.prepare`` (or, with
            transformers' Trainer, ``StreamTrainer(train_loader=...)``).
    """
    if "accelerate" in sys.modules and wrapped_by_accelerate():
        raise ConfigError(
            "a StreamDataset is being iterated by a DataLoader that Accelerate prepared: it "
            "would shard or dispatch batches the dataset already splits by rank (reading some "
            "samples twice and others never) and batch whole batches again. Pass "
            "StreamLoader(dataset) to accelerator.prepare (it is returned as it is), or with "
            "transformers' Trainer use streamcache.integrations.transformers.StreamTrainer("
            "train_loader=StreamLoader(dataset))")


def accelerate_processes() -> int | None:
    """The number of processes Accelerate's state, made in this process, counts; None where
    Accelerate has made no state here (it is read, never made: nothing is imported)."""
    state_module = sys.modules.get("accelerate.state")
    partial_state = getattr(state_module, "PartialState", None)
    shared = getattr(partial_state, "_shared_state", None)
    processes = shared.get("num_processes") if isinstance(shared, dict) else None
    return processes if isinstance(processes, int) else None


def refuse_accelerate_world_mismatch(world_size: int, source: str) -> None:
    """Raise when Accelerate counts another number of processes than the job streamcache
    splits every global batch over.

    Args:
        world_size: the world size streamcache took from the process group or the
            environment (not one passed explicitly: a dataset read whole on one process of
            an Accelerate job is legitimate).
        source: where it was taken from, for the message.

    Raises:
        ConfigError: Accelerate's state counts other than ``world_size`` processes (as
            ``Accelerator()`` does without ``cpu=True`` on a machine without GPUs): naming
            ``Accelerator(cpu=True)`` and, for the Trainer, ``use_cpu=True``.
    """
    processes = accelerate_processes()
    if processes is None or processes == world_size:
        return
    raise ConfigError(
        f"Accelerate runs this process as a job of {processes} process(es) but {source} says "
        f"the job has {world_size}: Accelerate would not wrap the model in DDP or average "
        "gradients, and every process would act as the main one, while the loader gives "
        f"each process 1/{world_size} of every global batch: {world_size} models trained "
        "apart. On a machine without GPUs make the Accelerator with Accelerator(cpu=True) "
        "(e.g. Accelerator(cpu=not torch.cuda.is_available())), or with transformers' "
        "Trainer TrainingArguments(use_cpu=True); with GPUs, check that every process sees "
        "one (accelerate launch --multi_gpu)")


__all__ = ["accelerate_processes", "refuse_accelerate_world_mismatch",
           "refuse_accelerate_wrapping", "wrapped_by_accelerate"]
