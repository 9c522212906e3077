"""Hugging Face Accelerate and streamcache: pass the StreamLoader, never a DataLoader over the
StreamDataset.

    accelerator = Accelerator()
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


__all__ = ["refuse_accelerate_wrapping", "wrapped_by_accelerate"]
