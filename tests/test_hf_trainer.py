"""A Hugging Face Trainer on a StreamLoader: DDP on 2 CPU processes (torchrun, gloo), rank 0
SIGKILLed mid-epoch (torchrun then ends the job), then ``train(resume_from_checkpoint=...)``.

The epoch is 15 steps of a global batch of 16 with ``gradient_accumulation_steps=2`` (8
optimizer steps an epoch, the last of one batch), so the Trainer's resume arithmetic and the
loader's cursor must agree on an epoch that does not divide. The Trainer checkpoints every 3
optimizer steps; the job is killed at step 10 (epoch 1), after the checkpoint of step 9,
and the job resumed from it. Each rank records the ``__id__``s of every batch its model receives:
the killed run up to its checkpoint plus the resumed run must be exactly the global batches
of an uninterrupted run (0 duplicated, 0 missing samples per epoch), and the Trainer must
end at the same step.

Run as a script, this file is the job (``torchrun --nproc_per_node 2 tests/test_hf_trainer.py
--help``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

SAMPLES = 240
GLOBAL_BATCH = 16  # 15 steps an epoch, 8 samples per rank a step
ACCUMULATION = 2  # 8 optimizer steps an epoch
EPOCHS = 2
SAVE_EVERY = 3
KILL_AT = 10  # epoch 1, its second optimizer step; the checkpoint of step 9 is on disk
STEPS = 15


# ---------------------------------------------------------------- the job


class Regression(torch.nn.Module):
    """Takes the batch's fields and records which samples it trained on."""

    def __init__(self, records: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.records = records

    def forward(self, x: torch.Tensor, __id__: torch.Tensor) -> dict[str, torch.Tensor]:
        with open(self.records, "a") as f:
            f.write(json.dumps(__id__.tolist()) + "\n")
        target = x.float() / SAMPLES
        return {"loss": ((self.weight * target - target) ** 2).mean()}


def job(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="one Trainer run (see the docstring)")
    for name in ("--data", "--cache", "--records", "--output"):
        parser.add_argument(name, required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    from transformers import TrainerCallback, TrainingArguments

    from streamcache import StreamDataset, StreamLoader
    from streamcache.integrations.transformers import StreamTrainer

    kill_at = args.kill_at

    class KillJob(TrainerCallback):  # a rank dies, as on a node failure
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == kill_at and state.is_world_process_zero:
                os.kill(os.getpid(), signal.SIGKILL)

    rank = int(os.environ["RANK"])
    loader = StreamLoader(StreamDataset(args.data, global_batch_size=GLOBAL_BATCH, seed=11,
                                        cache_dir=args.cache))
    training = TrainingArguments(
        output_dir=args.output, per_device_train_batch_size=GLOBAL_BATCH // 2,
        gradient_accumulation_steps=ACCUMULATION, num_train_epochs=EPOCHS,
        save_strategy="steps", save_steps=SAVE_EVERY, logging_strategy="no", report_to=[],
        use_cpu=True, ddp_backend="gloo", disable_tqdm=True, learning_rate=0.1, seed=3)
    model = Regression(os.path.join(args.records, f"rank{rank}.jsonl"))
    trainer = StreamTrainer(model=model, args=training, train_loader=loader,
                            model_inputs=["x", "__id__"], callbacks=[KillJob()])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if rank == 0:
        with open(os.path.join(args.records, "done.json"), "w") as f:
            json.dump({"global_step": trainer.state.global_step}, f)


# ---------------------------------------------------------------- the test


def _run(tmp: str, data: str, tag: str, *extra: str) -> int:
    records = os.path.join(tmp, tag)
    os.makedirs(records)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT")}
    os.makedirs(os.path.join(records, "tmp"))  # torchrun's, left when the job is killed
    env.update(HF_HOME=os.path.join(tmp, "hf"), OMP_NUM_THREADS="1",
               TRANSFORMERS_VERBOSITY="error", TMPDIR=os.path.join(records, "tmp"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", os.path.abspath(__file__), "--data", data, "--cache",
               os.path.join(tmp, "cache"), "--records", records, "--output",
               os.path.join(tmp, "output"), *extra]
    with open(os.path.join(records, "log.txt"), "wb") as log:
        # a session of its own: a timeout kills the whole job
        process = subprocess.Popen(command, env=env, cwd=tmp, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise AssertionError(f"the {tag} run timed out:\n{_log(records)}") from None


def _log(records: str) -> str:
    with open(os.path.join(records, "log.txt"), errors="replace") as f:
        return f.read()[-6000:]


def _global_batches(records: str) -> list[list[int]]:
    """Each step's global batch (rank 0's part, then rank 1's); a line cut by SIGKILL and a
    step only one rank recorded are left out."""
    per_rank = []
    for rank in (0, 1):
        parts = []
        with open(os.path.join(records, f"rank{rank}.jsonl")) as f:
            for line in f:
                try:
                    parts.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        per_rank.append(parts)
    return [a + b for a, b in zip(*per_rank, strict=False)]


@pytest.mark.timeout(600)
def test_trainer_killed_mid_epoch_resumes_exactly(tmp_path) -> None:
    from loader_helpers import make_dataset

    from streamcache import StreamDataset, StreamLoader

    tmp = str(tmp_path)
    data = make_dataset(tmp, [70, 50, 40, 80], seq=False)
    with StreamLoader(StreamDataset(data, global_batch_size=GLOBAL_BATCH, seed=11, rank=0,
                                    world_size=1, cache_dir=os.path.join(tmp, "ref"))) as ref:
        reference = [sorted(b["__id__"].tolist()) for _ in range(EPOCHS) for b in ref]
    assert len(reference) == EPOCHS * STEPS

    # rank 0 is SIGKILLed (torchrun keeps each worker in a session of its own); torchrun
    # then ends the job and exits 1
    assert _run(tmp, data, "killed", "--kill-at", str(KILL_AT)) != 0
    assert "Signal 9 (SIGKILL) received" in _log(os.path.join(tmp, "killed"))
    saved = sorted(int(p.rsplit("-", 1)[1])
                   for p in glob.glob(os.path.join(tmp, "output", "checkpoint-*")))
    assert saved[-1] == 9, saved
    with open(os.path.join(tmp, "output", "checkpoint-9", "streamcache_loader.json")) as f:
        state = json.load(f)
    # step 9: epoch 1 (8 optimizer steps an epoch), 1 optimizer step = 2 batches into it
    assert state["loader"]["cursor"]["epoch"] == 1
    assert state["loader"]["cursor"]["samples_consumed"] == 2 * GLOBAL_BATCH

    assert _run(tmp, data, "resumed", "--resume") == 0, _log(os.path.join(tmp, "resumed"))
    killed = _global_batches(os.path.join(tmp, "killed"))
    resumed = _global_batches(os.path.join(tmp, "resumed"))
    trained_before = STEPS + 2  # the batches of the checkpoint's 9 optimizer steps
    assert len(killed) >= trained_before
    combined = [sorted(b) for b in killed[:trained_before] + resumed]
    assert combined == reference, "the global batches differ from an uninterrupted run's"
    for epoch in range(EPOCHS):
        ids = [i for b in combined[epoch * STEPS:(epoch + 1) * STEPS] for i in b]
        assert len(ids) == len(set(ids)), f"duplicated samples in epoch {epoch}"
        assert set(ids) == set(range(SAMPLES)), f"missing samples in epoch {epoch}"
    with open(os.path.join(tmp, "resumed", "done.json")) as f:
        assert json.load(f) == {"global_step": EPOCHS * 8}


if __name__ == "__main__":
    job(sys.argv[1:])
