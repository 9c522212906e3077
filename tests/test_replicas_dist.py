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
from helpers.resume import ReplicaSubject, check_resume
from loader_helpers import make_dataset
from replica_sim import (
    TraceStep,
    expected,
    group_main,
    incarnations,
    make_trace,
    read_logs,
    run_killed,
)

from streamcache.checkpoint import Checkpointer
from streamcache.loading.dataset import StreamDataset
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


SCRIPTED = {  # the cases the issue names, at fixed steps; the rest of a trace is random
    3: TraceStep(frozenset({0, 1, 2, 3}), frozenset({0, 2, 3})),    # 1 fails during a step
    6: TraceStep(frozenset({0, 3}), frozenset({0, 3})),             # 2 and (still) 1 down
    7: TraceStep(frozenset({0, 1, 2, 3}), frozenset({0, 1, 2, 3})), # 1 and 2 rejoin at once
    9: TraceStep(frozenset({0, 1, 2, 3}), frozenset(), discard=True),
}


def check_replay(url: str, plan: ReplicaPlan, trace: list[TraceStep],
                 reads: list[tuple[int, dict]], commits: list[tuple[int, dict]],
                 epochs: int) -> None:
    """Every batch read is the plan's for that group and step; every live rank reports the
    trace's committed set and holds the same state; every sample of every epoch is committed
    exactly once."""
    ledgers = expected(plan, trace)
    shard_rows = StreamDataset(url, batch_size=PER_RANK, rank=0, world_size=1).index.shard_rows
    orders = {e: EpochOrder(shard_rows, SEED, e, ShuffleOptions()) for e in range(epochs)}
    read_at = {(group, r["t"]): r for group, r in reads}
    committed: dict[int, list[int]] = {e: [] for e in range(epochs)}
    for (group, t), record in read_at.items():
        ledger = ledgers[t]
        assert record["epoch"] == ledger.epoch
        assert record["slice"] == ledger.assignment(plan)[group]
        want = orders[ledger.epoch].samples_at(positions_of(plan, ledger, group))[0]
        assert record["ids"] == want.tolist(), f"group {group} read the wrong batch at {t}"
        assert record["padding"] == [record["slice"] == PAD_SLICE] * PER_RANK
    digests: dict[int, set[str]] = {}
    for group, record in commits:
        t = record["t"]
        assert record["committed"] == sorted(trace[t].committed)
        digests.setdefault(t, set()).add(record["state"])
        if group in trace[t].committed and read_at[(group, t)]["slice"] != PAD_SLICE:
            committed[ledgers[t].epoch].extend(read_at[(group, t)]["ids"])
    assert all(len(d) == 1 for d in digests.values()), "live ranks disagree on the state"
    for t, step in enumerate(trace):  # every read and commit the trace asks for happened
        assert all((g, t) in read_at for g in step.up)
        assert len(digests[t]) == 1
    for epoch in range(epochs):
        counts = Counter(committed[epoch])
        assert max(counts.values()) == 1, f"epoch {epoch}: a sample was committed twice"
        assert sorted(counts) == sorted(epoch_ids(url, epoch, plan).tolist()), \
            f"epoch {epoch}: samples were lost"


def check_trace_covers_the_issue(plan: ReplicaPlan, trace: list[TraceStep]) -> None:
    ledgers = expected(plan, trace)
    last_steps = [t for t in range(len(trace)) if ledgers[t + 1].epoch > ledgers[t].epoch]
    assert all(any(trace[u].committed != trace[u].up for u in range(t - 2, t + 1))
               for t in last_steps), "the trace must fail a group in the last steps of an epoch"
    rejoins = [t for t in range(1, len(trace)) if trace[t].up - trace[t - 1].survivors]
    assert any(len(trace[t].up - trace[t - 1].survivors) >= 2 for t in rejoins)
    assert any(len(trace[t - 1].survivors - trace[t].up) >= 2 for t in range(1, len(trace)))


def test_four_groups_drop_and_rejoin_exactly_once(data: tuple[str, str]) -> None:
    """Groups that are down skip steps; a rejoining group throws its loader away and gets
    the state from a live peer through a gloo group of the step's live ranks."""
    url, cache = data
    plan = ReplicaPlan(200, GROUPS * PER_RANK, GROUPS)
    trace = make_trace(plan, epochs=2, seed=0, scripted=SCRIPTED)
    check_trace_covers_the_issue(plan, trace)

    results = run_ranks(group_main, GROUPS, url, cache, {"per_rank": PER_RANK, "seed": SEED},
                        trace, timeout_s=120)

    reads = [(g, r) for g, res in enumerate(results) for r in res.value["steps"]]
    commits = [(g, {"t": r["t"], "committed": r["committed_set"], "state": r["state"]})
               for g, r in reads if "state" in r]
    check_replay(url, plan, trace, reads, commits, epochs=2)
    assert sum(r["rejoined"] for _, r in reads) >= 4
    sizes = [tr["bytes"] for r in results for tr in r.value["transfers"]]
    assert sizes and max(sizes) < 600, sizes


