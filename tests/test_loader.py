"""StreamDataset / StreamLoader in one process: exactly-once, resume, transforms, options.

Ranks are simulated by giving ``rank``/``world_size`` explicitly (the plan is a pure
function of them); tests/test_loader_dist.py runs the same contract with real
torch.distributed processes.
"""

from __future__ import annotations

import random
import tempfile
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from helpers.resume import LoaderSubject, check_resume
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_helpers import ids_of, loader, make_dataset

from streamcache.errors import ConfigError
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader
from streamcache.plan import CursorMismatchError, PlanError


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = str(tmp_path_factory.mktemp("loader"))
    return make_dataset(folder, [37, 50, 13, 60, 40]), folder + "/cache"  # 200 samples


def run_ranks_inline(url: str, cache: str, world: int, steps: int | None = None,
                     state: dict | None = None, workers: int = 0, **options: Any,
                     ) -> tuple[list[list[np.ndarray]], dict]:
    """Each rank's batches (ids) for up to ``steps`` steps, and the (common) state after."""
    per_rank, states = [], []
    for rank in range(world):
        it_loader = loader(url, cache, rank=rank, world=world, workers=workers, **options)
        if state is not None:
            it_loader.load_state_dict(state)
        batches = []
        for batch in it_loader:
            batches.append(ids_of(batch))
            if steps is not None and len(batches) == steps:
                break
        per_rank.append(batches)
        states.append(it_loader.state_dict())
        it_loader.close()
    assert all(s == states[0] for s in states), "the state must be the same on every rank"
    return per_rank, states[0]


def global_batches(per_rank: list[list[np.ndarray]]) -> list[np.ndarray]:
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"ranks made different step counts: {counts}"
    return [np.concatenate([rank[t] for rank in per_rank]) for t in range(counts.pop())]


def test_one_epoch_exactly_once_over_ranks(data: tuple[str, str]) -> None:
    url, cache = data
    per_rank, state = run_ranks_inline(url, cache, world=4, global_batch_size=20, tail="split")
    seen = np.concatenate([np.concatenate(r) for r in per_rank])
    assert np.array_equal(np.sort(seen), np.arange(200))
    for a in range(4):
        for b in range(a + 1, 4):
            assert not set(np.concatenate(per_rank[a])) & set(np.concatenate(per_rank[b]))
    assert state["cursor"]["epoch"] == 1 and state["cursor"]["samples_consumed"] == 0


def test_batches_hold_the_samples_their_ids_name(data: tuple[str, str]) -> None:
    url, cache = data
    with loader(url, cache, global_batch_size=16) as it:
        for batch in it:
            ids = ids_of(batch)
            assert np.array_equal(batch["x"].numpy(), ids)
            assert np.array_equal(batch["t_lengths"].numpy(), ids % 5)
            for row, n in zip(batch["t"].numpy(), ids % 5, strict=True):
                assert row[:n].tolist() == list(range(n)) and not row[n:].any()


@given(
    phases=st.lists(st.tuples(st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 3]),
                              st.integers(0, 9)), min_size=1, max_size=4),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_interrupted_epoch_is_exactly_once(data: tuple[str, str],
                                           phases: list[tuple[int, int, int]],
                                           seed: int) -> None:
    """Resume after every phase with another world size and another global batch."""
    url, cache = data
    state, seen = None, []
    for world, batch_mult, steps in phases:
        per_rank, state = run_ranks_inline(url, cache, world, steps=steps or None, state=state,
                                           global_batch_size=world * batch_mult * 2, seed=seed,
                                           tail="split")
        seen.extend(np.concatenate(global_batches(per_rank) or [np.zeros(0, np.int64)]))
        if state["cursor"]["epoch"] == 1:
            break
    if state["cursor"]["epoch"] == 0:  # finish the epoch on one rank
        per_rank, state = run_ranks_inline(url, cache, 1, state=state, global_batch_size=7,
                                           seed=seed, tail="split")
        seen.extend(np.concatenate(global_batches(per_rank)))
    assert sorted(int(i) for i in seen) == list(range(200))
    assert state["cursor"]["epoch"] == 1


