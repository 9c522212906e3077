"""Field kinds, the dataset schema, and how each field is laid out in Arrow.

A field is one of four kinds:

- ``tensor``: a fixed-shape array of any fixed-size numpy dtype (shape ``()`` is a scalar;
  Python ``int`` and ``float`` are int64 and float64 scalars);
- ``sequence``: a variable-length 1-d array (tokens);
- ``bytes``: an opaque byte string (an encoded image);
- ``str``: a UTF-8 string.

Every kind has one canonical Arrow type, used in shards written by streamcache and in the
uncompressed local layout. Fixed-width kinds are one packed buffer with a constant row
stride; variable-width kinds are int64 offsets plus a values buffer, which is what the native
gather reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import SchemaError

KINDS = ("tensor", "sequence", "bytes", "str")
MAX_FIELDS = 10_000  # caps on a schema read from an index (untrusted input)
MAX_NAME_CHARS = 1024
MAX_DIMS = 32
MAX_ROW_BYTES = 1 << 40
FIELD_METADATA_KEY = b"streamcache"

# numpy dtypes that Arrow stores natively as primitives (bool is bit-packed in Arrow, so it
# travels as raw bytes like complex, datetime and timedelta).
_ARROW_PRIMITIVES = {
    "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
    "uint8": pa.uint8(), "uint16": pa.uint16(), "uint32": pa.uint32(), "uint64": pa.uint64(),
    "float16": pa.float16(), "float32": pa.float32(), "float64": pa.float64(),
}


def normalize_dtype(dtype: Any, *, field: str) -> np.dtype:
    """A little-endian, fixed-size numpy dtype, or a :class:`SchemaError` naming ``field``."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise SchemaError(f"field {field!r}: {dtype!r} is not a numpy dtype") from exc
    if dt.kind not in "biufcmM" or dt.fields is not None or dt.subdtype is not None:
        raise SchemaError(
            f"field {field!r}: dtype {dt} is not supported; use a numeric, bool, complex, "
            "datetime64 or timedelta64 dtype, or a 'str'/'bytes' field for text and blobs"
        )
    return dt.newbyteorder("<") if dt.byteorder == ">" else dt


@dataclass(frozen=True)
class Field:
    """One named field of a dataset. Build with the class methods, not the constructor."""

    name: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise SchemaError(f"field names must be non-empty strings, not {self.name!r}")
        if self.name.startswith("__"):
            raise SchemaError(
                f"field {self.name!r}: names starting with '__' are reserved (e.g. __id__)"
            )
        if self.kind not in KINDS:
            raise SchemaError(f"field {self.name!r}: unknown kind {self.kind!r}; use {KINDS}")
        if self.kind in ("tensor", "sequence"):
            if self.dtype is None:
                raise SchemaError(f"field {self.name!r}: a {self.kind} needs a dtype")
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype, field=self.name).name)
        elif self.dtype is not None or self.shape:
            raise SchemaError(f"field {self.name!r}: a {self.kind} field has no dtype or shape")
        shape = tuple(int(s) for s in self.shape)
        if self.kind != "tensor" and shape:
            raise SchemaError(f"field {self.name!r}: only tensors have a shape")
        if any(s <= 0 for s in shape):
            raise SchemaError(
                f"field {self.name!r}: shape {shape} has a zero or negative dimension"
            )
        object.__setattr__(self, "shape", shape)

    @classmethod
    def tensor(cls, name: str, dtype: Any, shape: Iterable[int] = ()) -> Field:
        return cls(name, "tensor", np.dtype(dtype).name, tuple(shape))

    @classmethod
    def sequence(cls, name: str, dtype: Any) -> Field:
        return cls(name, "sequence", np.dtype(dtype).name)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The element dtype (uint8 for bytes and str)."""
        return np.dtype(self.dtype) if self.dtype is not None else np.dtype(np.uint8)

    @property
    def fixed_width(self) -> bool:
        return self.kind == "tensor"

    @property
    def row_bytes(self) -> int:
        """Bytes per row of a fixed-width field."""
        return self.numpy_dtype.itemsize * math.prod(self.shape)

    @property
    def elem_size(self) -> int:
        """Bytes per element of a variable-width field's values buffer in the local layout."""
        if self.kind == "sequence" and self.dtype in _ARROW_PRIMITIVES:
            return self.numpy_dtype.itemsize
        return 1

    def arrow_type(self) -> pa.DataType:
        """The canonical Arrow type of this field."""
        if self.kind == "bytes":
            return pa.large_binary()
        if self.kind == "str":
            return pa.large_string()
        primitive = _ARROW_PRIMITIVES.get(str(self.dtype))
        if self.kind == "sequence":
            return pa.large_list(primitive) if primitive is not None else pa.large_binary()
        if primitive is None:
            return pa.binary(self.row_bytes)
        if not self.shape:
            return primitive
        return pa.list_(primitive, math.prod(self.shape))

    def arrow_field(self) -> pa.Field:
        meta = {FIELD_METADATA_KEY: json.dumps(self.to_json()).encode()}
        return pa.field(self.name, self.arrow_type(), nullable=False, metadata=meta)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.kind == "tensor":
            out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Field:
        """A field from its JSON form, read from an index (untrusted: every value's type and
        range is checked; a tensor row is at most :data:`MAX_ROW_BYTES`)."""
        if not isinstance(obj, Mapping):
            raise SchemaError(f"a schema field is a {type(obj).__name__}, not an object")
        try:
            name, kind, dtype = obj["name"], obj["kind"], obj.get("dtype")
        except KeyError as exc:
            raise SchemaError(f"a schema field lacks the key {exc}: {dict(obj)!r}") from exc
        shape = obj.get("shape", [])
        if not (isinstance(name, str) and len(name) <= MAX_NAME_CHARS and isinstance(kind, str)
                and (dtype is None or isinstance(dtype, str)) and isinstance(shape, list)
                and len(shape) <= MAX_DIMS
                and all(type(s) is int and 0 < s < 2**31 for s in shape)):
            raise SchemaError(
                f"malformed schema field {_brief(obj)}: expected a name (string of at most "
                f"{MAX_NAME_CHARS} characters), a kind, a dtype string and a shape of at most "
                f"{MAX_DIMS} positive integers"
            )
        field = cls(name, kind, dtype, tuple(shape))
        if field.fixed_width and field.row_bytes > MAX_ROW_BYTES:
            raise SchemaError(f"field {name!r}: a row of shape {field.shape} takes "
                              f"{field.row_bytes} bytes, over the cap of {MAX_ROW_BYTES}")
        return field

    @classmethod
    def parse(cls, name: str, spec: str) -> Field:
        """Parse a short spec: ``int``, ``float``, ``bytes``, ``str``, ``sequence:int32``,
        ``tensor:float32`` (a scalar) or ``tensor:uint8:3x32x32``."""
        parts = spec.strip().split(":")
        head = parts[0]
        if head == "int" and len(parts) == 1:
            return cls.tensor(name, "int64")
        if head == "float" and len(parts) == 1:
            return cls.tensor(name, "float64")
        if head in ("bytes", "str") and len(parts) == 1:
            return cls(name, head)
        if head == "sequence" and len(parts) == 2:
            return cls(name, "sequence", parts[1])
        if head == "tensor" and len(parts) in (2, 3):
            dims = parts[2] if len(parts) == 3 else ""
            try:
                shape = tuple(int(d) for d in dims.replace(",", "x").split("x") if d)
            except ValueError as exc:
                raise SchemaError(f"field {name!r}: bad shape {dims!r} in {spec!r}") from exc
            return cls(name, "tensor", parts[1], shape)
        raise SchemaError(
            f"field {name!r}: cannot parse {spec!r}; use int, float, bytes, str, "
            "sequence:DTYPE or tensor:DTYPE[:DxDx...]"
        )


