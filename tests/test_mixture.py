"""A StreamDataset of several Sources with real shards: batches, weights, resumes (also
elastic and with new weights), strict state, shared cache and prefetcher, per-source options,
worker processes, and two real gloo ranks."""

from __future__ import annotations

import copy
import itertools
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from helpers.mixture_model import MixtureModel
from helpers.resume import check_resume
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from loader_helpers import make_dataset

from streamcache import (
    CacheBudgetError,
    ConfigError,
    CursorMismatchError,
    Source,
    StreamDataset,
    StreamLoader,
    write_dataset,
)
from streamcache.cache.prefetch import Prefetcher
from streamcache.loading.mixture_store import MixtureCache

SIZES = ([9, 6, 12], [5, 5], [8, 8])  # 27, 10 and 16 samples
WEIGHTS = (0.5, 0.3, 0.2)


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("mixture")
    return [make_dataset(str(root / f"s{i}"), rows) for i, rows in enumerate(SIZES)]


def mixture(urls: list[str], cache: Any, weights: tuple[float, ...] = WEIGHTS, *,
            rank: int = 0, world: int = 1, batch: int = 6, workers: int = 0,
            **options: Any) -> StreamLoader:
    sources = [Source(url, weight=w) for url, w in zip(urls, weights, strict=True)]
    dataset = StreamDataset(sources, global_batch_size=batch, seed=5, rank=rank,
                            world_size=world, cache_dir=str(cache), shuffle_window=8, **options)
    return StreamLoader(dataset, num_workers=workers,
                        worker_mode="process" if workers else "auto")


def pairs(batch: dict[str, Any]) -> list[tuple[int, int]]:
    return list(zip(batch["__source__"].tolist(), batch["__id__"].tolist(), strict=True))


class MixtureSubject:
    """A mixture's loader for the shared resume oracle (ids made unique per source)."""

    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader

    def steps(self) -> Iterator[list[int]]:
        while True:
            for batch in self.loader:
                yield [1000 * s + i for s, i in pairs(batch)]

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()


def test_batches_carry_their_source_and_follow_the_weights(urls, tmp_path):
    with mixture(urls, tmp_path) as loader:
        batches = list(loader)
        assert len(batches) == len(loader)
        for batch in batches:  # the rows are those of the named source's sample
            assert batch["x"].tolist() == batch["__id__"].tolist()
            assert batch["__source__"].dtype == torch.int64
        read = [p for b in batches for p in pairs(b)]
        for n in range(1, len(read) + 1):  # within one sample of the weights at every prefix
            for s, weight in enumerate(WEIGHTS):
                assert abs(sum(src == s for src, _ in read[:n]) - weight * n) < 1
        per_source = [[i for src, i in read if src == s] for s in range(3)]
        assert all(len(ids) == len(set(ids)) for ids in per_source)
        # the epoch ends where source 1 (10 samples, 0.3) finishes: 33 positions, 5 steps
        assert loader.dataset.cursor.epoch == 1 and len(loader) == 33 // 6


def test_a_mixture_resumes_exactly_from_any_point(urls, tmp_path):
    steps = len(mixture(urls, tmp_path / "probe").dataset)
    check_resume(lambda: MixtureSubject(mixture(urls, tmp_path)), steps_per_epoch=steps)


def _passes(loader: StreamLoader) -> Iterator[dict[str, Any]]:
    """``loader``'s batches pass after pass (epoch after epoch), as a training loop reads.

    A pass may read nothing once: a resume with a larger global batch near an epoch's end
    leaves a rest shorter than one batch, which ends the epoch (docs/mixtures.md). Two empty
    passes in a row would be a loader that never moves on."""
    empty = 0
    while True:
        read = 0
        for batch in loader:
            read += 1
            yield batch
        empty = 0 if read else empty + 1
        assert empty < 2, "two passes of the loader in a row read no step"


def _steps(loader: StreamLoader, count: int) -> list[list[tuple[int, int]]]:
    """The next ``count`` steps of ``loader`` (this rank's part of each), read on into the
    next epoch as a training loop does."""
    return [pairs(batch) for batch in itertools.islice(_passes(loader), count)]