def test_same_global_batch_resume_on_other_world_sizes_is_identical(data: tuple[str, str]
                                                                    ) -> None:
    url, cache = data
    reference, _ = run_ranks_inline(url, cache, 1, global_batch_size=12)
    expected = global_batches(reference)
    got: list[np.ndarray] = []
    state = None
    for world, steps in ((4, 3), (2, 5), (3, None)):
        per_rank, state = run_ranks_inline(url, cache, world, steps=steps, state=state,
                                           global_batch_size=12)
        got.extend(global_batches(per_rank))
    assert len(got) == len(expected)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def test_worker_processes_give_the_same_batches_in_step_order(data: tuple[str, str]) -> None:
    url, cache = data
    native, _ = run_ranks_inline(url, cache, 2, global_batch_size=16)
    workers, state = run_ranks_inline(url, cache, 2, global_batch_size=16, workers=2)
    assert all(np.array_equal(a, b) for a, b in zip(global_batches(native),
                                                    global_batches(workers), strict=True))
    assert state["cursor"]["epoch"] == 1


def test_resume_with_workers_mid_epoch(data: tuple[str, str]) -> None:
    """Resumed on another number of worker processes: the state counts handed-out steps."""
    url, cache = data
    first, state = run_ranks_inline(url, cache, 2, steps=4, global_batch_size=16, workers=2)
    assert state["cursor"]["samples_consumed"] == 64
    rest, state = run_ranks_inline(url, cache, 2, state=state, global_batch_size=16, workers=1)
    seen = np.concatenate(global_batches(first) + global_batches(rest))
    assert len(seen) == len(set(seen.tolist())) == 192  # 200 // 16 * 16 with tail="drop"


@pytest.mark.parametrize("workers", [0, 2], ids=["threads", "processes"])
def test_resume_oracle(data: tuple[str, str], workers: int) -> None:
    """The shared oracle: resumed at the start, a midpoint, an epoch's end and into the next
    epoch, every step is the uninterrupted run's (threads; worker processes, transform)."""
    url, cache = data
    options: dict[str, Any] = {"transform": _augment} if workers else {}

    def make() -> LoaderSubject:
        return LoaderSubject(loader(url, cache, global_batch_size=20, seed=4, workers=workers,
                                    **options))

    check_resume(make, steps_per_epoch=10, epoch_samples=range(200))


def test_state_at_epoch_end_resumes_next_epoch_and_iteration_continues(data: tuple[str, str]
                                                                       ) -> None:
    url, cache = data

    def make() -> LoaderSubject:  # a second pass over the loader is the next epoch
        return LoaderSubject(loader(url, cache, global_batch_size=50, seed=3))

    run = check_resume(make, steps_per_epoch=4, epoch_samples=range(200))
    assert run[:4] != run[4:]  # the next epoch is another order
    with loader(url, cache, global_batch_size=50, seed=3) as it:
        assert len(list(it)) == 4
        state = it.state_dict()
    assert state["cursor"] == {**state["cursor"], "epoch": 1, "samples_consumed": 0}


def test_break_then_iterate_continues_the_epoch(data: tuple[str, str]) -> None:
    url, cache = data
    with loader(url, cache, global_batch_size=20) as it:
        head = []
        for batch in it:
            head.append(ids_of(batch))
            if len(head) == 3:
                break
        assert it.state_dict()["cursor"]["samples_consumed"] == 60
        tail = [ids_of(b) for b in it]
    assert sorted(np.concatenate(head + tail).tolist()) == list(range(200))


def test_set_epoch_and_len(data: tuple[str, str]) -> None:
    url, cache = data
    with loader(url, cache, global_batch_size=30) as it:
        assert len(it) == 6
        for i, _ in enumerate(it):
            assert len(it) == 6  # constant during a pass, as a DataLoader's
            if i == 2:
                break
        rest = iter(it)  # a new pass continues after the 3 steps taken
        assert len(it) == 6 and it.steps_remaining == 3 and len(list(rest)) == 3
        it.set_epoch(5)
        assert it.state_dict()["cursor"]["epoch"] == 5
        ids5 = np.concatenate([ids_of(b) for b in it])
    with loader(url, cache, global_batch_size=30) as other:
        other.set_epoch(5)
        assert np.array_equal(ids5, np.concatenate([ids_of(b) for b in other]))


