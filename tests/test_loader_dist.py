"""The loader's contract with real torch.distributed processes (gloo on 127.0.0.1).

- 4 -> 2 -> 3 ranks, 0 -> 2 -> 1 workers, resuming from the loader state at a random step,
  at the end of an epoch and across the epoch boundary: exactly once, equal step counts, and
  the global batches of an uninterrupted run.
- A DDP training loop killed with SIGKILL at a random step and restarted from its last saved
  state ends with the weights of an uninterrupted run: bitwise on the same world size, to
  float tolerance on another world size with the same global batch.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist import RankGroup, run_ranks
from loader_helpers import ids_of, make_dataset
from seeds import schedule_seed

from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader

GLOBAL_BATCH = 12
SAMPLES = 200


def _phase(rank: int, world: int, url: str, cache: str, state: dict | None, steps: int | None,
           workers: int, extra_epoch_steps: int) -> dict[str, Any]:
    """Read ``steps`` steps (None: to the end of the epoch, then ``extra_epoch_steps`` of the
    next) from ``state``; rank and world size come from the process group."""
    dataset = StreamDataset(url, global_batch_size=GLOBAL_BATCH, cache_dir=cache, seed=7)
    assert (dataset.rank, dataset.world_size) == (rank, world)
    loader = StreamLoader(dataset, num_workers=workers, worker_mode="process")
    if state is not None:
        loader.load_state_dict(state)
    batches: list[list[int]] = []
    for batch in loader:
        batches.append(ids_of(batch).tolist())
        if steps is not None and len(batches) == steps:
            break
    if steps is None and extra_epoch_steps:
        for batch in loader:  # iterating again: the next epoch
            batches.append(ids_of(batch).tolist())
            if len(batches) == len(dataset) + extra_epoch_steps:
                break
    counts = torch.tensor([len(batches)])
    low, high = counts.clone(), counts.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    states: list[Any] = [None] * world
    dist.all_gather_object(states, loader.state_dict())
    loader.close()
    return {"batches": batches, "steps_equal": bool(low == high),
            "states_equal": all(s == states[0] for s in states), "state": states[0]}


def _global(results: list[Any]) -> list[np.ndarray]:
    per_rank = [r.value["batches"] for r in results]
    assert all(r.value["steps_equal"] and r.value["states_equal"] for r in results)
    return [np.concatenate([rank[t] for rank in per_rank]) for t in range(len(per_rank[0]))]


@pytest.mark.slow  # 30 s; .ci/run runs it. The default suite resumes on other world sizes in
# test_checkpoint_loader.py and test_plan_steps.py (every schedule, with workers)
def test_elastic_resume_4_2_3_ranks_with_workers(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [37, 50, 13, 60, 40])
    cache = str(tmp_path / "cache")
    reference_loader = StreamLoader(StreamDataset(url, global_batch_size=GLOBAL_BATCH, rank=0,
                                                  world_size=1, cache_dir=cache, seed=7))
    epoch0 = [ids_of(b) for b in reference_loader]
    epoch1 = [ids_of(b) for b in reference_loader]
    steps_per_epoch = len(epoch0)  # 16: 200 // 12, the partial batch is dropped
    first = random.Random(schedule_seed("STREAMCACHE_RESUME_SEED")).randint(1, steps_per_epoch - 3)

    phase1 = run_ranks(_phase, 4, url, cache, None, first, 0, 0)
    state = phase1[0].value["state"]
    assert state["cursor"]["samples_consumed"] == first * GLOBAL_BATCH
    phase2 = run_ranks(_phase, 2, url, cache, state, steps_per_epoch - first, 2, 0)
    state = phase2[0].value["state"]  # taken after the epoch's last step
    assert (state["cursor"]["epoch"], state["cursor"]["samples_consumed"]) == (1, 0)
    phase3 = run_ranks(_phase, 3, url, cache, state, 3, 1, 0)

    got = _global(phase1) + _global(phase2)
    assert len(got) == steps_per_epoch
    assert all(np.array_equal(a, b) for a, b in zip(got, epoch0, strict=True))
    seen = np.concatenate(got)
    assert len(seen) == len(set(seen.tolist())) == steps_per_epoch * GLOBAL_BATCH
    assert all(np.array_equal(a, b) for a, b in zip(_global(phase3), epoch1[:3], strict=True))


def _iterate_given(rank: int, world: int, dataset: StreamDataset) -> list[list[int]]:
    """Iterate a dataset made in the parent process, before any process group existed."""
    with StreamLoader(dataset) as loader:
        return [ids_of(batch).tolist() for batch in loader]


def test_a_loader_made_before_the_process_group_reads_its_own_rank(tmp_path) -> None:
    """Made (and sent to the ranks) before init_process_group, as in a LightningModule's
    __init__: each rank reads its own part of every global batch, not all of it."""
    url = make_dataset(str(tmp_path), [37, 50, 13, 60, 40])
    cache = str(tmp_path / "cache")
    dataset = StreamDataset(url, global_batch_size=GLOBAL_BATCH, cache_dir=cache, seed=7)
    results = run_ranks(_iterate_given, 2, dataset)
    per_rank = [r.value for r in results]
    assert len(per_rank[0]) == len(per_rank[1]) == SAMPLES // GLOBAL_BATCH
    assert all(len(batch) == GLOBAL_BATCH // 2 for batches in per_rank for batch in batches)
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert len(seen) == len(set(seen)) == SAMPLES // GLOBAL_BATCH * GLOBAL_BATCH


# ---------------------------------------------------------------- the training loop


def _features(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x = batch["x"].to(torch.float64)
    features = torch.stack([torch.sin(x), torch.cos(x / 7), (x % 10) / 10, torch.ones_like(x)],
                           dim=1).float()
    target = (torch.sin(x / 3) > 0).float().unsqueeze(1)
    return features, target


def _train(rank: int, world: int, url: str, cache: str, ckpt: str, total_steps: int,
           step_sleep: float) -> dict[str, Any]:
    """Train to ``total_steps``, resuming from ``ckpt`` if present, saving every 2 steps."""
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = StreamLoader(StreamDataset(url, global_batch_size=GLOBAL_BATCH, cache_dir=cache,
                                        seed=11, infinite=True))
    step = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])
        step = saved["step"]
    for batch in loader:
        if step == total_steps:
            break
        features, target = _features(batch)
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(features), target)
        loss.backward()
        optimizer.step()
        step += 1
        if step % 2 == 0 and rank == 0:
            tmp = f"{ckpt}.tmp"
            torch.save({"model": model.module.state_dict(), "optimizer":
                        optimizer.state_dict(), "loader": loader.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)  # the state of every rank is the same: rank 0 saves it
        if rank == 0:
            with open(f"{ckpt}.progress", "w") as f:
                f.write(str(step))
        dist.barrier()
        time.sleep(step_sleep)
    loader.close()
    return {"weights": [p.detach().clone() for p in model.module.parameters()]}


def _progress(ckpt: str) -> int:
    try:
        with open(f"{ckpt}.progress") as f:
            return int(f.read() or 0)
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.slow  # 25 s; .ci/run runs it. The default suite SIGKILLs training ranks in
@pytest.mark.timeout(240)  # test_checkpoint_crash.py
def test_sigkilled_training_resumes_to_the_same_weights(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [37, 50, 13, 60, 40], seq=False)
    cache = str(tmp_path / "cache")
    total = 40  # 16 steps an epoch: the run crosses two epoch boundaries
    reference = run_ranks(_train, 2, url, cache, str(tmp_path / "ref.pt"), total, 0.0)
    expected = reference[0].value["weights"]

    ckpt = str(tmp_path / "run.pt")
    kill_at = random.Random(schedule_seed("STREAMCACHE_KILL_SEED")).randint(3, total - 5)
    with RankGroup(_train, 2, args=(url, cache, ckpt, total, 0.05), fail_fast=False) as group:
        deadline = time.monotonic() + 120
        while _progress(ckpt) < kill_at and time.monotonic() < deadline:
            time.sleep(0.01)
        group.kill()
    assert all(r.killed for r in group.results), "the run finished before it was killed"
    resumed_from = torch.load(ckpt, weights_only=False)["step"]
    assert 0 < resumed_from < total
    single_ckpt = str(tmp_path / "single.pt")
    shutil.copyfile(ckpt, single_ckpt)  # the resumed run below overwrites ckpt

    resumed = run_ranks(_train, 2, url, cache, ckpt, total, 0.0)
    for got, want in zip(resumed[0].value["weights"], expected, strict=True):
        assert torch.equal(got, want), f"resumed from step {resumed_from}: weights differ"

    # the same checkpoint on one rank with the same global batch: equal up to float rounding
    single = run_ranks(_train, 1, url, cache, single_ckpt, total, 0.0)
    assert torch.load(single_ckpt, weights_only=False)["step"] == total
    for got, want in zip(single[0].value["weights"], expected, strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
