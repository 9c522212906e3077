"""Train with Hugging Face Accelerate: ``accelerate launch``, a StreamLoader, exact resume.

    python examples/accelerate_train.py --prepare --workdir DIR
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --workdir DIR

(``--multi_gpu`` is Accelerate's launcher for several processes; on a machine without GPUs
the script asks for the CPU and the processes join with gloo.) Without ``--workdir`` the
script prepares a temporary folder, launches itself with ``accelerate launch`` on 2
processes, checks the result and removes the folder.

1. ``accelerator.prepare`` returns the StreamLoader as it is (it is not a DataLoader):
   every rank reads its own part of each global batch, Accelerate neither shards it again nor
   dispatches it from rank 0;
2. ``accelerator.register_for_checkpointing(loader)``: ``save_state`` keeps the loader's
   cursor with the model and optimizer;
3. the job stops mid-epoch after a ``save_state`` (as a preempted job would), a fresh loader
   and Accelerator ``load_state`` it, and ``for epoch in range(loader.epoch, EPOCHS)``
   finishes the run;
4. rank 0 checks that every epoch trained on every sample once, in the global batches a
   single process reads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
import torch

from streamcache import StreamDataset, StreamLoader, write_dataset

SAMPLES = 480
GLOBAL_BATCH = 32  # 15 steps an epoch
EPOCHS = 2
STOP_AT = 20  # epoch 1, step 5


def prepare(workdir: str) -> str:
    data = os.path.join(workdir, "data")
    if not os.path.exists(os.path.join(data, "index.json")):
        x = np.linspace(-1, 1, SAMPLES, dtype=np.float32)
        write_dataset(({"x": float(v), "y": float(3 * v + 1)} for v in x), data)
    return data


def make_loader(workdir: str) -> StreamLoader:
    return StreamLoader(StreamDataset(os.path.join(workdir, "data"),
                                      global_batch_size=GLOBAL_BATCH, seed=0,
                                      cache_dir=os.path.join(workdir, "cache")))


def train(workdir: str, stop_at: int | None, seen: list[tuple[int, list[int]]]) -> int:
    """One run: resume from workdir/state if it is there; stop after ``stop_at`` steps."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    loader = make_loader(workdir)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert prepared is loader, "accelerate wrapped the StreamLoader"
    accelerator.register_for_checkpointing(loader)
    state_dir = os.path.join(workdir, "state")
    step = 0
    if os.path.exists(state_dir):
        accelerator.load_state(state_dir)  # model, optimizer, RNGs and the loader's cursor
        step = loader.epoch * len(loader) + len(loader) - loader.steps_remaining
    for epoch in range(loader.epoch, EPOCHS):
        for batch in loader:
            seen.append((epoch, batch["__id__"].tolist()))
            x = batch["x"].float().unsqueeze(1).to(accelerator.device)
            y = batch["y"].float().unsqueeze(1).to(accelerator.device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if stop_at is not None and step == stop_at:
                accelerator.save_state(state_dir)
                return step
    return step


def check(workdir: str, seen: list[tuple[int, list[int]]]) -> None:
    """Gather every rank's batches; rank 0 compares them with one process's global batches."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() != 0:
        return
    steps = len(everyone[0])
    global_batches = [sorted(i for rank in everyone for i in rank[t][1]) for t in range(steps)]
    reference_loader = StreamLoader(StreamDataset(
        os.path.join(workdir, "data"), global_batch_size=GLOBAL_BATCH, seed=0, rank=0,
        world_size=1, cache_dir=os.path.join(workdir, "cache")))
    reference = [sorted(b["__id__"].tolist()) for _ in range(EPOCHS) for b in reference_loader]
    assert global_batches == reference, "the global batches differ from one process's"
    for epoch in range(EPOCHS):
        ids = [i for rank in everyone for e, batch in rank if e == epoch for i in batch]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: not every sample once"
    result = {"processes": len(everyone), "steps": steps, "stopped_at": STOP_AT}
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump(result, f)
    print(f"{EPOCHS} epochs on {len(everyone)} processes, stopped at step {STOP_AT} and "
          "resumed from accelerator.save_state: every sample exactly once per epoch, the "
          "global batches of one process")


def launch(workdir: str) -> int:
    """Run this script under ``accelerate launch`` on 2 processes."""
    temp = os.path.join(workdir, "tmp")  # torchrun leaves torchelastic_* folders in TMPDIR
    os.makedirs(temp, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": temp}
    env.setdefault("HF_HOME", os.path.join(workdir, "hf"))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", os.path.abspath(__file__), "--workdir", workdir]
    return subprocess.run(command, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--prepare", action="store_true", help="write the dataset and exit")
    args = parser.parse_args(argv)
    if args.workdir is None:  # the whole demonstration, in a temporary folder
        workdir = tempfile.mkdtemp(prefix="streamcache-accelerate-")
        try:
            prepare(workdir)
            code = launch(workdir)
            print(f"removed the temporary folder {workdir}")
            return code
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.prepare:
        prepare(args.workdir)
        return 0
    seen: list[tuple[int, list[int]]] = []
    train(args.workdir, STOP_AT, seen)  # a preempted job
    train(args.workdir, None, seen)  # its restart: new model, optimizer and loader, restored
    check(args.workdir, seen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