def test_infinite_mode_crosses_epochs_and_resumes(data: tuple[str, str]) -> None:
    url, cache = data

    def make() -> LoaderSubject:  # one endless pass: 3 steps an epoch
        return LoaderSubject(loader(url, cache, global_batch_size=64, infinite=True))

    check_resume(make, steps_per_epoch=3)
    with loader(url, cache, global_batch_size=64, infinite=True) as it:
        stream = iter(it)
        for _ in range(7):  # into epoch 2
            next(stream)
        state = it.state_dict()
        with pytest.raises(TypeError):
            len(it)
    assert state["cursor"]["epoch"] == 2 and state["cursor"]["samples_consumed"] == 64


def test_state_from_another_dataset_or_seed_is_refused(data: tuple[str, str],
                                                       tmp_path) -> None:
    url, cache = data
    with loader(url, cache, seed=1) as it:
        state = it.state_dict()
    with loader(url, cache, seed=2) as other, pytest.raises(CursorMismatchError, match="seed"):
        other.load_state_dict(state)
    other_url = make_dataset(str(tmp_path), [10, 10])
    with loader(other_url, str(tmp_path / "c"), seed=1) as other, pytest.raises(
        CursorMismatchError, match="dataset fingerprint"
    ):
        other.load_state_dict(state)
    with loader(url, cache) as it, pytest.raises(CursorMismatchError, match="version"):
        it.load_state_dict({"version": 99})
    with loader(url, cache) as it:
        good = it.state_dict()
        for bad in ({"version": 1}, {**good, "step": 3}):  # a key missing, a key added
            with pytest.raises(CursorMismatchError, match="must be a dict with keys"):
                it.load_state_dict(bad)


def test_impossible_topologies_are_clear_errors(data: tuple[str, str]) -> None:
    url, cache = data
    with pytest.raises(PlanError, match="not divisible by world size"):
        StreamDataset(url, global_batch_size=10, rank=0, world_size=3, cache_dir=cache)
    with pytest.raises(PlanError, match="larger than the global batch"):
        StreamDataset(url, global_batch_size=2, rank=0, world_size=4, cache_dir=cache)
    with pytest.raises(PlanError, match="impossible"):
        StreamDataset(url, batch_size=2, rank=4, world_size=4, cache_dir=cache)
    with pytest.raises(ConfigError, match="exactly one"):
        StreamDataset(url, cache_dir=cache)


def test_rank_and_world_size_from_the_environment(data: tuple[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    url, cache = data
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dataset = StreamDataset(url, batch_size=4, cache_dir=cache)
    assert (dataset.rank, dataset.world_size, dataset.global_batch) == (1, 2, 8)


def _augment(sample: dict[str, Any]) -> dict[str, Any]:
    rng = np.random.default_rng(sample["__seed__"])
    return {"x": sample["x"], "noise": rng.normal(size=3).astype(np.float32),
            "global": np.float32(np.random.random()), "__id__": sample["__id__"]}


def test_per_sample_augmentation_does_not_depend_on_who_reads(data: tuple[str, str]) -> None:
    url, cache = data

    def noise_by_id(world: int, workers: int) -> dict[int, np.ndarray]:
        out = {}
        for rank in range(world):
            with loader(url, cache, rank=rank, world=world, workers=workers,
                        global_batch_size=8, transform=_augment) as it:
                for batch in it:
                    for i, noise in zip(ids_of(batch), batch["noise"].numpy(), strict=True):
                        out[int(i)] = noise
        return out

    one = noise_by_id(1, 0)
    assert noise_by_id(2, 0).keys() == one.keys()
    for world, workers in ((2, 0), (4, 2)):
        other = noise_by_id(world, workers)
        assert all(np.array_equal(one[i], other[i]) for i in one)


def test_global_rng_transform_is_reproducible_and_leaves_the_loop_rng_alone(
        data: tuple[str, str]) -> None:
    url, cache = data
    runs = []
    for _ in range(2):
        random.seed(123)
        torch.manual_seed(123)
        with loader(url, cache, global_batch_size=8, transform=_augment) as it:
            values = [b["global"].numpy() for b in it]
            loop_draws = (random.random(), torch.rand(1).item())
        runs.append((values, loop_draws))
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))
    random.seed(123)
    torch.manual_seed(123)
    assert runs[0][1] == (random.random(), torch.rand(1).item())


