"""A chunked shard read in place, its record batches located by the native walk of the file's
bytes (csrc/ipc.h, format/ipc_chunks.py) instead of pyarrow's per-batch objects.

The walk reads an untrusted file: whatever its bytes, the reader gives the rows pyarrow gives,
or one of streamcache's errors, never a crash, a raw error or other rows. The native walk and
its twin agree on every file, damaged ones included. Random damage prints how to replay it
(``STREAMCACHE_FUZZ_SEED``).
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from seeds import schedule_seed

from streamcache import Field, Schema, ShardWriter, _core, _native
from streamcache._twin_ipc import UNSUPPORTED, _Flat
from streamcache._twin_ipc import check_ipc_offsets as twin_check_offsets
from streamcache._twin_ipc import ipc_record_batches as twin_batches
from streamcache.errors import SchemaError, ShardCorruptError, StreamcacheError
from streamcache.format.index import load_index
from streamcache.format.ipc_chunks import _counts
from streamcache.format.reader import ShardReader, gather

SCHEMA = Schema([Field.tensor("x", np.float32, (3,)), Field.tensor("label", np.int64),
                 Field.sequence("tokens", np.int32), Field.sequence("half", np.float16),
                 Field("blob", "bytes"), Field.tensor("when", "datetime64[ms]")])
ROWS = 300


def _sample(i: int) -> dict[str, object]:
    return {"x": np.full(3, i, np.float32), "label": i, "tokens": np.arange(i % 9, dtype=np.int32),
            "half": np.full(i % 4, i % 7, np.float16), "blob": bytes([i % 256]) * (i % 6),
            "when": np.datetime64(i, "ms")}


def _write(root: Path, schema: Schema = SCHEMA, rows: int = ROWS) -> Path:
    """One uncompressed shard of many small chunks (what a local dataset read in place is)."""
    with ShardWriter(str(root / "ds"), schema=schema, compression=None,
                     chunk_size=512) as writer:
        for i in range(rows):
            writer.write({f.name: _sample(i)[f.name] for f in schema})
    return Path(load_index(str(root / "ds")).shard_url(0))


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("ipc"))


def _everything(reader: ShardReader) -> dict[str, list[object]]:
    rows = np.arange(reader.num_rows, dtype=np.int64)
    batch = gather([reader], np.zeros(len(rows), np.int32), rows, list(reader.schema))
    return {name: (value.tolist() if isinstance(value, np.ndarray) else
                   [np.asarray(v).tolist() for v in value])
            for name, value in batch.items()}


def _read(path: Path, backend: str, walked: bool = False,
          ) -> dict[str, list[object]] | type[StreamcacheError]:
    """Every row through the native walk where it applies (``native``) or pyarrow alone
    (``twin``), or the type of the error it raised; ``walked``: the walk must be used."""
    with _native.use(backend):
        try:
            with ShardReader(str(path), SCHEMA) as reader:
                if walked and reader._views:
                    raise AssertionError("the native walk was not used")
                return _everything(reader)
        except StreamcacheError as error:
            return type(error)


def _counts_of(schema: pa.Schema) -> tuple[int, int]:
    counts = [_counts(f.type) for f in schema]
    assert all(c is not None for c in counts)
    return sum(c[0] for c in counts if c), sum(c[1] for c in counts if c)


def test_a_chunked_file_gives_the_rows_pyarrow_gives_without_an_object_per_chunk(shard) -> None:
    with ShardReader(str(shard), SCHEMA) as reader:
        assert reader._chunks is not None and reader._chunks.count > 20
        assert reader._views == {}  # located natively
        assert reader._batch.num_rows == ROWS  # (inspection reads it with pyarrow on demand)
    native, pyarrow_only = _read(shard, "native", walked=True), _read(shard, "twin")
    assert native == pyarrow_only
    assert isinstance(native, dict) and native["label"] == list(range(ROWS))


def test_the_native_walk_and_its_twin_agree_on_every_file_damaged_or_not(shard) -> None:
    data = shard.read_bytes()
    nodes, buffers = _counts_of(ipc.open_file(pa.py_buffer(data)).schema)
    chooser = random.Random(schedule_seed("STREAMCACHE_FUZZ_SEED"))
    outcomes = set()
    for case in range(400):
        damaged = bytearray(data)
        if case % 4 == 0:
            damaged = damaged[:chooser.randrange(len(data))]
        else:  # flips where the walk reads: the footer and the messages' flatbuffers
            for _ in range(chooser.randint(1, 4)):
                at = chooser.choice([chooser.randrange(len(data) - 600, len(data)),
                                     chooser.randrange(len(data))])
                damaged[at] ^= 1 << chooser.randrange(8)
        file = np.frombuffer(bytes(damaged), dtype=np.uint8)
        native, twin = (walk(file, nodes, buffers) for walk in (_core.ipc_record_batches,
                                                                 twin_batches))
        assert native[:3] == twin[:3], (case, native[:3], twin[:3])
        for got, want in zip(native[3:], twin[3:], strict=True):
            assert np.array_equal(got, want), case
        outcomes.add(native[0])
    assert outcomes >= {0, 2}  # both some files read and some refused


def test_the_offsets_check_and_its_twin_agree(shard) -> None:
    chooser = random.Random(schedule_seed("STREAMCACHE_FUZZ_SEED"))
    data = bytearray(shard.read_bytes())
    for _ in range(200):
        at = np.array([chooser.randrange(-8, len(data) + 16) // 8 * 8 for _ in range(3)],
                      dtype=np.int64)
        count = np.array([chooser.randrange(-1, 40) for _ in range(3)], dtype=np.int64)
        values = np.array([chooser.randrange(-1, 400) for _ in range(3)], dtype=np.int64)
        elem = chooser.choice([1, 2, 4, 0])
        file = np.frombuffer(bytes(data), dtype=np.uint8)
        assert _core.check_ipc_offsets(file, at, count, values, elem) == \
            twin_check_offsets(file, at, count, values, elem)


def test_a_damaged_chunked_file_gives_its_rows_or_a_streamcache_error(shard, tmp_path) -> None:
    """Random damage through the whole reader: where pyarrow reads the file, the walk gives
    its rows or an error; where pyarrow refuses a file damaged in one place and the walk reads
    it, its rows are the undamaged file's (the damage was in what the walk does not need);
    anything else is one of streamcache's errors (_read returns nothing else)."""
    data = shard.read_bytes()
    original = _read(shard, "twin")
    chooser = random.Random(schedule_seed("STREAMCACHE_FUZZ_SEED"))
    damaged_path = tmp_path / "damaged.arrow"
    for case in range(150):
        damaged = bytearray(data)
        flips = chooser.randint(1, 3)
        for _ in range(flips):
            damaged[chooser.randrange(len(data))] ^= 1 << chooser.randrange(8)
        damaged_path.write_bytes(bytes(damaged))
        native, pyarrow_only = _read(damaged_path, "native"), _read(damaged_path, "twin")
        if isinstance(native, dict) and isinstance(pyarrow_only, dict):
            assert native == pyarrow_only, case
        elif isinstance(native, dict) and flips == 1:
            assert native == original, case


