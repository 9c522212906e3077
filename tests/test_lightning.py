"""StreamLoader under a real PyTorch Lightning Trainer: DDP on 2 CPU processes (gloo).

The loader is made in the LightningModule's ``__init__`` (before the process group exists;
Lightning's launcher starts the second process by running this file again with
``LOCAL_RANK=1``). Three runs of the same job:

- uninterrupted: 3 epochs;
- killed: every process of the job SIGKILLed mid-epoch, a few steps after Lightning's own
  ``ModelCheckpoint(every_n_train_steps=...)`` saved;
- resumed from that checkpoint with ``ckpt_path=``: Lightning restores the loader through
  its stateful-dataloader support (``state_dict``/``load_state_dict``).

Each rank records the ``__id__``s of every batch it trains on. The killed run up to its
checkpoint plus the resumed run must train on exactly the global batches of the
uninterrupted run (0 duplicated, 0 missing samples per epoch), and Lightning's epoch counter
must end where the uninterrupted run's does.

Run as a script, this file is the job itself (``python tests/test_lightning.py --help``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
from typing import Any

import lightning as L
import pytest
import torch

from streamcache import StreamDataset, StreamLoader

SAMPLES = 240
GLOBAL_BATCH = 16  # 15 steps an epoch, 8 samples per rank a step
EPOCHS = 3
SAVE_EVERY = 6  # Lightning checkpoints at global steps 6, 12, 18, ...
KILL_AT = 20  # mid-epoch 1 (its 6th step), two steps after the checkpoint of step 18


# ---------------------------------------------------------------- the job


class StreamModule(L.LightningModule):
    """A tiny regression whose loader is made here, in __init__, as users write it."""

    def __init__(self, data: str, cache: str, records: str, tag: str, kill_at: int) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.loader = StreamLoader(StreamDataset(data, global_batch_size=GLOBAL_BATCH, seed=5,
                                                 cache_dir=cache))
        self.records, self.tag, self.kill_at = records, tag, kill_at

    def train_dataloader(self) -> StreamLoader:
        return self.loader

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        record = {"epoch": self.current_epoch, "step": self.global_step,
                  "ids": batch["__id__"].tolist()}
        path = os.path.join(self.records, f"{self.tag}-rank{self.global_rank}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        x = batch["x"].float().unsqueeze(1) / SAMPLES
        return ((self.net(x) - x) ** 2).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # ModelCheckpoint's hook has run (callbacks before the module): the checkpoint of a
        # step that is a multiple of SAVE_EVERY is on disk. Kill the whole job, like a node
        # failure: this process, and the one Lightning started, are in one process group.
        if self.global_step == self.kill_at and self.global_rank == 0:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def job(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="one Lightning DDP run (see the docstring)")
    for name in ("--data", "--cache", "--records", "--root", "--tag"):
        parser.add_argument(name, required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--ckpt-path", default=None)
    args = parser.parse_args(argv)
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = StreamModule(args.data, args.cache, args.records, args.tag, args.kill_at)
    trainer = L.Trainer(
        strategy="ddp", devices=2, accelerator="cpu", max_epochs=EPOCHS,
        default_root_dir=args.root, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.root, "checkpoints"),
                                   every_n_train_steps=SAVE_EVERY, save_top_k=-1)],
    )
    trainer.fit(model, ckpt_path=args.ckpt_path)
    done = {"epoch": trainer.current_epoch, "global_step": trainer.global_step}
    with open(os.path.join(args.records, f"{args.tag}-done-rank{trainer.global_rank}.json"),
              "w") as f:
        json.dump(done, f)


# ---------------------------------------------------------------- the test


def _start(tmp: str, data: str, tag: str, *extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                        "MASTER_ADDR", "MASTER_PORT")}
    root = os.path.join(tmp, tag)
    os.makedirs(root)
    command = [sys.executable, os.path.abspath(__file__), "--data", data, "--cache",
               os.path.join(tmp, "cache"), "--records", os.path.join(tmp, "records"),
               "--root", root, "--tag", tag, *extra]
    with open(os.path.join(root, "log.txt"), "wb") as log:
        # a session of its own: the killed job's processes are one group, killed together
        return subprocess.Popen(command, env=env, cwd=tmp, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait(process: subprocess.Popen[bytes], tmp: str, tag: str) -> int:
    try:
        return process.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise AssertionError(f"the {tag} run timed out:\n{_log(tmp, tag)}") from None


def _log(tmp: str, tag: str) -> str:
    with open(os.path.join(tmp, tag, "log.txt"), errors="replace") as f:
        return f.read()[-6000:]


def _records(tmp: str, tag: str) -> dict[int, dict[int, list[int]]]:
    """rank -> global step -> ids (a line cut by SIGKILL is left out)."""
    out: dict[int, dict[int, list[int]]] = {}
    for rank in (0, 1):
        steps: dict[int, list[int]] = {}
        with open(os.path.join(tmp, "records", f"{tag}-rank{rank}.jsonl")) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                assert record["step"] not in steps, f"{tag}: rank {rank} trained step twice"
                steps[record["step"]] = record["ids"]
        out[rank] = steps
    return out


def _global_batches(per_rank: dict[int, dict[int, list[int]]]) -> dict[int, list[int]]:
    assert per_rank[0].keys() == per_rank[1].keys(), "ranks trained different steps"
    for steps in per_rank.values():
        assert all(len(ids) == GLOBAL_BATCH // 2 for ids in steps.values())
    return {step: per_rank[0][step] + per_rank[1][step] for step in sorted(per_rank[0])}


def _done(tmp: str, tag: str) -> list[dict[str, int]]:
    results = []
    for rank in (0, 1):
        with open(os.path.join(tmp, "records", f"{tag}-done-rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


# Three jobs of two processes, about a minute: slow (.ci/run runs it); the default suite
# stops and resumes Lightning DDP in examples/lightning_train.py (test_examples.py).
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lightning_ddp_killed_mid_epoch_resumes_exactly(tmp_path) -> None:
    from loader_helpers import make_dataset

    tmp = str(tmp_path)
    os.makedirs(os.path.join(tmp, "records"))
    data = make_dataset(tmp, [70, 50, 40, 80], seq=False)
    steps_per_epoch = SAMPLES // GLOBAL_BATCH

    full = _start(tmp, data, "full")
    killed = _start(tmp, data, "killed", "--kill-at", str(KILL_AT))
    assert _wait(full, tmp, "full") == 0, _log(tmp, "full")
    assert _wait(killed, tmp, "killed") == -signal.SIGKILL, _log(tmp, "killed")

    saved = {int(re.search(r"step=(\d+)", path).group(1)): path  # type: ignore[union-attr]
             for path in glob.glob(os.path.join(tmp, "killed", "checkpoints", "*.ckpt"))}
    last = max(saved)
    assert last == KILL_AT // SAVE_EVERY * SAVE_EVERY  # step 18: epoch 1, 3 steps in
    checkpoint = torch.load(saved[last], weights_only=False, map_location="cpu")
    loader_state = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state[0]["cursor"]["epoch"] == last // steps_per_epoch
    assert loader_state[0]["cursor"]["samples_consumed"] == last % steps_per_epoch * GLOBAL_BATCH

    resumed = _start(tmp, data, "resumed", "--ckpt-path", saved[last])
    assert _wait(resumed, tmp, "resumed") == 0, _log(tmp, "resumed")

    reference = _global_batches(_records(tmp, "full"))
    assert sorted(reference) == list(range(EPOCHS * steps_per_epoch))
    before = {s: ids for s, ids in _global_batches(_records(tmp, "killed")).items() if s < last}
    after = _global_batches(_records(tmp, "resumed"))
    assert min(after) == last, "the resumed run must continue at the checkpoint's step"
    combined = {**before, **after}
    assert sorted(combined) == sorted(reference)
    assert all(combined[step] == reference[step] for step in reference), \
        "the global batches differ from the uninterrupted run's"
    for epoch in range(EPOCHS):
        ids = [i for step in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
               for i in combined[step]]
        assert len(ids) - len(set(ids)) == 0, f"duplicated samples in epoch {epoch}"
        assert set(range(SAMPLES)) - set(ids) == set(), f"missing samples in epoch {epoch}"
    expected_end = {"epoch": EPOCHS, "global_step": EPOCHS * steps_per_epoch}
    assert _done(tmp, "full") == _done(tmp, "resumed") == [expected_end, expected_end]


class _Tiny(L.LightningModule):
    def __init__(self, loader: StreamLoader) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.loader = loader

    def train_dataloader(self) -> StreamLoader:
        return self.loader

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        x = batch["x"].float().unsqueeze(1) / SAMPLES
        return ((self.net(x) - x) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")  # Lightning's own
def test_stream_stats_callback_logs_the_loaders_statistics(tmp_path) -> None:
    """One line in the Trainer's callbacks: the loader's statistics reach Lightning's
    logging (callback_metrics, and so any logger) at the Trainer's steps."""
    from loader_helpers import make_dataset

    from streamcache.integrations.lightning import StreamStats

    data = make_dataset(str(tmp_path), [60, 60], seq=False)
    loader = StreamLoader(StreamDataset(data, global_batch_size=GLOBAL_BATCH, seed=1,
                                        cache_dir=str(tmp_path / "cache")))
    stats = StreamStats(every_n_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                        default_root_dir=str(tmp_path), enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[stats])
    trainer.fit(_Tiny(loader))
    metrics = trainer.callback_metrics
    assert stats.loader is loader  # found as the Trainer's train loader
    assert {"streamcache/wait_ms_per_step", "streamcache/ready_fraction",
            "streamcache/bytes_fetched", "streamcache/steps"} <= set(metrics)
    assert float(metrics["streamcache/steps"]) == 2  # each report covers its 2 steps
    loader.close()