def test_batch_transform_sees_seeds(data: tuple[str, str]) -> None:
    url, cache = data

    def double(batch: dict[str, Any]) -> dict[str, Any]:
        assert batch["__seed__"].dtype == np.uint64 and len(batch["__seed__"]) == 8
        return {**batch, "x": batch["x"] * 2}

    with loader(url, cache, global_batch_size=8, batch_transform=double) as it:
        batch = next(iter(it))
    assert np.array_equal(batch["x"].numpy(), ids_of(batch) * 2)


def test_offsets_mode_strings_and_bytes(tmp_path) -> None:
    from streamcache import write_dataset

    write_dataset(({"s": f"s{i}", "b": bytes([i]) * i, "t": np.arange(i, dtype=np.int16)}
                   for i in range(10)), str(tmp_path / "ds"))
    with loader(str(tmp_path / "ds"), str(tmp_path / "c"), global_batch_size=5,
                shuffle=False, ragged="offsets") as it:
        batch = next(iter(it))
    assert batch["s"] == ["s0", "s1", "s2", "s3", "s4"]
    assert batch["b_offsets"].tolist() == [0, 0, 1, 3, 6, 10]
    assert batch["t"].tolist() == [0, 0, 1, 0, 1, 2, 0, 1, 2, 3]
    assert batch["t_offsets"].tolist() == [0, 0, 1, 3, 6, 10]


def test_pad_tail_is_flagged(data: tuple[str, str]) -> None:
    url, cache = data
    with loader(url, cache, global_batch_size=64, tail="pad") as it:
        batches = list(it)
    padding = np.concatenate([b["__padding__"].numpy() for b in batches])
    ids = np.concatenate([ids_of(b) for b in batches])
    assert len(batches) == 4 and padding.sum() == 56
    assert sorted(ids[~padding].tolist()) == list(range(200))