def _buffer_entry(data: bytes, batch: int, index: int) -> int:
    """Where the offset of buffer ``index`` of record batch ``batch`` is written in the file
    (a walk of the footer and the batch's message, with the twin's reader)."""
    length = struct.unpack_from("<i", data, len(data) - 10)[0]
    footer = _Flat(memoryview(data), len(data) - 10 - length, length)
    blocks = footer.follow(footer.field(footer.follow(0), 3)) + 4  # Footer.recordBatches
    offset = footer.i64(blocks + 24 * batch)
    start = 8 if struct.unpack_from("<I", data, offset)[0] == 0xFFFFFFFF else 4
    message = _Flat(memoryview(data), offset + start, len(data) - offset - start)
    header = message.follow(message.field(message.follow(0), 2))  # Message.header
    entries = message.follow(message.field(header, 2)) + 4  # RecordBatch.buffers
    return offset + start + entries + 16 * index


@pytest.mark.parametrize("damage", ["buffer past the body", "offsets decrease",
                                    "footer length", "block count"])
def test_hostile_structures_are_refused_naming_the_file(shard, tmp_path, damage: str) -> None:
    data = bytearray(shard.read_bytes())
    file = np.frombuffer(bytes(data), dtype=np.uint8)
    nodes, buffers = _counts_of(ipc.open_file(pa.py_buffer(bytes(data))).schema)
    _, _, _, rows, _, located = _core.ipc_record_batches(file, nodes, buffers)
    pairs = located.reshape(-1, buffers, 2)
    body = int(pairs[1][:, 0].min())  # (batch 1's first buffer: where its body starts)
    if damage == "buffer past the body":  # batch 1's x values (its third buffer) moved away
        entry = _buffer_entry(bytes(data), 1, 2)
        assert struct.unpack_from("<qq", data, entry) == (pairs[1][2][0] - body, pairs[1][2][1])
        struct.pack_into("<q", data, entry, 1 << 40)
    elif damage == "offsets decrease":
        arrow_schema = ipc.open_file(pa.py_buffer(bytes(data))).schema
        before = sum(_counts(f.type)[1] for f in arrow_schema  # type: ignore[index]
                     if arrow_schema.get_field_index(f.name) < arrow_schema.get_field_index(
                         "tokens"))
        at, count = int(pairs[1][before + 1][0]), int(rows[1])  # tokens: validity, offsets
        struct.pack_into("<q", data, at + 8 * count, 0)  # the last offset below the others
        struct.pack_into("<q", data, at, 5)
    elif damage == "footer length":
        struct.pack_into("<i", data, len(data) - 10, len(data) + 7)
    else:
        length = struct.unpack_from("<i", data, len(data) - 10)[0]
        footer = len(data) - 10 - length
        flat = _Flat(memoryview(bytes(data)), footer, length)
        vector = flat.follow(flat.field(flat.follow(0), 3))  # Footer.recordBatches
        assert flat.u32(vector) == len(rows)
        struct.pack_into("<I", data, footer + vector, 1 << 30)
    damaged = tmp_path / "hostile.arrow"
    damaged.write_bytes(bytes(data))
    walked = _core.ipc_record_batches(np.frombuffer(bytes(data), dtype=np.uint8), nodes,
                                      buffers)
    if damage != "offsets decrease":
        assert walked[0] == 2  # refused by the walk itself: CORRUPT
    # then the reader is pyarrow's: its rows, or its refusal naming the file
    native, pyarrow_only = _read(damaged, "native"), _read(damaged, "twin")
    assert native == pyarrow_only
    with pytest.raises(ShardCorruptError, match=r"hostile\.arrow"):
        ShardReader(str(damaged), SCHEMA)


