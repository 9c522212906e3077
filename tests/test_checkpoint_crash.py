"""SIGKILL a checkpointing training job at random moments; every restart must be exact.

A two-rank data-parallel training loop (dropout, so RNG states matter; AdamW, so optimizer
state matters; a StreamLoader over a small local dataset, so the cursor matters) checkpoints
every few steps
through a local tier to a root. It is killed with SIGKILL (one rank dies, the other is killed
right after, as torchrun does) during staging, during the DCP write, during the upload,
just before and just after the commit marker, or at a random time chosen by the test; then
restarted. Every time:

- every commit marker on disk is truthful (all its files present with their checksums);
- the restart loads the newest checkpoint whose marker is truthful, never a partial one;
- the final weights are bitwise equal to those of an uninterrupted run.

A second test does the same with the raw state a DCP user writes (``{"model": ddp_model,
"optim": optimizer, "loader": loader}``), killed inside a background save.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import RankGroup, run_ranks
from loader_helpers import make_dataset
from seeds import schedule_seed

from streamcache.checkpoint import Checkpointer, ModelState, commit, layout
from streamcache.format.checksum import checksum_file
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader

STEPS = 60
SAVE_EVERY = 3
BATCH = 4


def features(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, a pure function of the sample ids in the batch."""
    ids = batch["x"].to(torch.float32)
    x = torch.stack([torch.sin(ids * (k + 1)) for k in range(8)], dim=1)
    return x, torch.cos(ids).unsqueeze(1)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_kill(phase: str, nth: int) -> None:
    """Make this process SIGKILL itself inside ``phase`` at the ``nth`` time it is reached."""
    count = [0]

    def due() -> bool:
        count[0] += 1
        return count[0] == nth

    if phase == "stage":
        from torch.distributed.checkpoint.staging import DefaultStager

        original_stage = DefaultStager.stage

        def stage(self: Any, state_dict: Any, **kwargs: Any) -> Any:
            if due():
                _die()
            return original_stage(self, state_dict, **kwargs)

        DefaultStager.stage = stage  # type: ignore[method-assign]
    elif phase == "write":
        writer_cls = torch.distributed.checkpoint.FileSystemWriter
        original_write = writer_cls.write_data

        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            future = original_write(self, plan, planner)
            if due():
                future.wait()  # this rank's files are written, nothing else
                _die()
            return future

        writer_cls.write_data = write_data  # type: ignore[method-assign]
    elif phase == "upload":
        original_upload = commit.upload_file

        def upload_file(target: Any, local_file: str, name: str) -> None:
            original_upload(target, local_file, name)
            if due():
                _die()  # some files are in root, others are not

        commit.upload_file = upload_file  # type: ignore[assignment]
    elif phase in ("before-marker", "after-marker"):
        original_marker = layout.write_marker

        def write_marker(location: Any, marker: Any) -> None:
            if phase == "before-marker" and due():
                _die()
            original_marker(location, marker)
            if phase == "after-marker" and due():
                _die()  # committed, but the job dies before retention and before wait()

        layout.write_marker = write_marker