def test_pin_memory_without_cuda_warns(data: tuple[str, str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning works")
    url, cache = data
    dataset = StreamDataset(url, global_batch_size=8, rank=0, world_size=1, cache_dir=cache)
    with pytest.warns(UserWarning, match="no CUDA device"):
        StreamLoader(dataset, pin_memory=True).close()


def test_errors_in_reader_threads_reach_the_loop(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [20, 20])
    import os

    from streamcache import load_index

    shard = os.path.join(url, load_index(url).shards[1].path)
    with open(shard, "r+b") as f:
        f.truncate(100)
    with tempfile.TemporaryDirectory() as cache, loader(url, cache, global_batch_size=40,
                                                        shuffle=False) as it:
        from streamcache.remote.retry import FetchError

        with warnings.catch_warnings(), pytest.raises(FetchError, match="the index records"):
            list(it)


def test_worker_processes_only_where_a_transform_needs_them(data: tuple[str, str]) -> None:
    url, cache = data
    plain = StreamDataset(url, global_batch_size=8, rank=0, world_size=1, cache_dir=cache)
    assert not StreamLoader(plain, num_workers=2).uses_processes
    assert StreamLoader(plain, num_workers=2, worker_mode="process").uses_processes
    transformed = StreamDataset(url, global_batch_size=8, rank=0, world_size=1,
                                cache_dir=cache, transform=_augment)
    assert StreamLoader(transformed, num_workers=2).uses_processes
    assert not StreamLoader(transformed, num_workers=2, worker_mode="thread").uses_processes
    assert not StreamLoader(transformed, num_workers=0).uses_processes
    with pytest.raises(ValueError, match="worker_mode"):
        StreamLoader(plain, worker_mode="fork")
    with StreamLoader(plain, num_workers=3) as threaded:
        ids = np.concatenate([ids_of(b) for b in threaded])
    assert sorted(ids.tolist()) == list(range(200))


# ---------------------------------------------------------------- the seams (issue 12, 16)


def test_topology_is_resolved_when_iteration_starts(data: tuple[str, str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Made before the process group exists (a LightningModule's __init__), the dataset takes
    its rank when a pass starts, not when it is made."""
    url, cache = data
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    dataset = StreamDataset(url, global_batch_size=8, cache_dir=cache, seed=2)
    monkeypatch.setenv("RANK", "1")  # what init_process_group would report from here on
    monkeypatch.setenv("WORLD_SIZE", "2")
    with StreamLoader(dataset) as it:
        ids = [ids_of(b) for b in it]
    with loader(url, cache, rank=1, world=2, global_batch_size=8, seed=2) as reference:
        expected = [ids_of(b) for b in reference]
    assert len(ids) == len(expected) == 25
    assert all(np.array_equal(a, b) for a, b in zip(ids, expected, strict=True))


@pytest.mark.parametrize("env, options, match", [
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, {}, "LOCAL_RANK=1"),  # Lightning's launcher
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, {}, "WORLD_SIZE=2"),
    ({}, {"world_size": 2}, "world_size=2 without rank="),
])
def test_a_distributed_environment_without_a_rank_is_refused_at_iteration(
        data: tuple[str, str], monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
        options: dict[str, Any], match: str) -> None:
    url, cache = data
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dataset = StreamDataset(url, global_batch_size=8, cache_dir=cache, **options)  # no error
    assert len(dataset) == 25  # a global batch needs no rank to count steps
    with StreamLoader(dataset) as it, pytest.raises(PlanError, match=match) as error:
        next(iter(it))
    assert "would read as rank 0" in str(error.value)
    with pytest.raises(PlanError, match=match):
        next(iter(dataset))


def test_len_is_the_whole_epoch_after_a_mid_epoch_resume(data: tuple[str, str]) -> None:
    url, cache = data
    with loader(url, cache, global_batch_size=20) as it:
        stream = iter(it)
        for _ in range(3):
            next(stream)
        state = it.state_dict()
    with loader(url, cache, global_batch_size=20) as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == len(resumed.dataset) == 10  # as DataLoader: the epoch's steps
        assert resumed.steps_remaining == 7
        stream = iter(resumed)
        assert len(resumed) == 10 and resumed.steps_remaining == 7
        next(stream)
        assert len(resumed) == 10 and resumed.steps_remaining == 6
        assert len(list(stream)) == 6
        assert resumed.steps_remaining == 10  # the next epoch, from its start


def test_set_epoch_of_the_epoch_in_progress_keeps_the_cursor(data: tuple[str, str]) -> None:
    """The DistributedSampler habit: set_epoch(e) before every epoch, also right after a
    mid-epoch resume."""
    url, cache = data
    with loader(url, cache, global_batch_size=20, seed=4) as it:
        it.set_epoch(2)
        epoch2 = [ids_of(b) for b in it]
        it.set_epoch(2)  # epoch 2 is finished: the cursor is at epoch 3 now
        assert it.state_dict()["cursor"]["epoch"] == 2  # another epoch: restarts it
    with loader(url, cache, global_batch_size=20, seed=4) as it:
        it.set_epoch(2)
        stream = iter(it)
        head = [ids_of(next(stream)) for _ in range(4)]
        state = it.state_dict()
    with loader(url, cache, global_batch_size=20, seed=4) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(2)
        assert resumed.state_dict() == state
        rest = [ids_of(b) for b in resumed]
    assert all(np.array_equal(a, b) for a, b in zip(head + rest, epoch2, strict=True))


def _tagged(sample: dict[str, Any]) -> dict[str, Any]:
    return {"x": sample["x"] * 2, "__id__": sample["__id__"]}


def test_split_tail_with_a_transform_gives_every_rank_a_well_formed_batch(
        data: tuple[str, str]) -> None:
    """200 samples, global batch 66 on 3 ranks: the last step holds 2 samples, so rank 0's
    part of it is empty; it still gets that step, as an empty batch of the same fields."""
    url, cache = data
    per_rank = []
    for rank in range(3):
        with loader(url, cache, rank=rank, world=3, global_batch_size=66, tail="split",
                    transform=_tagged) as it:
            per_rank.append(list(it))
    assert [len(batches) for batches in per_rank] == [4, 4, 4]
    empty = per_rank[0][-1]
    assert set(empty) == set(per_rank[1][-1]) == {"x", "__id__"}
    assert empty["x"].shape == (0,) and empty["x"].dtype == per_rank[1][-1]["x"].dtype
    assert len(ids_of(empty)) == 0
    ids = np.concatenate([ids_of(b) for batches in per_rank for b in batches])
    assert sorted(ids.tolist()) == list(range(200))


def _inputs_and_targets(samples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([float(s["x"]) for s in samples]),
            torch.tensor([s["__id__"] for s in samples]))


def test_split_tail_keeps_the_structure_of_a_custom_collate(data: tuple[str, str]) -> None:
    url, cache = data
    with loader(url, cache, rank=0, world=3, global_batch_size=66, tail="split",
                transform=lambda s: s, collate_fn=_inputs_and_targets) as it:
        batches = list(it)
    inputs, ids = batches[-1]
    assert len(batches) == 4 and inputs.shape == ids.shape == (0,)
    assert inputs.dtype == torch.float32 and ids.dtype == torch.int64


def test_worker_processes_do_not_draw_from_the_loop_rng(data: tuple[str, str]) -> None:
    url, cache = data
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    with loader(url, cache, global_batch_size=40, workers=1, transform=_tagged) as it:
        for _ in it:
            pass
        assert torch.equal(torch.rand(4), expected)


def _global_draws(sample: dict[str, Any]) -> dict[str, Any]:
    return {"draws": np.array([random.random(), np.random.random(), torch.rand(1).item()]),
            "__id__": sample["__id__"]}


def test_global_rng_transforms_do_not_depend_on_the_world_size(data: tuple[str, str]) -> None:
    url, cache = data

    def draws_by_id(world: int, workers: int) -> dict[int, np.ndarray]:
        out = {}
        for rank in range(world):
            with loader(url, cache, rank=rank, world=world, workers=workers,
                        global_batch_size=12, transform=_global_draws) as it:
                for batch in it:
                    out.update(zip(ids_of(batch).tolist(), batch["draws"].numpy(),
                                   strict=True))
        return out

    one = draws_by_id(1, 0)
    assert len({tuple(v) for v in one.values()}) == len(one)  # a different draw per sample
    for world, workers in ((2, 0), (3, 1)):
        other = draws_by_id(world, workers)
        assert other.keys() == one.keys()
        assert all(np.array_equal(one[i], other[i]) for i in one)


def test_transforms_never_reseed_the_cuda_generators(data: tuple[str, str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA generators belong to the training loop (dropout) and are not restored after a
    transform, so seeding for transforms must not touch them (torch.manual_seed would)."""
    url, cache = data
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", calls.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", calls.append)
    for option in ({"transform": _global_draws}, {"batch_transform": _batch_draws}):
        with loader(url, cache, global_batch_size=40, **option) as it:
            assert len(list(it)) == 5
    assert calls == []


def _batch_draws(batch: dict[str, Any]) -> dict[str, Any]:
    return {**batch, "draws": np.random.random(len(batch["x"]))}


def test_batch_transform_draws_are_per_batch_and_reproducible(data: tuple[str, str]) -> None:
    """The batch_transform contract: the global RNGs are seeded from the batch's first
    sample, so reruns and resumes draw the same, and ranks draw differently."""
    url, cache = data

    def run(rank: int, world: int, state: dict | None = None) -> list[dict[str, Any]]:
        with loader(url, cache, rank=rank, world=world, global_batch_size=12,
                    batch_transform=_batch_draws) as it:
            if state is not None:
                it.load_state_dict(state)
            return list(it)

    first, second = run(0, 2), run(1, 2)
    assert not np.array_equal(first[0]["draws"], second[0]["draws"])
    again = run(0, 2)
    assert all(np.array_equal(a["draws"], b["draws"]) for a, b in zip(first, again,
                                                                      strict=True))
    with loader(url, cache, rank=0, world=2, global_batch_size=12) as it:
        stream = iter(it)
        next(stream)
        state = it.state_dict()
    resumed = run(0, 2, state)
    assert all(np.array_equal(a["draws"], b["draws"]) for a, b in zip(first[1:], resumed,
                                                                      strict=True))


def _returns_a_tensor(sample: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(sample["x"])


def _batch_returns_a_tensor(batch: dict[str, Any]) -> torch.Tensor:
    return torch.from_numpy(batch["x"])


@pytest.mark.parametrize("option, fn, name", [
    ("transform", _returns_a_tensor, "_returns_a_tensor"),
    ("batch_transform", _batch_returns_a_tensor, "_batch_returns_a_tensor"),
])
def test_a_transform_that_does_not_return_a_dict_is_a_clear_error(
        data: tuple[str, str], option: str, fn: Any, name: str) -> None:
    from streamcache.errors import StreamcacheError, TransformError

    url, cache = data
    with loader(url, cache, global_batch_size=8, **{option: fn}) as it, \
            pytest.raises(TransformError, match=f"{name}.*returned a Tensor.*dict") as error:
        next(iter(it))
    assert isinstance(error.value, StreamcacheError)


def _stops_at_sample_100(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["x"] == 100:
        raise StopIteration  # (as next() of an exhausted iterator inside a transform does)
    return {"x": sample["x"]}


def _batch_stops_at_sample_100(batch: dict[str, Any]) -> dict[str, Any]:
    if 100 in batch["x"]:
        next(iter(()))
    return batch


def _collate_stops_at_sample_100(samples: list[Any]) -> Any:
    if any(sample["x"] == 100 for sample in samples):
        raise StopIteration
    return torch.utils.data.default_collate(samples)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("options, name, what", [
    ({"transform": _stops_at_sample_100}, "transform _stops_at_sample_100", "sample"),
    ({"batch_transform": _batch_stops_at_sample_100}, "batch_transform "
     "_batch_stops_at_sample_100", "batch starting"),
    ({"transform": lambda sample: {"x": sample["x"]}, "collate_fn":
      _collate_stops_at_sample_100}, "collate_fn _collate_stops_at_sample_100",
     "batch starting"),
])
def test_a_stop_iteration_in_user_code_is_an_error_not_the_end_of_the_epoch(
        data: tuple[str, str], workers: int, options: dict[str, Any], name: str,
        what: str) -> None:
    """A StopIteration out of a transform or collate_fn ended the loop's ``for`` at that
    step as if the epoch were over (at w0, without an error; with worker processes as a
    RuntimeError of the generator): it is a TransformError naming the function."""
    from streamcache.errors import TransformError

    url, cache = data
    seen: list[int] = []
    with loader(url, cache, workers=workers, global_batch_size=10, **options) as it, \
            pytest.raises(TransformError, match=f"{name} raised StopIteration for the {what}"):
        for batch in it:
            seen.extend(ids_of(batch).tolist())
    assert 100 not in seen and len(seen) < 200


@pytest.mark.parametrize("options", [
    {"global_batch_size": 201},
    {"batch_size": 101, "rank": 0, "world_size": 2},
])
def test_a_batch_larger_than_the_dataset_is_refused_with_tail_drop(
        data: tuple[str, str], options: dict[str, Any]) -> None:
    url, cache = data
    with pytest.raises(PlanError, match=r"200 samples.*no step.*tail=\"pad\""):
        StreamDataset(url, cache_dir=cache, **options)
    for tail in ("pad", "split"):  # those read the short epoch as one step
        with StreamLoader(StreamDataset(url, cache_dir=cache, tail=tail, **options)) as it:
            assert len(it) == 1


def test_a_per_rank_batch_larger_than_the_dataset_is_refused_when_iteration_starts(
        data: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    url, cache = data
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    dataset = StreamDataset(url, batch_size=60, cache_dir=cache)  # 240 a step on 4 ranks
    with StreamLoader(dataset) as it, pytest.raises(PlanError, match="no step"):
        next(iter(it))


def _double_x_in_place(sample: dict[str, Any]) -> dict[str, Any]:
    sample["x"] = sample["x"] * 2  # the most natural transform: change a field, return it
    return sample


@pytest.mark.parametrize("workers", [0, 2])
def test_a_transform_that_returns_its_sample_dict_collates_with_its_seeds(
        data: tuple[str, str], workers: int) -> None:
    """The sample dict comes with __seed__, a Python int of up to 2**64 - 1; returned as it
    came, default_collate overflowed on it ('Overflow when unpacking long long'). The batch
    carries the seeds as a batch without a transform does (with_seeds=True)."""
    url, cache = data
    with loader(url, cache, global_batch_size=8, seed=5, with_seeds=True, fields=["x"]) as plain:
        expected = [(ids_of(b).tolist(), b["__seed__"]) for b in plain]
    with loader(url, cache, global_batch_size=8, seed=5, workers=workers, fields=["x"],
                transform=_double_x_in_place) as transformed:
        batches = list(transformed)
    assert len(batches) == len(expected)
    assert any(int(seed.view(torch.int64).min()) < 0 for _, seed in expected)  # >= 2**63
    for batch, (ids, seeds) in zip(batches, expected, strict=True):
        assert ids_of(batch).tolist() == ids
        assert batch["x"].tolist() == [2 * i for i in ids]
        assert batch["__seed__"].dtype == seeds.dtype and torch.equal(batch["__seed__"], seeds)