class Schema:
    """An ordered collection of fields with unique names."""

    def __init__(self, fields: Iterable[Field]) -> None:
        self.fields: tuple[Field, ...] = tuple(fields)
        names = [f.name for f in self.fields]
        if not names:
            raise SchemaError("a schema needs at least one field")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise SchemaError(f"duplicate field names: {duplicates}")
        self._by_name = {f.name: f for f in self.fields}

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __getitem__(self, name: str) -> Field:
        try:
            return self._by_name[name]
        except KeyError:
            raise SchemaError(
                f"no field {name!r}; the dataset has {self.names}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and self.fields == other.fields

    def __hash__(self) -> int:
        return hash(self.fields)

    def __repr__(self) -> str:
        return f"Schema({list(self.fields)!r})"

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def select(self, names: Iterable[str] | None) -> Schema:
        """The sub-schema of the named fields, in the given order (all fields for None)."""
        return self if names is None else Schema(self[n] for n in names)

    def arrow_schema(self) -> pa.Schema:
        return pa.schema([f.arrow_field() for f in self.fields])

    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self.fields]

    @classmethod
    def from_json(cls, obj: Any) -> Schema:
        """A schema from its JSON form (a list of fields; untrusted, checked)."""
        if not isinstance(obj, list) or len(obj) > MAX_FIELDS:
            raise SchemaError(f"a schema is a list of at most {MAX_FIELDS} fields, not "
                              f"{_brief(obj)}")
        return cls(Field.from_json(f) for f in obj)

    @classmethod
    def coerce(cls, spec: Schema | Mapping[str, Field | str] | Iterable[Field]) -> Schema:
        """A Schema from a Schema, a ``{name: Field | spec string}`` mapping or Fields."""
        if isinstance(spec, Schema):
            return spec
        if isinstance(spec, Mapping):
            return cls(
                v if isinstance(v, Field) else Field.parse(k, v) for k, v in spec.items()
            )
        return cls(spec)


def _brief(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 200 else text[:200] + "..."


def infer_field(name: str, value: Any) -> Field:
    """The field a sample value implies: bytes, str, int, float, or an array.

    A 1-d array is a ``sequence`` (its length may vary between samples); a scalar or an array
    of two or more dimensions is a ``tensor``. Pass a schema to store a fixed-length 1-d array
    as a tensor.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Field(name, "bytes")
    if isinstance(value, str):
        return Field(name, "str")
    if isinstance(value, bool):
        return Field.tensor(name, "bool")
    if isinstance(value, int):
        return Field.tensor(name, "int64")
    if isinstance(value, float):
        return Field.tensor(name, "float64")
    if value is None:
        raise SchemaError(f"field {name!r} is None: streamcache fields cannot be null")
    try:
        array = np.asarray(value)
    except Exception as exc:  # arbitrary objects: say which field could not be stored
        raise SchemaError(f"field {name!r}: cannot store a {type(value).__name__}") from exc
    dtype = normalize_dtype(array.dtype, field=name)
    if array.ndim == 1:
        return Field.sequence(name, dtype)
    return Field.tensor(name, dtype, array.shape)


def infer_schema(sample: Mapping[str, Any]) -> Schema:
    """A schema from one sample dict (see :func:`infer_field`)."""
    if not sample:
        raise SchemaError("cannot infer a schema from an empty sample")
    return Schema(infer_field(str(k), v) for k, v in sample.items())