def test_what_the_walk_does_not_read_is_read_by_pyarrow(tmp_path) -> None:
    """Compressed bodies, dictionary columns and str fields (UTF-8, checked by pyarrow) are
    read as before; a column with nulls is the SchemaError it always was."""
    from streamcache._twin_checks import INVALID

    table = pa.table({"x": pa.array(np.arange(200, dtype=np.int64)),
                      "s": pa.array([f"é{i}" for i in range(200)], type=pa.large_string())})
    schema = Schema([Field.tensor("x", np.int64), Field("s", "str")])
    for name, options in [("zstd", ipc.IpcWriteOptions(compression="zstd")),
                          ("plain", ipc.IpcWriteOptions())]:
        path = tmp_path / f"{name}.arrow"
        with ipc.new_file(str(path), table.schema, options=options) as writer:
            for batch in table.to_batches(max_chunksize=16):
                writer.write_batch(batch)
        file = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        walked = _core.ipc_record_batches(file, 2, 5)
        assert walked[:2] == ((INVALID, UNSUPPORTED) if name == "zstd" else (0, -1))
        for fields in (schema, Schema([schema["x"]])):
            with ShardReader(str(path), fields) as reader:
                assert bool(reader._views) == (name == "zstd" or "s" in fields.names)
                rows = _everything(reader)
            assert rows["x"] == list(range(200))
            if "s" in rows:
                assert rows["s"][:2] == ["é0", "é1"]
    with_nulls = tmp_path / "nulls.arrow"
    nullable = pa.table({"x": pa.array([1, None] * 50, type=pa.int64())})
    with ipc.new_file(str(with_nulls), nullable.schema) as writer:
        for batch in nullable.to_batches(max_chunksize=10):
            writer.write_batch(batch)
    with pytest.raises(SchemaError, match="nulls"):
        ShardReader(str(with_nulls), Schema([Field.tensor("x", np.int64)]))
