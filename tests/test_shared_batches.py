"""Batches from worker processes through shared slots (streamcache/loading/shared_batches.py):
the tensors arrive equal, a slot is written again only once no tensor of it is alive, and
whatever does not fit a slot travels torch's way, unchanged."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch
from loader_helpers import loader, make_dataset

from streamcache.loading.shared_batches import SharedBatch, SlotReader, SlotWriter

Pair = collections.namedtuple("Pair", ["inputs", "targets"])


def _batch(step: int) -> dict[str, Any]:
    return {
        "x": torch.arange(12, dtype=torch.float32).view(3, 4) + step,
        "bf": torch.full((5,), step, dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, bool(step % 2)]),
        "scalar": torch.tensor(step),
        "empty": torch.empty(0, 7),
        "strided": torch.arange(20).view(4, 5)[:, ::2],  # not contiguous
        "pair": Pair(torch.ones(2, 2) * step, [torch.tensor([step]), "label"]),
        "names": ["a", "b", "c"],
        "grad": torch.ones(2, requires_grad=True),  # left to torch's own way
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bool(torch.equal(a.detach(), b.detach()))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


def test_every_kind_of_batch_comes_back_equal() -> None:
    writer, reader = SlotWriter(slots=3), SlotReader()
    for step in range(6):
        packed = writer.pack(_batch(step))
        assert isinstance(packed, SharedBatch)
        assert (packed.segment is not None) == (step == 0)  # the segment travels once
        out = reader.unpack(packed)
        assert _equal(out, _batch(step))
        assert out["grad"].requires_grad and not out["x"].requires_grad
    assert (reader.shared, reader.copied) == (6, 0)


def test_a_slot_is_written_again_only_when_no_tensor_of_it_lives() -> None:
    """A loop that keeps every batch (or only a view of one) sees each as it was made."""
    writer, reader = SlotWriter(slots=2), SlotReader()
    kept = []
    for step in range(5):
        out = reader.unpack(writer.pack(_batch(step)))
        kept.append(out["x"][1])  # a view: enough to keep the slot
        del out
    for step, view in enumerate(kept):
        assert torch.equal(view, torch.arange(4, 8, dtype=torch.float32) + step)
    assert (reader.shared, reader.copied) == (2, 3)  # both slots held: the rest was copied
    kept.clear()
    reader.give_back()
    assert isinstance(writer.pack(_batch(9)), SharedBatch)


def test_a_larger_batch_gets_a_larger_segment_and_the_old_batches_stay_valid() -> None:
    writer, reader = SlotWriter(slots=2), SlotReader()
    small = reader.unpack(writer.pack({"x": torch.ones(10)}))
    large = reader.unpack(writer.pack({"x": torch.arange(100_000)}))
    assert torch.equal(small["x"], torch.ones(10))
    assert torch.equal(large["x"], torch.arange(100_000))
    assert reader.shared == 2


def test_a_batch_without_tensors_or_too_large_travels_as_it_is() -> None:
    writer, reader = SlotWriter(slots=2), SlotReader()
    assert reader.unpack(writer.pack(["a", 1])) == ["a", 1]
    too_large = torch.empty(1, dtype=torch.uint8).expand(1 << 30)  # 1 GiB of view: no slot
    packed = writer.pack({"big": too_large})
    assert not isinstance(packed, SharedBatch)
    assert reader.unpack(packed)["big"] is too_large
    assert reader.copied == 2


def test_tensors_that_share_memory_travel_torchs_way_and_still_share_it() -> None:
    writer = SlotWriter(slots=2)
    base = torch.arange(10)
    assert not isinstance(writer.pack({"whole": base, "part": base[2:5]}), SharedBatch)
    assert isinstance(writer.pack({"a": torch.arange(3), "b": torch.arange(3),
                                   "empty": torch.empty(0), "none": torch.empty(0, 2)}),
                      SharedBatch)


def test_a_first_batch_without_bytes_travels_as_it_is_and_later_ones_get_slots() -> None:
    """A worker whose first batch is a split tail's empty part has no segment yet."""
    writer, reader = SlotWriter(slots=2), SlotReader()
    empty = {"x": torch.empty(0, dtype=torch.int64), "t": torch.empty(0, 0, dtype=torch.int32)}
    assert _equal(reader.unpack(writer.pack(empty)), empty)
    full = {"x": torch.arange(3), "t": torch.ones(3, 2, dtype=torch.int32)}
    assert isinstance(writer.pack(full), SharedBatch)
    assert _equal(reader.unpack(writer.pack(empty)), empty)


def _ids(batch: Any) -> list[int]:
    return batch["__id__"].tolist()


def test_worker_processes_send_batches_through_slots(tmp_path: Any) -> None:
    from streamcache import StreamDataset, StreamLoader, write_dataset

    write_dataset(({"x": np.full(64, i, np.float32), "y": i} for i in range(96)),
                  str(tmp_path / "ds"))

    def loader(workers: int) -> StreamLoader:
        dataset = StreamDataset(str(tmp_path / "ds"), global_batch_size=8, rank=0,
                                world_size=1, cache_dir=str(tmp_path / "cache"),
                                transform=_double)
        return StreamLoader(dataset, num_workers=workers)

    with loader(0) as plain:
        want = list(plain)
    with loader(2) as workers:
        it = iter(workers)
        got = list(it)
        reader = it._source._slots  # type: ignore[attr-defined]
    assert [_ids(b) for b in got] == [_ids(b) for b in want]
    assert all(_equal(g, w) for g, w in zip(got, want, strict=True))
    assert reader.shared >= len(got) - 4  # all kept by this test: slots run out near the end


def _double(sample: dict[str, Any]) -> dict[str, Any]:
    return {"x": torch.from_numpy(sample["x"]) * 2, "y": sample["y"]}


def _structure(batch: dict[str, Any]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {key: (value.dtype, tuple(value.shape)) for key, value in batch.items()}


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_split_tail_gives_an_empty_part_the_documented_empty_batch(tmp_path: Any,
                                                                     workers: int) -> None:
    """5 samples in shards of 2 and 3, world 4, global batch 4, ``tail="split"``: the last
    step has 1 sample, so ranks 0-2 get an empty batch (a full batch's keys and dtypes, no
    rows). With 2 worker processes, the worker whose first batch was that empty one raised
    AssertionError in SlotWriter.pack (no shared segment yet)."""
    url = make_dataset(str(tmp_path / "ds"), [2, 3])

    def read(rank: int, workers: int) -> list[dict[str, Any]]:
        with loader(url, str(tmp_path / "cache"), rank=rank, world=4, workers=workers,
                    global_batch_size=4, tail="split") as rank_loader:
            return list(rank_loader)

    for rank in range(4):
        got, plain = read(rank, workers), read(rank, 0)
        assert len(got) == 2
        assert [_structure(b) for b in got] == [_structure(b) for b in plain]
        assert all(_equal(g, p) for g, p in zip(got, plain, strict=True))
        full, last = got
        assert last.keys() == full.keys()
        assert all(last[k].dtype == full[k].dtype for k in full)
        assert len(last["__id__"]) == (1 if rank == 3 else 0)
        assert all(len(value) == len(last["__id__"]) for value in last.values())