def _fit_with_stats(tmp_path: Any, stats: Any, log_every_n_steps: int) -> list[float]:
    """Fit 6 steps with ``stats`` and a CSV logger; the ``streamcache/steps`` values the
    logger wrote (each report's count of steps)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger
    from loader_helpers import make_dataset

    data = make_dataset(str(tmp_path), [60, 60], seq=False)
    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    with StreamLoader(StreamDataset(data, global_batch_size=GLOBAL_BATCH, seed=1,
                                    cache_dir=str(tmp_path / "cache"))) as loader:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=logger,
                            log_every_n_steps=log_every_n_steps,
                            default_root_dir=str(tmp_path), enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            callbacks=[stats])
        trainer.fit(_Tiny(loader))
    path = os.path.join(logger.log_dir, "metrics.csv")
    if not os.path.exists(path):  # nothing was written
        return []
    with open(path) as f:
        return [float(row["streamcache/steps"]) for row in csv.DictReader(f)
                if row.get("streamcache/steps")]


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")  # Lightning's own
def test_stream_stats_reports_reach_the_logger_at_the_trainers_cadence(tmp_path) -> None:
    """StreamStats() reported every 50 batches whatever the Trainer's log_every_n_steps, and
    Lightning writes logged values only every log_every_n_steps steps: most reports were
    dropped (with every_n_steps=20 and the default 50, four in five)."""
    from streamcache.integrations.lightning import StreamStats

    assert _fit_with_stats(tmp_path, StreamStats(), log_every_n_steps=3) == [3.0, 3.0]


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")  # Lightning's own
def test_stream_stats_at_steps_the_logger_would_drop_are_refused(tmp_path) -> None:
    from streamcache import ConfigError
    from streamcache.integrations.lightning import StreamStats

    with pytest.raises(ConfigError, match=r"every_n_steps=2\).*log_every_n_steps=3"):
        _fit_with_stats(tmp_path, StreamStats(every_n_steps=2), log_every_n_steps=3)

if __name__ == "__main__":
    job(sys.argv[1:])
