"""Train with PyTorch Lightning: DDP, a StreamLoader made in __init__, exact resume.

    python examples/lightning_train.py [--workdir DIR] [--devices 2] [--epochs 2]

1. writes a small dataset (x -> y = 3x + 1);
2. trains a LightningModule whose StreamLoader is made in ``__init__`` (before the process
   group exists: its rank is taken when the first epoch starts) with ``strategy="ddp"`` on
   CPU processes; ``ModelCheckpoint`` saves every few steps, and Lightning puts the loader's
   state into its own checkpoint (the loader has ``state_dict``/``load_state_dict``);
3. stops mid-epoch (``max_steps``, as a preempted job would), then a fresh module and Trainer
   resume with ``ckpt_path=``: Lightning restores model, optimizer and loader, and the epoch
   continues where it stopped;
4. checks that over both runs every epoch trained on every sample exactly once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from streamcache import StreamDataset, StreamLoader, write_dataset

SAMPLES = 512
GLOBAL_BATCH = 32  # over all ranks: keep it fixed to resume on another number of devices


class Regression(L.LightningModule):
    def __init__(self, data: str, cache: str) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        # Made here, before Trainer.fit starts the processes: nothing is resolved yet.
        self.loader = StreamLoader(StreamDataset(data, global_batch_size=GLOBAL_BATCH, seed=0,
                                                 cache_dir=cache))
        self.seen: list[tuple[int, list[int]]] = []  # (epoch, ids) of this rank's batches

    def train_dataloader(self) -> StreamLoader:
        return self.loader  # len() is the epoch's steps, as a DataLoader's

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch["__id__"].tolist()))
        x, y = batch["x"].float().unsqueeze(1), batch["y"].float().unsqueeze(1)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def trainer(args: argparse.Namespace, **limits: int) -> L.Trainer:
    return L.Trainer(
        strategy="ddp", devices=args.devices, accelerator="cpu", logger=False,
        default_root_dir=args.workdir, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.workdir, "checkpoints"),
                                   every_n_train_steps=args.save_every, save_last=True)],
        **limits,
    )


def check_exactly_once(seen: list[tuple[int, list[int]]], epochs: int) -> None:
    """Gather every rank's (epoch, ids) on rank 0 and check each epoch read each sample once."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() != 0:
        return
    for epoch in range(epochs):
        ids = sorted(i for rank in everyone for e, batch in rank if e == epoch for i in batch)
        if ids != list(range(SAMPLES)):
            raise SystemExit(f"epoch {epoch}: {len(ids)} ids, {len(set(ids))} distinct; "
                             f"expected each of {SAMPLES} once")
    print(f"{epochs} epochs on {len(everyone)} processes, stopped and resumed mid-epoch: "
          "every sample exactly once per epoch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=4)
    args = parser.parse_args(argv)
    # Lightning's launcher runs this script again for each other process, with the same
    # arguments: every process must agree on the folder. The process that made a temporary
    # one (the first) removes it at the end.
    temporary = args.workdir is None and "LIGHTNING_EXAMPLE_WORKDIR" not in os.environ
    if temporary:  # (not setdefault: its default would make a folder in every process)
        os.environ["LIGHTNING_EXAMPLE_WORKDIR"] = tempfile.mkdtemp(prefix="streamcache-lightning-")
    args.workdir = args.workdir or os.environ["LIGHTNING_EXAMPLE_WORKDIR"]
    try:
        return run(args)
    finally:
        if temporary:
            shutil.rmtree(args.workdir, ignore_errors=True)
            print(f"removed the temporary folder {args.workdir}")


def run(args: argparse.Namespace) -> int:
    data, cache = (os.path.join(args.workdir, d) for d in ("data", "cache"))
    if not os.path.exists(os.path.join(data, "index.json")) and "LOCAL_RANK" not in os.environ:
        x = np.linspace(-1, 1, SAMPLES, dtype=np.float32)
        write_dataset(({"x": float(v), "y": float(3 * v + 1)} for v in x), data)

    steps_per_epoch = SAMPLES // GLOBAL_BATCH
    stop_at = steps_per_epoch + steps_per_epoch // 2 // args.save_every * args.save_every
    first = Regression(data, cache)
    trainer(args, max_steps=stop_at).fit(first)  # stops mid-epoch 1, just after a save

    resumed = Regression(data, cache)  # a restarted job: a fresh module and loader
    run = trainer(args, max_epochs=args.epochs)
    run.fit(resumed, ckpt_path=os.path.join(args.workdir, "checkpoints", "last.ckpt"))
    if run.global_rank == 0:
        print(f"resumed at step {stop_at} (epoch 1, step {stop_at - steps_per_epoch} of "
              f"{steps_per_epoch}); finished at epoch {run.current_epoch}, step "
              f"{run.global_step}; weight {resumed.net.weight.item():.3f} (target 3)")
    check_exactly_once(first.seen + resumed.seen, args.epochs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