def test_groups_sigkilled_and_restarted_exactly_once(data: tuple[str, str],
                                                     tmp_path: Path) -> None:
    """The same with real deaths: a group's process SIGKILLs itself where the trace takes the
    group down (during a step, or after it), a new process is started at once and joins at
    the step the trace brings the group back, with nothing but a peer's state."""
    url, cache = data
    plan = ReplicaPlan(200, GROUPS * PER_RANK, GROUPS)
    trace = make_trace(plan, epochs=1, seed=6, scripted=SCRIPTED)
    check_trace_covers_the_issue(plan, trace)
    logs = tmp_path / "logs"
    logs.mkdir()

    kills = run_killed(trace, url, cache, {"per_rank": PER_RANK, "seed": SEED,
                                           "groups": GROUPS}, str(logs), timeout_s=150)

    assert sum(kills.values()) == sum(len(incarnations(trace, g)) for g in range(GROUPS)) \
        - sum(1 for g in range(GROUPS) if g in trace[-1].survivors)
    records = read_logs(str(logs))
    reads = [(g, r) for g, r in records if r["kind"] == "read"]
    commits = [(g, r) for g, r in records if r["kind"] == "commit"]
    check_replay(url, plan, trace, reads, commits, epochs=1)
    firsts = [r for _, r in reads if r["first"] and r["t"] > 0]
    assert len(firsts) >= 3  # restarted processes, each read the plan's batch (checked above)
    sizes = [r["bytes"] for _, r in records if r["kind"] == "transfer"]
    assert sizes and max(sizes) < 600


def test_resume_oracle(data: tuple[str, str]) -> None:
    """The shared oracle over all four groups stepping together: resumed at the start, a
    midpoint, an epoch's end and into the next epoch, every step is the uninterrupted run's
    and every epoch holds every sample once."""
    url, cache = data

    def make() -> ReplicaSubject:
        return ReplicaSubject([make_loader(url, cache, group=g) for g in range(GROUPS)])

    check_resume(make, steps_per_epoch=200 // (GROUPS * PER_RANK), epoch_samples=range(200))


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


def test_batches_iterates_an_epoch_and_an_empty_epoch_moves_on(data: tuple[str, str],
                                                               tmp_path: Path) -> None:
    url, cache = data
    loader = make_loader(url, cache, group=3)
    verdicts = iter([{0, 1, 2}] + [{0, 1, 2, 3}] * 100)
    steps = sum(1 for _ in loader.batches(lambda: next(verdicts)))
    assert steps == loader.plan.num_slices // GROUPS + 1 and loader.epoch == 1
    small = make_dataset(str(tmp_path), [3], seq=False)  # fewer samples than a global batch
    empty = make_loader(small, cache)
    assert empty.next_batch() is None and empty.epoch == 1
    loader.close()
    empty.close()


def _noisy(batch: dict) -> dict:
    batch["noise"] = np.random.random(len(batch["x"]))  # global RNG, seeded per slice
    return batch


def test_prefetch_gives_the_same_batches_and_a_reissued_slice_the_same_transform(
        data: tuple[str, str]) -> None:
    url, cache = data
    ahead = [make_loader(url, cache, group=g, batch_transform=_noisy) for g in range(GROUPS)]
    plain = [ReplicaLoader(StreamDataset(url, batch_size=PER_RANK, rank=0, world_size=1,
                                         cache_dir=cache, seed=SEED, batch_transform=_noisy),
                           num_groups=GROUPS, group=g, prefetch=False) for g in range(GROUPS)]
    history = [{0, 1, 2, 3}, {0, 2, 3}, {0, 2, 3}, {0, 1, 2, 3}, set(), {0, 1, 2, 3}] * 3
    noise_of: dict[tuple[int, int], list[float]] = {}
    for groups in history:
        for a, b in zip(plain, ahead, strict=True):
            x, y = a.next_batch(), b.next_batch()
            assert x["__id__"].tolist() == y["__id__"].tolist()
            assert np.array_equal(x["noise"], y["noise"])
            key = (a.epoch, a.current_slice())
            noise_of.setdefault(key, x["noise"].tolist())
            assert noise_of[key] == x["noise"].tolist(), "a re-issued slice is transformed alike"
        for ld in plain + ahead:
            ld.commit(groups)
    hits = sum(ld.prefetch_hits for ld in ahead)
    assert hits > 0
    for _ in range(5):  # healthy steps: the guess is always right
        for ld in ahead:
            ld.next_batch()
        for ld in ahead:
            ld.commit(range(GROUPS))
    assert sum(ld.prefetch_hits for ld in ahead) == hits + 5 * GROUPS
    for ld in plain + ahead:
        ld.close()
