"""Between values, Arrow arrays and raw buffers (streamcache/format/columns.py): lossless
normalization, canonical columns, foreign Arrow types, and zero-copy buffers of slices."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from streamcache.errors import SchemaError
from streamcache.format.columns import (
    build_column,
    column_buffers,
    field_from_arrow,
    normalize_value,
    to_canonical,
)
from streamcache.format.schema import Field

TOKENS = Field.sequence("tokens", "int32")
IMAGE = Field.tensor("image", "uint8", (2, 3))


def test_normalize_converts_losslessly_or_says_why_not() -> None:
    assert normalize_value(Field("s", "str"), "é") == "é"
    assert normalize_value(Field("b", "bytes"), bytearray(b"ab")) == b"ab"
    assert normalize_value(Field("b", "bytes"), np.frombuffer(b"ab", np.uint8)) == b"ab"
    small = normalize_value(TOKENS, [1, 2, 3])
    assert small.dtype == np.int32 and small.tolist() == [1, 2, 3]
    assert normalize_value(TOKENS, np.arange(3, dtype=np.int16)).dtype == np.int32  # safe
    cases = [
        (Field("s", "str"), b"x", "is a str field, got bytes"),
        (Field("b", "bytes"), "x", "is a bytes field, got str"),
        (TOKENS, None, "cannot be null"),
        (TOKENS, "123", "is a sequence, got str"),
        (Field.tensor("i", "int8"), 300, "300 does not fit int8"),
        (TOKENS, np.arange(3, dtype=np.int64), "int64 cannot be stored as int32 without loss"),
        (IMAGE, np.zeros((3, 2), np.uint8), r"shape \(3, 2\) does not match .* \(2, 3\)"),
        (TOKENS, np.zeros((2, 2), np.int32), "1-d sequence, got an array of shape"),
    ]
    for field, value, message in cases:
        with pytest.raises(SchemaError, match=message):
            normalize_value(field, value)


@pytest.mark.parametrize(("field", "values"), [
    (Field.tensor("i", "int64"), [np.int64(v) for v in (5, -1, 7)]),
    (IMAGE, [np.full((2, 3), v, np.uint8) for v in (1, 2, 3)]),
    (Field.tensor("flag", "bool"), [np.bool_(v) for v in (True, False, True)]),
    (TOKENS, [np.arange(n, dtype=np.int32) for n in (0, 3, 1)]),
    (Field.sequence("z", "complex64"), [np.ones(n, np.complex64) * n for n in (2, 0, 1)]),
    (Field("b", "bytes"), [b"", b"abc", b"d"]),
    (Field("s", "str"), ["x", "", "yz"]),
])
def test_columns_round_trip_through_their_raw_buffers(field: Field, values: list) -> None:
    column = build_column(field, values)
    assert column.type == field.arrow_type() and len(column) == 3
    for start in (0, 1):  # a slice: the views start where the slice does
        part = column.slice(start)
        buffers = column_buffers(field, part)
        rows = values[start:]
        if field.fixed_width:
            assert buffers.offsets is None
            expected = b"".join(np.asarray(v, field.numpy_dtype).tobytes() for v in rows)
            assert buffers.data.tobytes() == expected
        else:
            assert buffers.offsets is not None and len(buffers.offsets) == len(rows) + 1
            for row, value in enumerate(rows):
                lo, hi = buffers.offsets[row], buffers.offsets[row + 1]
                size = field.elem_size
                got = buffers.data[lo * size:hi * size].tobytes()
                if isinstance(value, str):
                    value = value.encode()
                assert got == (value if isinstance(value, bytes) else value.tobytes())


def test_a_tensor_column_from_one_stacked_array_or_no_rows() -> None:
    stacked = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    assert build_column(IMAGE, stacked).equals(build_column(IMAGE, list(stacked)))
    assert len(build_column(IMAGE, [])) == 0 and len(build_column(TOKENS, [])) == 0


def test_column_buffers_refuse_non_canonical_arrays() -> None:
    with pytest.raises(SchemaError, match=r"not the canonical .* materialized first"):
        column_buffers(TOKENS, pa.array([[1, 2]], pa.list_(pa.int32())))
    with pytest.raises(SchemaError, match="holds nulls"):
        column_buffers(Field("s", "str"), pa.array(["a", None], pa.large_string()))


@pytest.mark.parametrize(("arrow_type", "expected"), [
    (pa.int16(), Field.tensor("c", "int16")),
    (pa.float32(), Field.tensor("c", "float32")),
    (pa.bool_(), Field.tensor("c", "bool")),
    (pa.timestamp("ms"), Field.tensor("c", "datetime64[ms]")),
    (pa.duration("us"), Field.tensor("c", "timedelta64[us]")),
    (pa.list_(pa.list_(pa.float32(), 3), 2), Field.tensor("c", "float32", (2, 3))),
    (pa.list_(pa.int64()), Field.sequence("c", "int64")),
    (pa.large_list(pa.uint8()), Field.sequence("c", "uint8")),
    (pa.binary(), Field("c", "bytes")),
    (pa.binary(4), Field("c", "bytes")),
    (pa.string(), Field("c", "str")),
    (pa.dictionary(pa.int32(), pa.string()), Field("c", "str")),
    (pa.struct([("bytes", pa.binary()), ("path", pa.string())]), Field("c", "bytes")),
])
def test_foreign_arrow_types_map_to_fields(arrow_type: pa.DataType, expected: Field) -> None:
    assert field_from_arrow(pa.field("c", arrow_type)) == expected


def test_our_own_fields_come_back_from_their_metadata_and_others_are_refused() -> None:
    assert field_from_arrow(IMAGE.arrow_field()) == IMAGE
    with pytest.raises(SchemaError, match=r"column 'c' has Arrow type .* cannot read"):
        field_from_arrow(pa.field("c", pa.struct([("a", pa.int32())])))
    with pytest.raises(SchemaError, match="timestamp"):
        field_from_arrow(pa.field("c", pa.timestamp("s", tz="UTC")))


def test_to_canonical_casts_foreign_columns_and_names_where_it_failed() -> None:
    ints = to_canonical(TOKENS, pa.chunked_array([[[1, 2]], [[3]]], pa.list_(pa.int64())),
                        where="f.parquet")
    assert ints.type == TOKENS.arrow_type() and ints.to_pylist() == [[1, 2], [3]]
    text = to_canonical(Field("s", "str"), pa.array(["a", "b", "a"]).dictionary_encode(),
                        where="f")
    assert text.type == pa.large_string() and text.to_pylist() == ["a", "b", "a"]
    nested = pa.array([[[1, 2, 3], [4, 5, 6]]], pa.list_(pa.list_(pa.uint8())))
    assert to_canonical(IMAGE, nested, where="f").type == IMAGE.arrow_type()
    flags = to_canonical(Field.tensor("b", "bool"), pa.array([True, False]), where="f")
    assert column_buffers(Field.tensor("b", "bool"), flags).data.tolist() == [1, 0]
    media = pa.array([{"bytes": b"png", "path": "a.png"}],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    assert to_canonical(Field("m", "bytes"), media, where="f").to_pylist() == [b"png"]
    failures = [
        (TOKENS, pa.array([[1], None], pa.list_(pa.int64())), "holds 1 nulls"),
        (TOKENS, pa.array([[1, None]], pa.list_(pa.int64())), "null elements inside"),
        (Field.tensor("i", "int8"), pa.array([1000], pa.int64()), "cannot be read as tensor"),
        (IMAGE, pa.array([[[1, 2]]], pa.list_(pa.list_(pa.uint8()))), "shape"),
        (Field("m", "bytes"), pa.array([{"bytes": None, "path": "a.png"}], media.type),
         "refers to 1 files by path only"),
    ]
    for field, array, message in failures:
        with pytest.raises(SchemaError, match=message) as caught:
            to_canonical(field, array, where="part-0.parquet")
        assert "part-0.parquet" in str(caught.value)
