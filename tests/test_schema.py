"""Field kinds, the schema and their Arrow layout (streamcache/format/schema.py), bad input
included: an index's schema is untrusted input, and every refusal says what is wrong."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from streamcache.errors import SchemaError
from streamcache.format.schema import (
    MAX_DIMS,
    MAX_FIELDS,
    Field,
    Schema,
    infer_field,
    infer_schema,
    normalize_dtype,
)


@pytest.mark.parametrize(("spec", "expected"), [
    ("int", Field.tensor("f", "int64")),
    ("float", Field.tensor("f", "float64")),
    ("bytes", Field("f", "bytes")),
    ("str", Field("f", "str")),
    ("sequence:int32", Field.sequence("f", "int32")),
    ("tensor:float32", Field.tensor("f", "float32")),
    ("tensor:uint8:3x32x32", Field.tensor("f", "uint8", (3, 32, 32))),
    (" tensor:uint8:3,4 ", Field.tensor("f", "uint8", (3, 4))),
])
def test_parse_short_specs(spec: str, expected: Field) -> None:
    assert Field.parse("f", spec) == expected


@pytest.mark.parametrize(("spec", "message"), [
    ("integer", "cannot parse 'integer'"),
    ("int:64", "cannot parse"),
    ("sequence", "cannot parse"),
    ("tensor:uint8:3xA", "bad shape '3xA'"),
    ("tensor:uint8:3x0", "zero or negative dimension"),
    ("tensor:object", "not supported"),
    ("sequence:nonsense", "not a numpy dtype|data type"),
])
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Field.parse("f", spec)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Field("", "str"), "non-empty strings"),
    (lambda: Field("__id__", "str"), "reserved"),
    (lambda: Field("f", "image"), "unknown kind 'image'"),
    (lambda: Field("f", "tensor"), "needs a dtype"),
    (lambda: Field("f", "bytes", "uint8"), "no dtype or shape"),
    (lambda: Field("f", "sequence", "int32", (3,)), "only tensors have a shape"),
    (lambda: Field.tensor("f", "float32", (2, -1)), "zero or negative"),
])
def test_invalid_fields_are_refused_with_the_reason(make, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        make()


def test_dtypes_are_little_endian_and_fixed_size() -> None:
    assert normalize_dtype(">i4", field="f") == np.dtype("<i4")
    assert Field.tensor("f", ">f8").dtype == "float64"
    for bad in ("U5", "O", [("a", "i4")], "(2,)i4"):
        with pytest.raises(SchemaError, match="field 'f'"):
            normalize_dtype(bad, field="f")


def test_arrow_types_and_widths() -> None:
    assert Field.tensor("f", "int64").arrow_type() == pa.int64()
    assert Field.tensor("f", "float32", (2, 3)).arrow_type() == pa.list_(pa.float32(), 6)
    assert Field.tensor("f", "float32", (2, 3)).row_bytes == 24
    assert Field.tensor("f", "bool", (5,)).arrow_type() == pa.binary(5)  # raw bytes, not bits
    assert Field.sequence("f", "int32").arrow_type() == pa.large_list(pa.int32())
    assert Field.sequence("f", "int32").elem_size == 4
    assert Field.sequence("f", "complex64").arrow_type() == pa.large_binary()
    assert Field.sequence("f", "complex64").elem_size == 1
    assert Field("f", "bytes").arrow_type() == pa.large_binary()
    assert Field("f", "str").arrow_type() == pa.large_string()
    assert Field("f", "str").numpy_dtype == np.uint8
    assert Field.tensor("f", "int8").fixed_width and not Field("f", "str").fixed_width
    arrow = Field.tensor("f", "uint8", (2,)).arrow_field()
    assert not arrow.nullable and b"streamcache" in arrow.metadata


def test_schema_json_round_trip_select_and_lookup() -> None:
    schema = Schema.coerce({"a": "int", "b": Field("b", "str"), "c": "tensor:uint8:2x2"})
    assert Schema.from_json(schema.to_json()) == schema
    assert hash(Schema.from_json(schema.to_json())) == hash(schema)
    assert schema.names == ["a", "b", "c"] and len(schema) == 3 and "b" in schema
    assert schema.select(["c", "a"]).names == ["c", "a"] and schema.select(None) is schema
    assert schema.arrow_schema().names == ["a", "b", "c"]
    with pytest.raises(SchemaError, match=r"no field 'z'; the dataset has \['a', 'b', 'c'\]"):
        schema["z"]
    with pytest.raises(SchemaError, match="at least one field"):
        Schema([])
    with pytest.raises(SchemaError, match=r"duplicate field names: \['a'\]"):
        Schema([Field("a", "str"), Field("a", "bytes")])


@pytest.mark.parametrize(("obj", "message"), [
    ({"fields": []}, "a schema is a list"),
    ([{"name": "x", "kind": "str"}] * 2, "duplicate field names"),
    (["x"], "a schema field is a str, not an object"),
    ([{"name": "x"}], "lacks the key 'kind'"),
    ([{"name": 3, "kind": "str"}], "malformed schema field"),
    ([{"name": "x", "kind": "tensor", "dtype": "uint8", "shape": [0]}], "malformed"),
    ([{"name": "x", "kind": "tensor", "dtype": "uint8", "shape": [True]}], "malformed"),
    ([{"name": "x", "kind": "tensor", "dtype": "uint8", "shape": [2] * (MAX_DIMS + 1)}],
     "malformed"),
    ([{"name": "x", "kind": "tensor", "dtype": "float64", "shape": [2**30, 2**30]}],
     "over the cap"),
    ([{"name": "x" * 5000, "kind": "str"}], "malformed"),
])
def test_untrusted_schema_json_is_checked(obj: object, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Schema.from_json(obj)


def test_a_schema_over_the_field_cap_is_refused() -> None:
    with pytest.raises(SchemaError, match=f"at most {MAX_FIELDS} fields"):
        Schema.from_json([{"name": f"f{i}", "kind": "str"} for i in range(MAX_FIELDS + 1)])


def test_infer_from_sample_values() -> None:
    schema = infer_schema({"b": b"\x00", "s": "text", "flag": True, "i": 3, "x": 1.5,
                           "tokens": np.arange(4, dtype=np.int32),
                           "image": np.zeros((2, 3), np.uint8), "scalar": np.float32(1)})
    assert schema == Schema([
        Field("b", "bytes"), Field("s", "str"), Field.tensor("flag", "bool"),
        Field.tensor("i", "int64"), Field.tensor("x", "float64"),
        Field.sequence("tokens", "int32"), Field.tensor("image", "uint8", (2, 3)),
        Field.tensor("scalar", "float32"),
    ])
    with pytest.raises(SchemaError, match="'n' is None"):
        infer_field("n", None)
    with pytest.raises(SchemaError, match="field 'o'"):
        infer_field("o", {"nested": 1})
    with pytest.raises(SchemaError, match="empty sample"):
        infer_schema({})
