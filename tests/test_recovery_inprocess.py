"""Survivors stay up: the loader and the Checkpointer under NVIDIA Resiliency Extension's
in-process restart (``nvidia_resiliency_ext.inprocess.Wrapper``), 2 gloo ranks.

Rank 1 raises inside a step. NVRx aborts the process groups and calls the training function
again in both processes, which keep their model, optimizer, dataset and loader. The function
makes a new process group and a new Checkpointer, loads the memory tier's newest snapshot and
goes on. Checked: one restart, the roll back to the last snapshot, the same global batches as a
run without a fault, no sample twice in the final trajectory, and no stale loader threads.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dist import RankGroup

from streamcache import ShardWriter, StreamDataset, StreamLoader
from streamcache.gloo_links import GlooLinks

inprocess = pytest.importorskip("nvidia_resiliency_ext.inprocess")

SAMPLES, PER_RANK, STEPS, FAULT_STEP, SNAPSHOT_EVERY = 256, 8, 12, 7, 2


def _dataset(path: Path) -> None:
    with ShardWriter(str(path)) as writer:
        for i in range(SAMPLES):
            writer.write({"x": np.full(4, (i % 7) / 7, dtype=np.float32), "y": i % 3})


def _train_under_nvrx(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from streamcache.checkpoint import Checkpointer, ModelState
    from streamcache.checkpoint.memory import MemoryOptions

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = StreamLoader(StreamDataset(f"{tmp}/data", batch_size=PER_RANK, seed=1,
                                        infinite=True))
    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore("127.0.0.1", port + 1, world_size, is_master=rank == 0,
                          multi_tenant=True, wait_for_workers=True, use_libuv=True)
    seen: list[tuple[int, int, list[int]]] = []  # (iteration, step, ids)
    resumed: list[int] = []
    errors: list[str] = []
    failed_at: list[float] = []  # when each fault was raised or seen, time.time()

    def abort_groups() -> None:  # close gloo connections: peers stop waiting at once
        if dist.is_initialized():
            for group in list(dist.distributed_c10d._world.pg_names):
                with contextlib.suppress(Exception):
                    dist.distributed_c10d._abort_process_group(group)

    class AbortGloo(inprocess.abort.Abort):
        def __call__(self, state: Any) -> Any:
            abort_groups()
            return state

    def train(call_wrapper: Any = None) -> None:
        iteration = call_wrapper.iteration
        # the connections of the training group and of the Checkpointer's groups, which the
        # rank that fails shuts down (the stores' connections are kept)
        with GlooLinks.track(keep_ports=[port + 1, port + 2]) as links:
            dist.init_process_group("gloo", store=dist.PrefixStore(str(iteration), store),
                                    rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=20))
            checkpointer = Checkpointer(f"{tmp}/root",
                                        memory=MemoryOptions(directory=f"{tmp}/shm"),
                                        job_id="test")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = {"train": ModelState(model, optimizer), "loader": loader}
        with checkpointer as ckpt:
            step = ckpt.load(state) or 0
            resumed.append(step)
            try:
                for batch in loader:
                    loss = ddp(batch["x"]).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    if iteration == 0 and rank == 1 and step + 1 == FAULT_STEP:
                        raise RuntimeError("a fault inside the step")
                    optimizer.step()
                    step += 1
                    seen.append((iteration, step, [int(i) for i in batch["__id__"]]))
                    if step % SNAPSHOT_EVERY == 0:
                        ckpt.snapshot(step, state)
                    if step == STEPS:
                        break
            except BaseException as exc:
                failed_at.append(time.time())
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                links.shutdown()  # the peer's blocked collective fails now, not at its timeout
                abort_groups()
                raise
        dist.destroy_process_group()

    train.__annotations__["call_wrapper"] = inprocess.CallWrapper
    fast = datetime.timedelta(milliseconds=50)
    inprocess.Wrapper(
        store_kwargs={"port": port + 2}, monitor_thread_interval=fast,
        monitor_process_interval=fast, progress_watchdog_interval=fast,
        last_call_wait=datetime.timedelta(milliseconds=100), health_check=None,
        abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), AbortGloo()),
    )(train)()
    loader_threads = sum(t.name.startswith("streamcache-loader") for t in threading.enumerate())
    loader.close()
    return {"seen": seen, "resumed": resumed, "loader_threads": loader_threads, "errors": errors,
            "failed_at": failed_at, "weights": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.slow  # two spawned ranks, NVRx's monitor processes and a restart: 20-60 s here
def test_a_raised_fault_restarts_in_process_from_the_memory_tier_with_the_same_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/recovery.md's recipe: no reverse name lookup in the store's timeout warnings
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
    _dataset(tmp_path / "data")
    (tmp_path / "shm").mkdir()
    with RankGroup(_train_under_nvrx, 2, args=(str(tmp_path),), backend=None,
                   timeout_s=240, start_method="spawn") as group:  # (the log level above)
        pass
    results = group.join(check=True)
    clean = StreamDataset(str(tmp_path / "data"), batch_size=2 * PER_RANK, seed=1,
                          infinite=True, rank=0, world_size=1)
    expected = {}
    for step, batch in enumerate(StreamLoader(clean), start=1):
        expected[step] = sorted(int(i) for i in batch["__id__"])
        if step == STEPS:
            break
    last_snapshot = (FAULT_STEP - 1) // SNAPSHOT_EVERY * SNAPSHOT_EVERY
    final: dict[int, list[int]] = {}
    for result in results:
        value = result.value
        assert value["resumed"] == [0, last_snapshot]        # one restart, rolled back
        assert {it for it, _, _ in value["seen"]} == {0, 1}
        for _, step, _ids in value["seen"]:                   # the last execution counts
            final.setdefault(step, [])
        by_step = {step: ids for _, step, ids in value["seen"]}
        for step, ids in by_step.items():
            final[step] = sorted(final[step] + ids)
        assert value["loader_threads"] <= 2                   # no stale reader threads
        assert len(value["errors"]) == 1                      # one fault, seen once per rank
    assert "a fault inside the step" in results[1].value["errors"][0]
    # The survivor's blocked collective ends on the connection the failed rank shut down
    # (GlooLinks), not at the group's 20 s timeout.
    survivor = results[0].value
    assert "closed" in survivor["errors"][0].lower(), survivor["errors"]
    assert survivor["failed_at"][0] - results[1].value["failed_at"][0] < 5.0
    assert final == expected
    everything = [i for ids in final.values() for i in ids]
    assert len(everything) == len(set(everything))            # no sample twice
    for a, b in zip(results[0].value["weights"], results[1].value["weights"], strict=True):
        assert a.equal(b)                                     # the ranks stayed in step
    assert not any((tmp_path / "shm").rglob("rank*"))         # a clean finish removes them