def test_resume_on_another_world_size_worker_count_and_batch_size(urls, tmp_path):
    reference = _steps(mixture(urls, tmp_path, infinite=True, batch=8), 20)
    ranks = [mixture(urls, tmp_path, rank=r, world=2, batch=8, infinite=True)
             for r in range(2)]
    parts = [_steps(loader, 7) for loader in ranks]
    assert [a + b for a, b in zip(*parts, strict=True)] == reference[:7]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    # one rank, two worker processes, a global batch of 4
    resumed = mixture(urls, tmp_path, batch=4, infinite=True, workers=2)
    resumed.load_state_dict(state)
    rest = [p for step in _steps(resumed, 12) for p in step]
    resumed.close()
    assert rest == [p for step in reference[7:] for p in step][:len(rest)]


def test_new_weights_on_resume_go_on_where_each_source_stood(urls, tmp_path):
    before = mixture(urls, tmp_path, infinite=True)
    head = _steps(before, 4)
    after = mixture(urls, tmp_path, (0.2, 0.2, 0.6), infinite=True)
    after.load_state_dict(before.state_dict())
    tail = _steps(after, 10)
    reference = _steps(mixture(urls, tmp_path / "ref", infinite=True), 40)
    for s in range(3):
        mine = [i for step in head + tail for src, i in step if src == s]
        theirs = [i for step in reference for src, i in step if src == s]
        common = min(len(mine), len(theirs))
        assert mine[:common] == theirs[:common]  # no sample repeated or skipped
    read = [src for step in tail for src, _ in step]
    assert abs(read.count(2) - 0.6 * len(read)) < 1  # the new weights from the resume on
    state = after.state_dict()["cursor"]
    assert [p["shares"] for p in state["phases"]][-1] == [1, 1, 3]
    assert len(state["source_cursors"]) == 3


def test_a_state_of_another_mixture_is_refused_naming_what_differs(urls, issue_urls,
                                                                  tmp_path):
    state = mixture(urls, tmp_path).state_dict()
    other = mixture([urls[0], issue_urls[1], urls[2]], tmp_path)
    with pytest.raises(CursorMismatchError, match="source 1 dataset fingerprint"):
        other.load_state_dict(state)
    with pytest.raises(CursorMismatchError, match="number of sources"):
        mixture(urls[:2], tmp_path, WEIGHTS[:2]).load_state_dict(state)
    single = StreamLoader(StreamDataset(urls[0], global_batch_size=6, cache_dir=str(tmp_path)))
    with pytest.raises(CursorMismatchError, match="single dataset"):
        mixture(urls, tmp_path).load_state_dict(single.state_dict())
    with pytest.raises(CursorMismatchError):
        single.load_state_dict(state)


def test_sources_must_agree_on_their_fields(urls, tmp_path):
    other = os.path.join(tmp_path, "other")
    write_dataset([{"x": i, "label": np.float32(i)} for i in range(12)], other)
    with pytest.raises(ConfigError, match=r"same fields.*label"):
        StreamDataset([Source(urls[0]), Source(other)], global_batch_size=4)
    dataset = StreamDataset([Source(urls[0], fields=["x"]), Source(other)], fields=["x"],
                            global_batch_size=4, cache_dir=str(tmp_path))
    assert dataset.schema.names == ["x"]
    floats = os.path.join(tmp_path, "floats")
    write_dataset([{"x": np.float32(i)} for i in range(12)], floats)
    with pytest.raises(ConfigError, match="field 'x' differs"):
        StreamDataset([Source(urls[0]), Source(floats)], fields=["x"], global_batch_size=4)
    for bad in ([], [urls[0]], [Source(urls[0]), "x"], 3):  # (a pathlib.Path is a folder)
        with pytest.raises(ConfigError):
            StreamDataset(bad, global_batch_size=4)
    for options in ({"weight": 0}, {"weight": math.inf}, {"repeat": 1, "samples": 3},
                    {"samples": 0}, {"fields": "x"}):
        with pytest.raises(ConfigError):
            Source(urls[0], **options)


