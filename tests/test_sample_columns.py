"""A per-sample transform's samples: split into columns where the step is read, made into
dicts a small run at a time where they are transformed (batching.SampleColumns), so a pass
costs Python's collector what a DataLoader with the same transform costs it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache.format.columns import build_column
from streamcache.format.schema import Field, Schema
from streamcache.format.writer import ShardWriter
from streamcache.loading.batching import DICTS_AT_ONCE, SampleColumns, sample_columns
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader

ROWS, WIDTH, BATCH = 64 * 256, 256, 256  # 64 steps of 256 rows of 1 KB


@given(count=st.integers(0, 3 * DICTS_AT_ONCE + 5), extra=st.integers(0, 3))
@settings(max_examples=40, deadline=None)
def test_dicts_are_the_samples_in_order_whatever_the_count(count: int, extra: int) -> None:
    names = ("a", "__id__", *(f"f{i}" for i in range(extra)))
    values = tuple([(name, i) for i in range(count)] for name in names)
    dicts = list(SampleColumns(names, values).dicts())
    assert dicts == [{name: (name, i) for name in names} for i in range(count)]
    assert all(list(d) == list(names) for d in dicts)  # keys in the columns' order


def test_columns_of_unequal_length_are_an_error_not_a_short_batch() -> None:
    columns = SampleColumns(("a", "b"), ([1, 2, 3], [1, 2]))
    with pytest.raises(ValueError, match="unequal length"):
        list(columns.dicts())
    assert list(sample_columns({}, {}).dicts()) == []


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, np.ndarray]:
    rows = np.random.default_rng(3).integers(0, 50_000, (ROWS, WIDTH), dtype=np.int32)
    root = str(tmp_path_factory.mktemp("columns") / "ds")
    schema = Schema([Field.tensor("tokens", "int32", (WIDTH,))])
    with ShardWriter(root, schema=schema, compression=None) as writer:
        writer.write_batch(pa.table({"tokens": build_column(schema.fields[0], rows)}))
    return root, rows


def cast(sample: dict[str, Any]) -> dict[str, Any]:
    """A light transform, as a tokenizer's output is cast for an embedding lookup."""
    return {"tokens": torch.from_numpy(sample["tokens"]).long()}


class YoungCollections:
    """Counts Python's youngest-generation collections while the block runs."""

    def __init__(self) -> None:
        self.count = 0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        self.count += phase == "start" and info["generation"] == 0

    def __enter__(self) -> YoungCollections:
        gc.collect()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


class Rows(torch.utils.data.Dataset):
    """The DataLoader's side: a map-style dataset of the same rows, with the transform."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return cast({"tokens": np.array(self.rows[i])})


def batches(loader: Any) -> Iterator[Any]:
    for batch in loader:
        assert batch["tokens"].shape == (BATCH, WIDTH) and batch["tokens"].dtype == torch.int64
        yield batch


def test_a_transform_pass_costs_the_collector_what_the_dataloader_does(
        data: tuple[str, np.ndarray]) -> None:
    """A reader's group of steps (here 8 of 256 rows) split into dicts at once counted 2,048
    allocations for the collector until the loop freed them: 4-5x the DataLoader's
    youngest collections, whose survivors (the loop's tensors) filled the older generations
    and ran full collections (~65 ms each once torch is imported)."""
    root, rows = data
    if gc.get_threshold()[0] < 100:
        pytest.skip(f"the collector's threshold is {gc.get_threshold()}")
    baseline = torch.utils.data.DataLoader(Rows(rows), batch_size=BATCH, shuffle=True)
    with YoungCollections() as theirs:
        assert sum(1 for _ in batches(baseline)) == ROWS // BATCH
    dataset = StreamDataset(root, batch_size=BATCH, rank=0, world_size=1, seed=7,
                            transform=cast, cache_dir=str(root) + "-cache")
    seen: list[np.ndarray] = []
    with StreamLoader(dataset) as loader, YoungCollections() as ours:
        for batch in batches(loader):
            seen.append(batch["__id__"].numpy())
    ids = np.concatenate(seen)
    assert np.array_equal(np.sort(ids), np.arange(ROWS))  # every sample once
    print(f"\nyoungest collections: StreamLoader {ours.count}, DataLoader {theirs.count}")
    assert ours.count <= 2 * theirs.count + 4, (ours.count, theirs.count)
