"""The check behind benchmarks/bench_replica_chaos.py's "every sample committed exactly once".

The benchmark's groups write a read line (the ledger before the step, the ids read) and a
commit line (the ledger before and after, the committed groups) per step; ``analyze`` walks
the history that survived back from its furthest state. These logs are made with real
``ReplicaLoader`` objects and a scripted quorum (no torchft here): a clean history passes,
a group that trained alone off the surviving history is not counted, and a sample read twice
or never is reported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_replica_chaos as bench
from bench_chaos import BATCH, make_data

from streamcache import StreamDataset
from streamcache.replicas import ReplicaLoader

GROUPS = 3
STEPS_PER_EPOCH = 3


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("replica-chaos")
    make_data(folder, GROUPS * BATCH * STEPS_PER_EPOCH)
    return folder


def _loaders(data_dir: Path) -> list[ReplicaLoader]:
    return [ReplicaLoader(StreamDataset(str(data_dir / "ds"), batch_size=BATCH, rank=0,
                                        world_size=1, seed=bench.SEED),
                          num_groups=GROUPS, group=g, prefetch=False)
            for g in range(GROUPS)]


def _history(data_dir: Path, committed_per_step: list[list[int]],
             lone_step: int | None = None) -> tuple[list[list[dict[str, Any]]], int]:
    """Logs of every group for the given committed sets (every group up and reading), and
    the samples committed (padding excluded). At ``lone_step`` group 2 also commits a step
    alone (a quorum of its own) that is then overwritten: it heals from a peer's state, as
    torchft does."""
    loaders = _loaders(data_dir)
    logs: list[list[dict[str, Any]]] = [[] for _ in range(GROUPS)]
    t, total = 0.0, 0
    for step, committed in enumerate(committed_per_step):
        before = json.dumps(loaders[0].ledger.to_dict(), sort_keys=True)
        for g, loader in enumerate(loaders):
            batch = loader.next_batch()
            while batch is None:
                batch = loader.next_batch()
            before = json.dumps(loader.ledger.to_dict(), sort_keys=True)
            ids = [int(i) for i, pad in zip(batch["__id__"].tolist(),
                                             batch["__padding__"].tolist(), strict=True)
                   if not pad]
            logs[g].append({"kind": "read", "before": before, "ids": ids, "pid": g})
            total += len(ids) if g in committed else 0
        if step == lone_step:
            alone = loaders[2].ledger.committed(loaders[2].plan, [2])
            logs[2].append({"kind": "commit", "t": t, "pid": 2, "epoch": alone.epoch,
                            "step": step, "before": before, "committed": [2],
                            "state": json.dumps(alone.to_dict(), sort_keys=True)})
        t += 1.0
        for g, loader in enumerate(loaders):
            epoch, at = loader.ledger.epoch, loader.ledger.step
            loader.commit(committed)
            logs[g].append({"kind": "commit", "t": t, "pid": g, "epoch": epoch, "step": at,
                            "before": before, "committed": committed,
                            "state": json.dumps(loader.ledger.to_dict(), sort_keys=True)})
    return logs, total


def _analyze(logs: list[list[dict[str, Any]]], data_dir: Path) -> dict[str, Any]:
    return bench.analyze(logs, [], 0.0, 1e9, data_dir, GROUPS)


def test_a_history_with_failed_groups_commits_every_sample_once(data_dir: Path) -> None:
    everyone = list(range(GROUPS))
    steps = [everyone, [0, 2], everyone, [], [0, 1], everyone, everyone, everyone, everyone,
             everyone]
    logs, total = _history(data_dir, steps)
    result = _analyze(logs, data_dir)
    finished = [e for e in result["epochs"] if e["finished"]]
    assert len(finished) >= 2
    for epoch in result["epochs"]:
        assert epoch["duplicated"] == 0 and epoch["foreign"] == 0, epoch
    for epoch in finished:
        assert epoch["lost"] == 0, epoch
    assert result["committed_samples"] == total
    assert total < sum(len(c) for c in steps) * BATCH  # a makeup step padded some groups
    assert result["chain_steps"] == len(steps)


def test_a_lone_quorum_off_the_surviving_history_is_not_counted(data_dir: Path) -> None:
    everyone = list(range(GROUPS))
    steps = [everyone] * 7
    logs, total = _history(data_dir, steps, lone_step=1)
    result = _analyze(logs, data_dir)
    assert result["committed_samples"] == total == 7 * GROUPS * BATCH
    assert all(e["duplicated"] == 0 for e in result["epochs"])


def test_a_sample_read_twice_or_never_is_reported(data_dir: Path) -> None:
    everyone = list(range(GROUPS))
    logs, _ = _history(data_dir, [everyone] * 7)
    first, second = logs[0][0], logs[1][0]  # step 0's reads of groups 0 and 1
    assert first["kind"] == second["kind"] == "read"
    second["ids"] = [first["ids"][0], *second["ids"][1:]]
    result = _analyze(logs, data_dir)
    assert result["epochs"][0]["duplicated"] == 1
    assert result["epochs"][0]["lost"] == 1