def test_sources_share_one_cache_budget_and_one_prefetcher(urls, tmp_path):
    loader = mixture(urls, tmp_path)
    store = loader.dataset.reader.store
    assert isinstance(store, Prefetcher) and isinstance(store.cache, MixtureCache)
    caches = store.cache.caches
    assert len(caches) == 3 and len({c.cache_dir for c in caches}) == 1
    # eviction in one source's cache sees the other sources' next uses in the one plan
    store.cache.set_next_use(lambda shard: 100.0 + shard)
    base = int(store.cache.base[2])
    keys = [caches[2]._key(1), caches[0]._key(2), caches[1]._key(0), "datasets/other/000001.arrow"]
    assert caches[0]._next_uses(keys).tolist() == [
        100.0 + base + 1, 102.0, 100.0 + int(store.cache.base[1]), math.inf]
    needed = loader.dataset.working_set_bytes()
    one = StreamDataset(urls[0], global_batch_size=6, shuffle_window=8).working_set_bytes()
    assert needed > one
    with pytest.raises(CacheBudgetError, match="working set of the mixture"):
        mixture(urls, tmp_path, cache_limit=needed - 1)
    loader.close()


def _tenfold(sample: dict[str, Any]) -> dict[str, Any]:
    return {"y": sample["x"] * 10}


def _negated(sample: dict[str, Any]) -> dict[str, Any]:
    return {"y": -sample["x"]}


def test_per_source_transforms_in_worker_processes(urls, tmp_path):
    sources = [Source(urls[0], weight=2, transform=_tenfold), Source(urls[1], samples=4),
               Source(urls[2], repeat=0.5)]
    dataset = StreamDataset(sources, global_batch_size=4, transform=_negated, seed=1,
                            cache_dir=str(tmp_path))
    assert len(dataset) == dataset.cursor.num_samples // 4
    with StreamLoader(dataset, num_workers=2) as loader:
        batches = list(loader)
    for batch in batches:
        for s, i, y in zip(batch["__source__"].tolist(), batch["__id__"].tolist(),
                           batch["y"].tolist(), strict=True):
            assert y == (10 * i if s == 0 else -i)
    read = [s for b in batches for s in b["__source__"].tolist()]
    assert read.count(1) <= 4 and read.count(2) <= 8  # capped epochs


def _rank_body(rank: int, world: int, urls: list[str], cache: str) -> list[list[Any]]:
    loader = mixture(urls, cache, rank=None, world=None, batch=8, infinite=True)  # type: ignore
    assert loader.dataset.world_size == world
    steps = _steps(loader, 5)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, steps)
    loader.close()
    return [[p for r in range(world) for p in gathered[r][t]] for t in range(5)]


def test_two_gloo_ranks_read_the_global_batches_of_one(urls, tmp_path):
    reference = _steps(mixture(urls, tmp_path, batch=8, infinite=True), 5)
    results = run_ranks(_rank_body, 2, urls, str(tmp_path))
    for result in results:
        assert [[tuple(p) for p in step] for step in result.value] == reference


def test_replica_groups_refuse_a_mixture_clearly(urls: list[str], tmp_path: Path) -> None:
    from streamcache.replicas import ReplicaLoader

    dataset = mixture(urls, tmp_path).dataset
    with pytest.raises(ConfigError, match="mixture of Sources is not supported"):
        ReplicaLoader(dataset, num_groups=2, group=0)


# ---------------------------------------------------------------- every path against the model

ISSUE_SIZES = ([20, 30], [15, 15], [12, 8])  # 50, 30 and 20 samples
ISSUE_SHARES = (7, 2, 1)  # weights 0.7 / 0.2 / 0.1


