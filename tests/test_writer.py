"""ShardWriter and the readers: round trips, schemas, and what a failed write leaves."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from format_helpers import assert_sample_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.errors import (
    DestinationError,
    EmptyDatasetError,
    IndexNotFoundError,
    SchemaError,
    StreamcacheError,
)
from streamcache.format.index import load_index
from streamcache.format.materialize import is_local_layout
from streamcache.format.schema import Field, Schema
from streamcache.format.writer import ShardWriter, write_dataset
from streamcache.loading.dataset_reader import DatasetReader

_counter = itertools.count()

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "datetime64[ms]", "timedelta64[s]"]


@st.composite
def schemas(draw: st.DrawFn) -> Schema:
    n = draw(st.integers(1, 5))
    fields = []
    for i in range(n):
        kind = draw(st.sampled_from(["tensor", "sequence", "bytes", "str"]))
        if kind == "tensor":
            shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
            fields.append(Field.tensor(f"f{i}", draw(st.sampled_from(DTYPES)), shape))
        elif kind == "sequence":
            fields.append(Field.sequence(f"f{i}", draw(st.sampled_from(DTYPES))))
        else:
            fields.append(Field(f"f{i}", kind))
    return Schema(fields)


def random_value(field: Field, rng: np.random.Generator) -> Any:
    if field.kind == "bytes":
        return rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8).tobytes()
    if field.kind == "str":
        return "".join(chr(int(c)) for c in rng.integers(32, 0x3000, int(rng.integers(0, 12))))
    shape = field.shape if field.kind == "tensor" else (int(rng.integers(0, 9)),)
    raw = rng.integers(0, 256, int(np.prod(shape)) * field.numpy_dtype.itemsize, dtype=np.uint8)
    value = raw.view(field.numpy_dtype).reshape(shape)
    if field.numpy_dtype.kind == "b":
        value = raw.astype(bool).reshape(shape)
    if field.numpy_dtype.kind in "fc":
        value = np.nan_to_num(value)  # NaN payloads are fine, but equality is easier without
    return value


@given(schema=schemas(), n=st.integers(1, 60), seed=st.integers(0, 2**32 - 1),
       compression=st.sampled_from(["zstd", None, "lz4"]),
       protocol=st.sampled_from(["local", "memory"]),
       shard_size=st.sampled_from([200, 4000, 1 << 20]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip_every_field_kind(schema: Schema, n: int, seed: int, compression: str | None,
                                     protocol: str, shard_size: int) -> None:
    rng = np.random.default_rng(seed)
    samples = [{f.name: random_value(f, rng) for f in schema} for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        dst = (os.path.join(tmp, "ds") if protocol == "local"
               else f"memory://roundtrip-{next(_counter)}")
        index = write_dataset(samples, dst, schema=schema, shard_size=shard_size,
                              compression=compression)
        assert index.num_samples == n
        assert load_index(dst).fingerprint == index.fingerprint
        for name in _native.available_backends():
            with _native.use(name), DatasetReader(dst, local_dir=os.path.join(tmp, "c")) as reader:
                for i in rng.permutation(n)[:10]:
                    assert_sample_equal(samples[i], reader[int(i)])
                ids = rng.permutation(n)
                batch = reader.read_batch(ids)
                for f in schema:
                    column = batch[f.name]
                    for pos, i in enumerate(ids[:15]):
                        got = column[pos]
                        assert_sample_equal({f.name: samples[i][f.name]}, {f.name: got})


def test_schema_inferred_from_first_sample(tmp_path) -> None:
    index = write_dataset(
        [{"tokens": np.arange(i, dtype=np.int32), "image": np.zeros((2, 3), np.uint8),
          "label": i, "score": 0.5, "caption": "a", "jpeg": b"\xff"} for i in range(3)],
        str(tmp_path / "ds"),
    )
    kinds = {f.name: (f.kind, f.dtype, f.shape) for f in index.schema}
    assert kinds == {
        "tokens": ("sequence", "int32", ()), "image": ("tensor", "uint8", (2, 3)),
        "label": ("tensor", "int64", ()), "score": ("tensor", "float64", ()),
        "caption": ("str", None, ()), "jpeg": ("bytes", None, ()),
    }


def test_shards_are_cut_near_the_target_size(tmp_path) -> None:
    samples = ({"x": np.zeros(1000, np.uint8)} for _ in range(1000))  # 1 MB raw in all
    index = write_dataset(samples, str(tmp_path / "ds"), shard_size=100_000, compression=None,
                          schema={"x": "tensor:uint8:1000"})
    assert len(index.shards) == 10
    assert all(s.rows == 100 for s in index.shards)
    assert all(s.checksum and s.checksum.startswith("xxh64:") for s in index.shards)


def test_write_batch_fast_path_equals_row_path(tmp_path) -> None:
    table = pa.table({"t": pa.array([[1, 2], [3], []], pa.list_(pa.int32())),
                      "s": ["a", "bb", "ccc"], "v": pa.array([1.5, 2.5, 3.5], pa.float32())})
    with ShardWriter(str(tmp_path / "a")) as writer:
        writer.write_batch(table)
    with ShardWriter(str(tmp_path / "b"), schema=writer.schema) as row_writer:
        for row in table.to_pylist():
            row_writer.write(row)
    a, b = DatasetReader(str(tmp_path / "a")), DatasetReader(str(tmp_path / "b"))
    for i in range(3):
        assert_sample_equal(a[i], b[i])
    assert a.index.schema == b.index.schema
    a.close()
    b.close()


def test_sample_mismatch_names_the_field(tmp_path) -> None:
    with ShardWriter(str(tmp_path / "ds")) as writer:
        writer.write({"x": np.zeros((2, 2), np.float32), "y": "s"})
        with pytest.raises(SchemaError, match="'x': shape"):
            writer.write({"x": np.zeros((3, 2), np.float32), "y": "s"})
        with pytest.raises(SchemaError, match="'x': dtype float64 cannot be stored"):
            writer.write({"x": np.zeros((2, 2), np.float64), "y": "s"})
        with pytest.raises(SchemaError, match="'y' is a str field"):
            writer.write({"x": np.zeros((2, 2), np.float32), "y": 3})
        with pytest.raises(SchemaError, match=r"missing fields \['y'\]"):
            writer.write({"x": np.zeros((2, 2), np.float32)})
        with pytest.raises(SchemaError, match=r"unexpected fields \['z'\]"):
            writer.write({"x": np.zeros((2, 2), np.float32), "y": "s", "z": 1})
        with pytest.raises(SchemaError, match="cannot be null"):
            writer.write({"x": None, "y": "s"})
    assert load_index(str(tmp_path / "ds")).num_samples == 1


def test_python_ints_are_range_checked(tmp_path) -> None:
    with ShardWriter(str(tmp_path / "ds"), schema={"t": "sequence:int16"}) as writer:
        writer.write({"t": [1, 2, 3]})
        with pytest.raises(SchemaError, match="does not fit int16"):
            writer.write({"t": [70000]})


@pytest.mark.parametrize("value", [np.array(["a"], dtype=object), np.zeros(2, "U3"),
                                   np.zeros(2, [("a", "i4")])])
def test_unsupported_dtype_is_a_clear_error(tmp_path, value: np.ndarray) -> None:
    with pytest.raises(SchemaError, match="not supported"), ShardWriter(
        str(tmp_path / "ds")
    ) as writer:
        writer.write({"x": value})


def test_exception_in_with_body_publishes_no_index(tmp_path) -> None:
    dst = str(tmp_path / "ds")
    with pytest.raises(RuntimeError), ShardWriter(dst, shard_size=100) as writer:
        for i in range(50):
            writer.write({"x": i})
        raise RuntimeError("the producer failed")
    assert not os.path.exists(os.path.join(dst, "index.json"))
    with pytest.raises(IndexNotFoundError, match="streamcache index"):
        DatasetReader(dst)


def test_empty_dataset_publishes_nothing(tmp_path) -> None:
    dst = str(tmp_path / "ds")
    writer = ShardWriter(dst)
    with pytest.raises(EmptyDatasetError, match="no samples"):
        writer.close()
    assert not os.path.exists(os.path.join(dst, "index.json"))


def test_existing_dataset_needs_overwrite(tmp_path) -> None:
    dst = str(tmp_path / "ds")
    write_dataset([{"x": 1}], dst)
    with pytest.raises(DestinationError, match="overwrite=True"):
        ShardWriter(dst)
    index = write_dataset([{"x": 2}, {"x": 3}], dst, overwrite=True)
    assert index.num_samples == 2
    with DatasetReader(dst) as reader:
        assert reader[1]["x"] == 3


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_unwritable_destination(tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(DestinationError, match="permission denied"):
        ShardWriter(str(locked / "ds"))


def test_unwritable_destination_even_as_root(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(DestinationError, match="cannot write"):
        ShardWriter(str(blocker / "ds"))


def test_closed_writer_refuses_writes(tmp_path) -> None:
    writer = ShardWriter(str(tmp_path / "ds"))
    writer.write({"x": 1})
    index = writer.close()
    assert writer.close() is index
    with pytest.raises(StreamcacheError, match="closed"):
        writer.write({"x": 2})


def test_index_json_is_versioned_and_relative(tmp_path) -> None:
    dst = tmp_path / "ds"
    write_dataset(({"x": i} for i in range(10)), str(dst), shard_size=16)
    obj = json.loads((dst / "index.json").read_text())
    assert obj["format"] == "streamcache-index" and obj["version"] == 1
    assert obj["num_samples"] == 10
    assert all(not s["path"].startswith("/") for s in obj["shards"])
    moved = tmp_path / "moved"
    os.rename(dst, moved)  # relative paths: a dataset can be moved or copied
    with DatasetReader(str(moved)) as reader:
        assert [reader[i]["x"] for i in range(10)] == list(range(10))


# ------------------------------------------------------------ compression where it pays


def _blob(i: int) -> dict[str, Any]:
    return {"id": i, "x": np.random.default_rng(i).integers(0, 256, 5_000, dtype=np.uint8)}


def _token(i: int) -> dict[str, Any]:
    return {"id": i, "x": (np.arange(5_000) % 7 + i).astype(np.uint8)}


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_incompressible_shards_are_stored_uncompressed_and_compressible_ones_compressed(
        tmp_path, codec: str) -> None:
    """Random bytes (what JPEG or audio look like to a codec) are stored uncompressed and the
    index says so; data the codec shrinks keeps it; both read back exactly."""
    samples = [_blob(i) for i in range(40)] + [_token(i) for i in range(40, 80)]
    index = write_dataset(iter(samples), str(tmp_path / "ds"), shard_size=100_000,
                          compression=codec)
    kinds = {s.compression for s in index.shards}
    assert kinds == {None, codec}
    with DatasetReader(index) as reader:
        for shard in index.shards:
            path = str(tmp_path / "ds" / shard.path)
            # an uncompressed file is the layout a reader maps where it lies; a compressed
            # one's buffers must be decoded into memory first
            assert is_local_layout(path, index.schema) == (shard.compression is None)
        batch = reader.read_batch(np.arange(80))
    for i, sample in enumerate(samples):
        assert batch["id"][i] == sample["id"]
        assert bytes(np.asarray(batch["x"][i])) == bytes(sample["x"])


def test_min_savings_zero_compresses_every_shard_and_a_high_one_none(tmp_path) -> None:
    always = write_dataset((_blob(i) for i in range(30)), str(tmp_path / "a"),
                           shard_size=50_000, compression_min_savings=0)
    assert {s.compression for s in always.shards} == {"zstd"}
    never = write_dataset((_token(i) for i in range(30)), str(tmp_path / "b"),
                          shard_size=50_000, compression_min_savings=0.999)
    assert {s.compression for s in never.shards} == {None}
    plain = write_dataset((_token(i) for i in range(30)), str(tmp_path / "c"),
                          shard_size=50_000, compression=None)
    assert {s.compression for s in plain.shards} == {None}


@pytest.mark.parametrize("value", [-0.1, 1, 1.5, float("nan"), float("inf"), True, "0.1", None])
def test_a_bad_min_savings_is_refused_before_anything_is_written(tmp_path, value: Any) -> None:
    with pytest.raises(ValueError, match=r"compression_min_savings must be a number in \[0, 1\)"):
        ShardWriter(str(tmp_path / "ds"), compression_min_savings=value)
    assert not (tmp_path / "ds").exists() or not any((tmp_path / "ds").iterdir())
