"""From gathered rows to batches (streamcache/loading/batching.py): the per-sample seeding and
splitting a transform runs through give what the plain definitions give."""

from __future__ import annotations

import random

import numpy as np
import torch

from streamcache.format.reader import Ragged, bytes_as_rows
from streamcache.format.schema import Field
from streamcache.loading.batching import (
    ID_KEY,
    SEED_KEY,
    gathering,
    sample_columns,
)
from streamcache.loading.seeding import GlobalRngSeeder, seed_global_rngs


def _draws() -> tuple[float, float, int, float, float]:
    return (random.random(), random.gauss(0, 1), int(np.random.randint(1 << 30)),
            float(np.random.standard_normal()), float(torch.rand(1)))


def test_the_sample_seeder_seeds_like_seed_global_rngs(backend: str) -> None:
    seed_all = GlobalRngSeeder()
    for seed in (0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 0x1234_5678_9ABC_DEF0):
        random.gauss(0, 1)  # leaves a cached second normal that seeding must clear
        np.random.standard_normal()  # numpy's too
        seed_global_rngs(seed)
        want = _draws()
        random.gauss(0, 1)
        np.random.standard_normal()
        seed_all(seed)
        assert _draws() == want, seed


def test_a_sample_sees_no_normal_cached_by_the_one_before(backend: str) -> None:
    """numpy keeps the second of each pair of normals; a sample that draws one leaves the
    other behind, and the next sample must not get it."""
    seed_all = GlobalRngSeeder()
    seed_all(1)
    float(np.random.standard_normal())  # one drawn, one cached
    seed_all(2)
    after_a_draw = float(np.random.standard_normal())
    seed_global_rngs(2)
    assert float(np.random.standard_normal()) == after_a_draw


def test_sample_dicts_give_python_scalars_row_views_and_bytes() -> None:
    fields = {"x": Field.tensor("x", "int64"), "img": Field.tensor("img", "uint8", (2, 2)),
              "when": Field.tensor("when", "datetime64[s]"), "b": Field("b", "bytes"),
              "t": Field.sequence("t", "int32")}
    arrays = {
        "x": np.array([3, 4], np.int64), "img": np.arange(8, dtype=np.uint8).reshape(2, 2, 2),
        "when": np.array([0, 86_400], "datetime64[s]"),
        "b": Ragged.from_rows([b"ab", b""]),
        "t": Ragged(np.arange(3, dtype=np.int32), np.array([0, 1, 3])),
        ID_KEY: np.array([10, 11], np.int64), SEED_KEY: [5, 6],
    }
    samples = list(sample_columns(arrays, fields).dicts())
    assert [s["x"] for s in samples] == [3, 4] and type(samples[0]["x"]) is int
    assert [s["when"] for s in samples] == [arrays["when"][0].item(), arrays["when"][1].item()]
    assert np.array_equal(samples[1]["img"], arrays["img"][1])
    assert [s["b"] for s in samples] == [b"ab", b""]
    assert samples[1]["t"].tolist() == [1, 2]
    assert [(s[ID_KEY], s[SEED_KEY]) for s in samples] == [(10, 5), (11, 6)]
    assert type(samples[0][ID_KEY]) is int


def test_bytes_are_gathered_as_rows_where_the_batch_hands_out_bytes_objects() -> None:
    def rows_form(ragged: str, transform: bool, batch_transform: bool) -> bool:
        with gathering(ragged, transform=transform, batch_transform=batch_transform):
            return _inside()

    assert rows_form("padded", False, False) and rows_form("offsets", True, False)
    assert not rows_form("offsets", False, False)
    assert not rows_form("padded", True, True)  # a batch transform receives Ragged values


def _inside() -> bool:
    from streamcache.format import reader

    return reader._BYTES_AS_ROWS.get()


def test_bytes_as_rows_ends_with_its_block() -> None:
    with bytes_as_rows():
        assert _inside()
    assert not _inside()


def test_a_loader_hands_out_bytes_fields_in_each_form(tmp_path) -> None:
    from streamcache import StreamDataset, StreamLoader, write_dataset

    write_dataset(({"b": bytes([i]) * (i % 4), "x": i} for i in range(12)),
                  str(tmp_path / "ds"))
    want = [bytes([i]) * (i % 4) for i in range(6)]

    def first_batch(**options: object) -> dict:
        dataset = StreamDataset(str(tmp_path / "ds"), global_batch_size=6, shuffle=False,
                                cache_dir=str(tmp_path / "cache"), rank=0, world_size=1,
                                **options)  # type: ignore[arg-type]
        with StreamLoader(dataset) as loader:
            return next(iter(loader))

    padded = first_batch()
    assert padded["b"] == want and all(type(row) is bytes for row in padded["b"])
    offsets = first_batch(ragged="offsets")
    assert offsets["b"].numpy().tobytes() == b"".join(want)
    assert offsets["b_offsets"].tolist() == [0, 0, 1, 3, 6, 6, 7]
    seen = first_batch(transform=lambda s: {"b": type(s["b"]).__name__, "n": len(s["b"])})
    assert seen["b"] == ["bytes"] * 6 and seen["n"].tolist() == [len(w) for w in want]

    def batch_transform(arrays: dict) -> dict:
        assert isinstance(arrays["b"], Ragged)
        return {"b_values": arrays["b"].values.copy(), "x": arrays["x"]}

    batched = first_batch(batch_transform=batch_transform)
    assert batched["b_values"].numpy().tobytes() == b"".join(want)