@pytest.fixture(scope="module")
def issue_urls(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("mixture-issue")
    return [make_dataset(str(root / f"s{i}"), rows) for i, rows in enumerate(ISSUE_SIZES)]


def issue_mixture(urls: list[str], cache: Any, batch: int, **options: Any) -> StreamLoader:
    return mixture(urls, cache, tuple(s / 10 for s in ISSUE_SHARES), batch=batch, **options)


def issue_model(loader: StreamLoader) -> MixtureModel:
    dataset = loader.dataset
    return MixtureModel([list(rows) for rows in ISSUE_SIZES], ISSUE_SHARES,
                        dataset.options.seed, dataset.shuffle)


def _double(sample: dict[str, Any]) -> dict[str, Any]:
    return {"y": sample["x"] * 2}


def _double_batch(batch: dict[str, Any]) -> dict[str, Any]:
    return {"y": batch["x"] * 2}


def test_an_infinite_mixture_resumed_with_another_global_batch_goes_on_exactly(issue_urls,
                                                                              tmp_path):
    before = issue_mixture(issue_urls, tmp_path, 1, infinite=True, shuffle=False)
    head = _steps(before, 60)
    state = before.state_dict()
    assert state["cursor"]["samples_consumed"] == 60  # 11 positions short of the epoch's end
    # a global batch of 12 no longer fits the epoch's rest: it goes on into the next epoch,
    # read by two worker processes with a per-sample transform
    after = issue_mixture(issue_urls, tmp_path, 12, infinite=True, shuffle=False, workers=2,
                          transform=_double)
    after.load_state_dict(state)
    rest = _steps(after, 6)
    after.close()
    expected = issue_model(before).sequence(60 + 6 * 12)
    assert [p for step in head for p in step] == expected[:60]
    assert [p for step in rest for p in step] == expected[60:]


def test_set_epoch_of_an_infinite_mixture_starts_where_an_uninterrupted_run_reaches_it(
        issue_urls, tmp_path):
    uninterrupted = issue_mixture(issue_urls, tmp_path, 7, infinite=True)
    per_epoch = len(uninterrupted.dataset)  # steps of an epoch
    steps = _steps(uninterrupted, 3 * per_epoch + 2)
    assert uninterrupted.dataset.cursor.epoch == 3
    jumped = issue_mixture(issue_urls, tmp_path, 7, infinite=True)
    jumped.set_epoch(3)
    assert _steps(jumped, 2) == steps[3 * per_epoch:]
    model = issue_model(jumped)
    first = model.infinite_epoch_start(3, 7)
    assert [p for step in steps[3 * per_epoch:] for p in step] == \
        model.sequence(first + 14)[first:]
    # back to an earlier epoch, and on to a later one from the middle of an epoch
    jumped.set_epoch(1)
    assert _steps(jumped, 1) == [steps[per_epoch]]
    jumped.set_epoch(3)
    assert _steps(jumped, 1) == [steps[3 * per_epoch]]


def _split_tail_parts(urls: list[str], cache: Any, *, world: int, steps: int, restart: int,
                      **options: Any) -> list[list[dict[str, Any]]]:
    """Each rank's first ``steps`` batches of ``issue_mixture`` with ``tail="split"`` and a
    global batch of ``world`` (every rank's own loader, one after the other), restarted from
    the rank's state after ``restart`` steps. Returns ``parts[rank][step]``."""
    parts = []
    for rank in range(world):
        def make(rank: int = rank) -> StreamLoader:
            return issue_mixture(urls, cache, world, rank=rank, world=world, tail="split",
                                 **options)

        with make() as before:
            head = list(itertools.islice(_passes(before), restart))
            state = before.state_dict()
        with make() as after:
            after.load_state_dict(state)
            rest = list(itertools.islice(_passes(after), steps - restart))
        parts.append(head + rest)
    return parts


@pytest.mark.parametrize("infinite", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_split_tail_with_an_empty_part_on_a_rank_reads_every_sample_once(
        issue_urls, tmp_path, workers, infinite):
    """Weights 0.7/0.2/0.1 over 50/30/20 samples make an epoch of 71 positions; read in global
    batches of 3 by 3 ranks, its last step has 2 samples and rank 0's part is empty. Rank 0
    raised ValueError (zip() argument 2 is longer than argument 1) after a step, as the
    producer plans ahead, and again after every restart."""
    per_epoch = -(-71 // 3)
    parts = _split_tail_parts(issue_urls, tmp_path, world=3, steps=2 * per_epoch, restart=5,
                              infinite=infinite, workers=workers)
    empty = parts[0][per_epoch - 1]
    full = parts[0][0]  # the documented empty batch: a full one's structure, no rows
    assert {k: v.dtype for k, v in empty.items()} == {k: v.dtype for k, v in full.items()}
    assert all(len(value) == 0 for value in empty.values())
    read = [[p for rank in parts for p in pairs(rank[t])] for t in range(2 * per_epoch)]
    assert [len(step) for step in read] == ([3] * (per_epoch - 1) + [2]) * 2
    model = issue_model(issue_mixture(issue_urls, tmp_path, 3))
    assert model.epoch_length() == 71
    expected = model.sequence(2 * 71) if infinite else \
        model.finite_epoch(0) + model.finite_epoch(1)
    assert [p for step in read for p in step] == expected
    first = [p for step in read[:per_epoch] for p in step]
    assert sorted(i for s, i in first if s == 0) == list(range(50))  # each sample once
    assert len(set(first)) == len(first)


@pytest.mark.parametrize("kind", ["transform", "batch_transform"])
def test_transforms_keep_source_and_id(urls, tmp_path, kind):
    plain = _steps(mixture(urls, tmp_path), 4)
    function = _double if kind == "transform" else _double_batch
    transformed = mixture(urls, tmp_path, **{kind: function})
    for step, batch in zip(plain, transformed, strict=False):
        assert pairs(batch) == step  # __source__ and __id__ name the sample of the mixture
        assert batch["y"].tolist() == [2 * i for _, i in step]


def _read_as_ranks(urls: list[str], cache: Any, batch: int, steps: int, world: int,
                   state: dict[str, Any] | None, **options: Any,
                   ) -> tuple[list[list[tuple[int, int]]], dict[str, Any]]:
    """``steps`` global batches read by ``world`` ranks (each its own loader, from ``state``),
    and the state after them; every batch is checked to keep its bookkeeping keys. A finite
    mixture's ranks read on into the next epoch, as the model and a training loop do."""
    loaders = [mixture(urls, cache, rank=r, world=world, batch=batch, **options)
               for r in range(world)]
    parts = []
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
        mine = []
        for batch_ in itertools.islice(_passes(loader), steps):
            if "y" in batch_:  # a transform's output: the mixture's keys kept through it
                assert batch_["y"].tolist() == [2 * i for i in batch_["__id__"].tolist()]
            mine.append(pairs(batch_))
        parts.append(mine)
    assert all(loader.state_dict() == loaders[0].state_dict() for loader in loaders)
    return [[p for rank in parts for p in rank[t]] for t in range(steps)], \
        loaders[0].state_dict()


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(infinite=st.booleans(), world=st.sampled_from([1, 2]),
       plan=st.lists(st.tuples(st.sampled_from([2, 4, 6, 8]), st.integers(1, 4)), min_size=2,
                     max_size=3),
       kind=st.sampled_from([None, "transform", "batch_transform"]))
# a finite epoch (33 positions) whose rest after a step of 2 holds 3 steps of 8: the 4th step
# is the next epoch's first, as the model (and a training loop) goes on into it
@example(infinite=False, world=1, plan=[(2, 1), (8, 4)], kind=None)
# 28 of 33 positions read in steps of 4, then a global batch of 6: the rest of 5 ends the
# epoch with no step, and the next pass reads the next epoch
@example(infinite=False, world=1, plan=[(4, 3), (4, 4), (6, 1)], kind=None)
def test_resumes_with_other_batch_sizes_and_ranks_follow_the_model(urls, tmp_path, infinite,
                                                                   world, plan, kind):
    options: dict[str, Any] = {"infinite": infinite}
    if kind is not None:
        options[kind] = _double if kind == "transform" else _double_batch
    state, read = None, []
    for batch, steps in plan:
        got, state = _read_as_ranks(urls, tmp_path, batch, steps, world, state, **options)
        read += got
    dataset = mixture(urls, tmp_path).dataset
    model = MixtureModel([list(rows) for rows in SIZES], (5, 3, 2), dataset.options.seed,
                         dataset.shuffle)
    assert read == model.batches(infinite, plan)

def _relabel(steps: list[list[tuple[int, int]]], label: dict[int, int]
             ) -> list[list[tuple[int, int]]]:
    return [[(label[source], i) for source, i in step] for step in steps]


def test_sources_listed_in_another_order_resume_exactly(urls, tmp_path):
    reference = _steps(mixture(urls, tmp_path, infinite=True), 12)
    before = mixture(urls, tmp_path, infinite=True)
    head = _steps(before, 5)
    # the same sources and weights, listed as 2, 0, 1: read as saved, labelled as listed now
    listed = [urls[2], urls[0], urls[1]]
    after = mixture(listed, tmp_path, (WEIGHTS[2], WEIGHTS[0], WEIGHTS[1]), infinite=True)
    after.load_state_dict(before.state_dict())
    tail = _steps(after, 7)
    assert head + _relabel(tail, {1: 0, 2: 1, 0: 2}) == reference
    for batch_pairs in tail:  # __source__ is the index in today's list
        for source, i in batch_pairs:
            assert 0 <= i < [27, 10, 16][[2, 0, 1][source]]
    # its state, in the saved order, resumes the first listing as it was
    again = mixture(urls, tmp_path, infinite=True)
    again.load_state_dict(after.state_dict())
    assert head + _relabel(tail, {1: 0, 2: 1, 0: 2}) + _steps(again, 3) == \
        _steps(mixture(urls, tmp_path, infinite=True), 15)


def _same_shape_parquet(folder: Path, offset: int) -> str:
    """A Parquet dataset of 2 files x 30 rows, indexed without checksums: any offset gives
    files of the same names and sizes (so the same fingerprint), with other values."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streamcache import build_index

    folder.mkdir(parents=True)
    for part in range(2):
        values = np.arange(30, dtype=np.int64) + 30 * part + offset
        pq.write_table(pa.table({"x": values}), folder / f"part-{part}.parquet",
                       compression="none", use_dictionary=False, write_statistics=False)
    build_index(str(folder), checksums=False)
    return str(folder)


@pytest.fixture(scope="module")
def same_shape(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("same-shape")
    return _same_shape_parquet(root / "a", 0), _same_shape_parquet(root / "b", 1000)


def test_a_state_is_bound_to_its_data_not_to_its_shape(same_shape, tmp_path):
    from streamcache import load_index

    a, b = same_shape
    assert load_index(a).fingerprint == load_index(b).fingerprint  # the attack's premise

    def single(url: str, **options: Any) -> StreamLoader:
        return StreamLoader(StreamDataset(url, global_batch_size=8, seed=3,
                                          cache_dir=str(tmp_path), **options))

    first = single(a)
    next(iter(first))
    state = first.state_dict()
    assert state["cursor"]["data"]["location"].endswith("/a")
    with pytest.raises(CursorMismatchError, match=r"location: saved .*/a', now .*/b'.*"
                                                  r"resume_check=\"fingerprint\""):
        single(b).load_state_dict(state)
    # a copy of A elsewhere (index.json copied with it): refused too, unless the user says
    # it is the same data
    copy = tmp_path / "copy-of-a"
    shutil.copytree(a, copy)
    with pytest.raises(CursorMismatchError, match="location"):
        single(str(copy)).load_state_dict(state)
    moved = single(str(copy), resume_check="fingerprint")
    moved.load_state_dict(state)
    resumed = single(a)
    resumed.load_state_dict(state)
    assert [b["x"].tolist() for b in moved] == [b["x"].tolist() for b in resumed]
    # a mixture of both: the sources are told apart, listed in any order
    two = mixture([a, b], tmp_path, (0.5, 0.5), batch=8, infinite=True)
    reference = _steps(mixture([a, b], tmp_path, (0.5, 0.5), batch=8, infinite=True), 12)
    head = _steps(two, 4)
    swapped = mixture([b, a], tmp_path, (0.5, 0.5), batch=8, infinite=True)
    swapped.load_state_dict(two.state_dict())
    assert head + _relabel(_steps(swapped, 8), {0: 1, 1: 0}) == reference


# ---------------------------------------------------------------- states of earlier versions

#: A finite mixture's loader state as written before version 2 (by 71efce6, over datasets of
#: SIZES with WEIGHTS, seed 5, global batch 6, shuffle_window 8, after 2 steps; the
#: fingerprints are of the datasets written then), and the (source, id) pairs that code read
#: after loading it: the rest of epoch 0, then epoch 1.
V1_STATE = {'version': 1,
            'cursor': {'version': 1,
                       'kind': 'mixture',
                       'sources': [{'dataset_fingerprint': 'xxh64:9deb87cf6d0df7dc',
                                    'num_samples': 27,
                                    'epoch_samples': 27},
                                   {'dataset_fingerprint': 'xxh64:b956ad09aba1ddac',
                                    'num_samples': 10,
                                    'epoch_samples': 10},
                                   {'dataset_fingerprint': 'xxh64:eba7f9f087256301',
                                    'num_samples': 16,
                                    'epoch_samples': 16}],
                       'seed': 5,
                       'shuffle': {'enabled': True,
                                   'window': 8,
                                   'window_unit': 'samples',
                                   'stagger': True},
                       'infinite': False,
                       'epoch': 0,
                       'epoch_start': 0,
                       'num_samples': 32,
                       'samples_consumed': 12,
                       'phases': [{'start': 0, 'counts': [0, 0, 0], 'shares': [5, 3, 2]}],
                       'source_cursors': [[0, 6], [0, 4], [0, 2]]}}
V1_REST = [[[0, 0], [2, 1], [0, 7], [1, 7], [0, 3], [1, 9]],
           [[0, 14], [2, 4], [0, 13], [1, 6], [0, 1], [2, 5]],
           [[0, 4], [1, 4], [0, 5], [1, 2], [0, 23], [2, 13]],
           [[0, 19], [1, 5], [0, 17], [2, 9], [0, 22], [1, 2]],
           [[0, 18], [1, 4], [0, 15], [2, 13], [0, 24], [1, 3]],
           [[0, 26], [2, 15], [0, 25], [1, 7], [0, 20], [1, 8]],
           [[0, 21], [2, 11], [0, 16], [1, 0], [0, 1], [2, 7]],
           [[0, 7], [1, 1], [0, 6], [1, 9], [0, 2], [2, 5]]]


def test_a_version_1_state_resumes_as_it_did(urls, tmp_path):
    from streamcache import load_index

    state = copy.deepcopy(V1_STATE)
    for source, url in zip(state["cursor"]["sources"], urls, strict=True):
        source["dataset_fingerprint"] = load_index(url).fingerprint  # these datasets' own
    loader = mixture(urls, tmp_path)
    loader.load_state_dict(state)  # the sources have checksums: their fingerprints suffice
    rest = [pairs(b) for b in loader] + [pairs(b) for b in loader]
    assert [[list(p) for p in step] for step in rest] == V1_REST
    assert loader.state_dict()["cursor"]["version"] == 2


def test_a_version_1_state_of_data_without_checksums_is_refused_unless_asked(same_shape,
                                                                          tmp_path):
    a, _ = same_shape

    def single(**options: Any) -> StreamLoader:
        return StreamLoader(StreamDataset(a, global_batch_size=8, seed=3,
                                          cache_dir=str(tmp_path), **options))

    current = single().state_dict()["cursor"]
    old = {k: v for k, v in current.items() if k != "data"} | {"version": 1,
                                                                "samples_consumed": 16}
    with pytest.raises(CursorMismatchError, match=r"older streamcache.*resume_check"):
        single().load_state_dict({"version": 1, "cursor": old})
    loader = single(resume_check="fingerprint")
    loader.load_state_dict({"version": 1, "cursor": old})
    assert loader.state_dict()["cursor"]["samples_consumed"] == 16
    assert loader.state_dict()["cursor"]["data"] == current["data"]  # bound from now on