def _train(rank: int, world: int, data: list[str], root: str, local: str,
           kill: list[Any] | None, ready: str | None) -> dict[str, Any]:
    if kill is not None and kill[1] == rank:
        _install_kill(kill[0], kill[2])
    torch.manual_seed(0)  # identical initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # dropout differs per rank: RNG states must be per rank
    url, cache = data
    loader = StreamLoader(StreamDataset(url, global_batch_size=BATCH * world, cache_dir=cache,
                                        seed=3, infinite=True))
    state = {"train": ModelState(model, optimizer), "loader": loader}
    with Checkpointer(root, local_dir=local, keep_last=2) as ckpt:
        start = ckpt.load(state) or 0
        if ready is not None:  # tell the test which step this restart found
            Path(f"{ready}-{rank}").write_text(str(start))
        batches = iter(loader)
        for step in range(start, STEPS):
            x, y = features(next(batches))
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            optimizer.zero_grad()
            if (step + 1) % SAVE_EVERY == 0:
                ckpt.save(step + 1, state)
            time.sleep(0.01)  # a little compute, so that a kill at a random time lands anywhere
    loader.close()
    return {"start": start, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def truthful_markers(root: Path) -> list[int]:
    """Steps whose marker is on disk; asserts each one's files match it byte for byte."""
    steps = []
    for directory in sorted(root.iterdir()):
        marker_path = directory / layout.MARKER_NAME
        if not marker_path.exists():
            continue
        marker = json.loads(marker_path.read_bytes())["body"]
        for name, entry in marker["files"].items():
            path = directory / name
            assert path.stat().st_size == entry["size"], f"{path}: marker lies about size"
            assert checksum_file(path) == entry["checksum"], f"{path}: marker lies about bytes"
        steps.append(marker["step"])
    return steps


@pytest.mark.parametrize("kills", [3, pytest.param(7, marks=pytest.mark.slow)])
def test_sigkill_at_random_moments_restarts_exactly(tmp_path: Path, kills: int) -> None:
    """Kills in ``kills`` of the seven phases (drawn by the seed: every phase is covered
    across runs, and any run is replayed by its seed; ``-m slow`` kills in all seven)."""
    data = [make_dataset(str(tmp_path), [37, 50, 13, 60, 40], seq=False),
            str(tmp_path / "cache")]  # 200 samples: a run crosses several epochs
    reference = run_ranks(_train, 2, data, str(tmp_path / "ref"), str(tmp_path / "ref-nvme"),
                          None, None)
    expected = reference[0].value["weights"]

    seed = schedule_seed("STREAMCACHE_CRASH_SEED")
    chooser = random.Random(seed)
    seed_note = f"rerun with STREAMCACHE_CRASH_SEED={seed}:"
    phases = ["stage", "write", "upload", "before-marker", "after-marker", "time", "time"]
    chooser.shuffle(phases)
    phases = phases[:kills]
    root, local, ready = tmp_path / "root", tmp_path / "nvme", tmp_path / "ready"
    history = []
    for phase in [*phases, None]:
        newest_truthful = max(truthful_markers(root), default=0) if root.exists() else 0
        kill = None
        if phase not in (None, "time"):
            # only rank 0 writes markers; any rank stages, writes and uploads
            dying_rank = 0 if "marker" in phase else chooser.randrange(2)
            kill = [phase, dying_rank, chooser.randint(1, 3)]
        ready_files = [Path(f"{ready}-{rank}") for rank in range(2)]
        for path in ready_files:
            path.unlink(missing_ok=True)
        group = RankGroup(_train, 2, args=(data, str(root), str(local), kill, str(ready)),
                          timeout_s=90, grace_s=0.2)
        if phase == "time":
            deadline = time.monotonic() + 60
            while not ready_files[0].exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(chooser.uniform(0.0, 0.8))
            group.kill()
        results = group.join()
        started = [int(p.read_text()) if p.exists() else None for p in ready_files]
        history.append((phase, kill, newest_truthful, started))
        note = f"{seed_note} {history}\n{group.describe()}"
        # the restart found the newest checkpoint whose marker is truthful, on every rank
        assert started == [newest_truthful, newest_truthful], note
        truthful_markers(root)  # and whatever the kill interrupted left no lying marker
        if phase is None or all(r.ok for r in results):
            assert all(r.ok for r in results), note
            break
        assert any(r.killed for r in results), f"nobody was killed: {note}"
    final = results[0].value["weights"]
    assert final.keys() == expected.keys()
    for key in expected:
        assert torch.equal(final[key], expected[key]), (key, history)
    print(seed_note, history)


# ------------------------------------------------- raw DDP objects, killed inside a save

DDP_STEPS = 9


def _train_ddp(rank: int, world: int, data: list[str], root: str, kill: list[Any] | None,
               ready: str) -> dict[str, Any]:
    """The state a user who knows DCP writes: the raw DDP model, optimizer and loader."""
    from torch.nn.parallel import DistributedDataParallel

    if kill is not None and kill[1] == rank:
        _install_kill(kill[0], kill[2])
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)  # no state before its step
    torch.manual_seed(100 + rank)
    url, cache = data
    loader = StreamLoader(StreamDataset(url, global_batch_size=BATCH * world, cache_dir=cache,
                                        seed=3, infinite=True))
    state = {"model": model, "optim": optimizer, "loader": loader}
    with Checkpointer(root, keep_last=2) as ckpt:
        start = ckpt.load(state) or 0
        Path(f"{ready}-{rank}").write_text(str(start))
        batches = iter(loader)
        for step in range(start, DDP_STEPS):
            x, y = features(next(batches))
            torch.nn.functional.mse_loss(model(x), y).backward()  # DDP averages the grads
            optimizer.step()
            optimizer.zero_grad()
            if (step + 1) % SAVE_EVERY == 0:
                ckpt.save(step + 1, state)  # returns while the write is in flight
    loader.close()
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def _reference_then_resume(rank: int, world: int, data: list[str], reference_root: str,
                           root: str, ready: str) -> dict[str, Any]:
    """An uninterrupted run, then the resume of the killed one (one process start for both)."""
    return {"reference": _train_ddp(rank, world, data, reference_root, None, f"{ready}-ref"),
            "resumed": _train_ddp(rank, world, data, root, None, ready)}


def test_ddp_raw_state_killed_inside_a_save_resumes_bitwise(tmp_path: Path) -> None:
    data = [make_dataset(str(tmp_path), [37, 50, 13, 60, 40], seq=False),
            str(tmp_path / "cache")]
    root, ready = tmp_path / "root", str(tmp_path / "ready")
    # rank 1 dies in its writer thread, its files of the second save (step 6) written
    killed = RankGroup(_train_ddp, 2, args=(data, str(root), ["write", 1, 2], ready),
                       timeout_s=90, grace_s=0.2)
    results = killed.join()
    assert results[1].killed and not all(r.ok for r in results), killed.describe()
    assert max(truthful_markers(root)) == 3  # step 6 was never committed
    runs = run_ranks(_reference_then_resume, 2, data, str(tmp_path / "ref"), str(root), ready)
    assert [Path(f"{ready}-{rank}").read_text() for rank in range(2)] == ["3", "3"]
    for run in runs:
        expected, final = run.value["reference"], run.value["resumed"]
        assert final.keys() == expected.keys()
        for key in expected:
            assert torch.equal(final[key], expected[key]), key
