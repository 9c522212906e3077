"""The replica loader with real data, real processes (gloo on 127.0.0.1) and the Checkpointer.

- Four replica groups replay a quorum trace (tests/replica_sim.py): groups drop out before
  or during a step, two at once, rejoin (two at once) with the state of a live peer sent
  through the process group, steps are discarded, and a group fails in the last step of
  every epoch. Every sample of every epoch is committed exactly once, and every batch read,
  a rejoining group's first included, is the one the pure plan assigns to it at that step.
- The state resumes through the Checkpointer, and loading it is strict.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from dist import run_ranks
from loader_helpers import make_dataset
from replica_sim import TraceStep, expected, group_main, make_trace

from streamcache.checkpoint import Checkpointer
from streamcache.dataset import StreamDataset
from streamcache.plan import CursorMismatchError, EpochOrder, ShuffleOptions
from streamcache.replicas import (
    PAD_SLICE,
    ReplicaError,
    ReplicaLoader,
    ReplicaPlan,
    positions_of,
)

GROUPS = 4
PER_RANK = 2
SEED = 11


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = str(tmp_path_factory.mktemp("replicas"))
    return make_dataset(folder, [37, 50, 13, 60, 40], seq=False), folder + "/cache"  # 200


def make_loader(url: str, cache: str, group: int = 0, **options: object) -> ReplicaLoader:
    dataset = StreamDataset(url, batch_size=PER_RANK, rank=0, world_size=1, cache_dir=cache,
                            seed=SEED, **options)
    return ReplicaLoader(dataset, num_groups=GROUPS, group=group)


def epoch_ids(url: str, epoch: int, plan: ReplicaPlan) -> np.ndarray:
    dataset = StreamDataset(url, batch_size=PER_RANK, rank=0, world_size=1, seed=SEED)
    order = EpochOrder(dataset.index.shard_rows, SEED, epoch, ShuffleOptions())
    return order.sample_ids(0, plan.num_samples // plan.global_batch * plan.global_batch)


def test_four_groups_drop_and_rejoin_exactly_once(data: tuple[str, str]) -> None:
    url, cache = data
    plan = ReplicaPlan(200, GROUPS * PER_RANK, GROUPS)
    everyone = frozenset(range(GROUPS))
    scripted = {  # the cases the issue names, at fixed steps; the rest is random
        3: TraceStep(everyone, everyone - {1}),                      # 1 fails during a step
        6: TraceStep(frozenset({0, 3}), frozenset({0, 3})),          # 2 and (still) 1 down
        7: TraceStep(everyone, everyone),                            # 1 and 2 rejoin at once
        9: TraceStep(everyone, frozenset(), discard=True),
    }
    trace = make_trace(plan, epochs=2, seed=5, scripted=scripted)
    ledgers = expected(plan, trace)
    last_steps = [t for t in range(len(trace)) if ledgers[t + 1].epoch > ledgers[t].epoch]
    assert any(trace[t].committed != trace[t].up for t in last_steps), \
        "the trace must fail a group during the last step of an epoch"

    results = run_ranks(group_main, GROUPS, url, cache, {"per_rank": PER_RANK, "seed": SEED},
                        trace, timeout_s=120)

    orders = {e: EpochOrder(StreamDataset(url, batch_size=PER_RANK, rank=0, world_size=1)
                            .index.shard_rows, SEED, e, ShuffleOptions()) for e in (0, 1)}
    committed: dict[int, list[int]] = {0: [], 1: []}
    rejoins = 0
    for group, result in enumerate(results):
        for record in result.value["steps"]:
            t = record["t"]
            ledger = ledgers[t]
            assert record["epoch"] == ledger.epoch
            assert record["slice"] == ledger.assignment(plan)[group]
            want = orders[ledger.epoch].samples_at(positions_of(plan, ledger, group))[0]
            assert record["ids"] == want.tolist(), f"group {group} read the wrong batch at {t}"
            assert record["padding"] == [record["slice"] == PAD_SLICE] * PER_RANK
            rejoins += record["rejoined"]
            if "committed" in record:
                assert record["committed_set"] == sorted(trace[t].committed)
                if record["committed"] and record["slice"] != PAD_SLICE:
                    committed[ledger.epoch].extend(record["ids"])
    assert rejoins >= 4
    for epoch in (0, 1):
        counts = Counter(committed[epoch])
        assert max(counts.values()) == 1, f"epoch {epoch}: a sample was committed twice"
        assert sorted(counts) == sorted(epoch_ids(url, epoch, plan).tolist()), \
            f"epoch {epoch}: samples were lost"
    # every live rank holds the same state after every step
    digests: dict[int, set[str]] = {}
    for result in results:
        for record in result.value["steps"]:
            if "state" in record:
                digests.setdefault(record["t"], set()).add(record["state"])
    assert all(len(d) == 1 for d in digests.values())
    sizes = [tr["bytes"] for r in results for tr in r.value["transfers"]]
    assert sizes and max(sizes) < 600, sizes


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_state_resumes_through_the_checkpointer(data: tuple[str, str], tmp_path: Path) -> None:
    url, cache = data
    loader = make_loader(url, cache, group=2)
    history = [{0, 1, 2, 3}, {0, 1, 3}, {0, 1}, set(), {0, 1}]
    for groups in history:
        loader.next_batch()
        loader.commit(groups)
    with Checkpointer(tmp_path / "ckpt", async_mode="sync") as ckpt:
        ckpt.save(len(history), {"loader": loader})
        resumed = make_loader(url, cache, group=2)
        assert ckpt.load({"loader": resumed}) == len(history)
    assert resumed.ledger == loader.ledger and resumed.ledger.pending
    saved = [json.loads(p.read_text()) for p in (tmp_path / "ckpt").rglob("global.json")]
    assert [s["states"]["loader"] for s in saved] == [loader.state_dict()]  # saved once
    for _ in range(3):
        a, b = loader.next_batch(), resumed.next_batch()
        assert a["__id__"].tolist() == b["__id__"].tolist()
        loader.commit({0, 1, 2, 3})
        resumed.commit({0, 1, 2, 3})
    loader.close()
    resumed.close()


def test_an_epoch_through_the_loader_is_exactly_once_with_makeup_steps(
        data: tuple[str, str]) -> None:
    url, cache = data
    loaders = [make_loader(url, cache, group=g) for g in range(GROUPS)]
    plan = loaders[0].plan
    committed: list[int] = []
    step = 0
    while True:
        down = {step % GROUPS} if step % 3 == 0 else set()
        groups = set(range(GROUPS)) - down
        batches = [ld.next_batch() for ld in loaders]
        for g in groups:
            ids, padding = batches[g]["__id__"], batches[g]["__padding__"]
            committed.extend(ids[~padding].tolist())
        ended = [ld.commit(groups) for ld in loaders]
        assert len(set(ended)) == 1
        step += 1
        if ended[0]:
            break
    assert step > plan.num_slices // GROUPS  # the drops cost extra (makeup) steps
    assert sorted(committed) == sorted(epoch_ids(url, 0, plan).tolist())
    assert all(ld.epoch == 1 for ld in loaders)


def test_loading_is_strict_and_steps_are_read_before_they_are_reported(
        data: tuple[str, str]) -> None:
    url, cache = data
    loader = make_loader(url, cache)
    state = loader.state_dict()
    assert len(json.dumps(state)) < 500
    with pytest.raises(ReplicaError):
        loader.commit({0})
    other_seed = StreamDataset(url, batch_size=PER_RANK, rank=0, world_size=1, seed=SEED + 1)
    with pytest.raises(CursorMismatchError, match="seed"):
        ReplicaLoader(other_seed, num_groups=GROUPS, group=0).load_state_dict(state)
    with pytest.raises(CursorMismatchError, match="replica plan"):
        ReplicaLoader(loader.dataset, num_groups=2, group=0).load_state_dict(state)
    with pytest.raises(CursorMismatchError, match="version"):
        loader.load_state_dict({**state, "version": 2})
    with pytest.raises(CursorMismatchError):
        loader.load_state_dict({**state, "ledger": {**state["ledger"], "pending": [3]}})
    loader.close()
