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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_helpers import ids_of, loader, make_dataset

from streamcache.dataset import StreamDataset
from streamcache.loader import StreamLoader
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
    url, cache = data
    first, state = run_ranks_inline(url, cache, 2, steps=4, global_batch_size=16, workers=2)
    assert state["cursor"]["samples_consumed"] == 64
    rest, state = run_ranks_inline(url, cache, 2, state=state, global_batch_size=16, workers=1)
    seen = np.concatenate(global_batches(first) + global_batches(rest))
    assert len(seen) == len(set(seen.tolist())) == 192  # 200 // 16 * 16 with tail="drop"


def test_state_at_epoch_end_resumes_next_epoch_and_iteration_continues(data: tuple[str, str]
                                                                       ) -> None:
    url, cache = data
    with loader(url, cache, global_batch_size=50, seed=3) as it:
        first_epoch = [ids_of(b) for b in it]
        state = it.state_dict()
        assert state["cursor"] == {**state["cursor"], "epoch": 1, "samples_consumed": 0}
        second_epoch = [ids_of(b) for b in it]  # iterating again starts the next epoch
    assert len(first_epoch) == len(second_epoch) == 4
    assert not np.array_equal(np.concatenate(first_epoch), np.concatenate(second_epoch))
    with loader(url, cache, global_batch_size=50, seed=3) as again:
        again.load_state_dict(state)
        assert all(np.array_equal(a, ids_of(b)) for a, b in zip(second_epoch, again,
                                                                strict=True))


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
        assert len(it) == 3 and len(list(rest)) == 3
        it.set_epoch(5)
        assert it.state_dict()["cursor"]["epoch"] == 5
        ids5 = np.concatenate([ids_of(b) for b in it])
    with loader(url, cache, global_batch_size=30) as other:
        other.set_epoch(5)
        assert np.array_equal(ids5, np.concatenate([ids_of(b) for b in other]))


def test_infinite_mode_crosses_epochs_and_resumes(data: tuple[str, str]) -> None:
    url, cache = data
    with loader(url, cache, global_batch_size=64, infinite=True) as it:
        stream = iter(it)
        got = [ids_of(next(stream)) for _ in range(7)]  # 3 steps an epoch: into epoch 2
        state = it.state_dict()
        with pytest.raises(TypeError):
            len(it)
    assert state["cursor"]["epoch"] == 2 and state["cursor"]["samples_consumed"] == 64
    with loader(url, cache, global_batch_size=64, infinite=True) as fresh:
        reference = iter(fresh)
        expected = [ids_of(next(reference)) for _ in range(9)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected[:7], strict=True))
    with loader(url, cache, global_batch_size=64, infinite=True) as resumed:
        resumed.load_state_dict(state)
        more = iter(resumed)
        assert np.array_equal(ids_of(next(more)), expected[7])


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


def test_impossible_topologies_are_clear_errors(data: tuple[str, str]) -> None:
    url, cache = data
    with pytest.raises(PlanError, match="not divisible by world size"):
        StreamDataset(url, global_batch_size=10, rank=0, world_size=3, cache_dir=cache)
    with pytest.raises(PlanError, match="larger than the global batch"):
        StreamDataset(url, global_batch_size=2, rank=0, world_size=4, cache_dir=cache)
    with pytest.raises(PlanError, match="impossible"):
        StreamDataset(url, batch_size=2, rank=4, world_size=4, cache_dir=cache)
    with pytest.raises(PlanError, match="exactly one"):
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
        from streamcache.fetch import FetchError

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
