"""Between Python values, Arrow arrays and the native gather's raw buffers.

Three jobs, one per direction:

- :func:`normalize_value` and :func:`build_column`: sample values (as a writer receives them)
  into canonical Arrow arrays;
- :func:`field_from_arrow` and :func:`to_canonical`: Arrow data written by anyone (Parquet,
  Arrow IPC) into streamcache fields and their canonical arrays;
- :func:`column_buffers`: a canonical array into the zero-copy byte views the gather reads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import SchemaError
from .schema import FIELD_METADATA_KEY, Field

# ---------------------------------------------------------------- Python values -> Arrow


def normalize_value(field: Field, value: Any) -> Any:
    """Check one sample value against its field and return it in storable form.

    Tensors and sequences become numpy arrays of the field's dtype (a lossless conversion
    only: Python numbers are checked against the dtype's range, arrays are cast only where
    numpy calls the cast safe); bytes become ``bytes``; strings stay ``str``.
    """
    if field.kind == "str":
        if not isinstance(value, str):
            raise SchemaError(f"field {field.name!r} is a str field, got {type(value).__name__}")
        return value
    if field.kind == "bytes":
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        if isinstance(value, np.ndarray) and value.dtype == np.uint8:
            return value.tobytes()
        raise SchemaError(f"field {field.name!r} is a bytes field, got {type(value).__name__}")
    if value is None:
        raise SchemaError(f"field {field.name!r} is None: streamcache fields cannot be null")
    if isinstance(value, (str, bytes, bytearray)):
        raise SchemaError(f"field {field.name!r} is a {field.kind}, got {type(value).__name__}")
    array = _to_dtype(field, value)
    if field.kind == "tensor" and array.shape != field.shape:
        raise SchemaError(
            f"field {field.name!r}: shape {array.shape} does not match the schema's {field.shape}"
        )
    if field.kind == "sequence" and array.ndim != 1:
        raise SchemaError(
            f"field {field.name!r} is a 1-d sequence, got an array of shape {array.shape}"
        )
    return array


def _to_dtype(field: Field, value: Any) -> np.ndarray:
    dtype = field.numpy_dtype
    if isinstance(value, (bool, int, float, complex, list, tuple)):
        try:
            return np.asarray(value, dtype=dtype)
        except (OverflowError, ValueError, TypeError) as exc:
            raise SchemaError(f"field {field.name!r}: {value!r} does not fit {dtype}") from exc
    array = np.asarray(value)
    if array.dtype == dtype:
        return array
    if not np.can_cast(array.dtype, dtype, "safe"):
        raise SchemaError(
            f"field {field.name!r}: dtype {array.dtype} cannot be stored as {dtype} without "
            "loss; cast it first or change the schema"
        )
    return array.astype(dtype)


def build_column(field: Field, values: Sequence[Any] | np.ndarray) -> pa.Array:
    """The canonical Arrow array of already normalized values of one field.

    For a tensor field, ``values`` may also be one array of shape ``[n, *field.shape]``.
    """
    n = len(values)
    arrow_type = field.arrow_type()
    if field.kind == "bytes":
        return pa.array(values, type=pa.large_binary())
    if field.kind == "str":
        return pa.array(values, type=pa.large_string())
    if field.kind == "tensor":
        if isinstance(values, np.ndarray) and values.shape[1:] == field.shape:
            stacked = np.ascontiguousarray(values, dtype=field.numpy_dtype)
        elif n:
            stacked = np.ascontiguousarray(np.stack(list(values)))
        else:
            stacked = np.empty((0, *field.shape), field.numpy_dtype)
        if pa.types.is_fixed_size_binary(arrow_type):
            return pa.Array.from_buffers(arrow_type, n, [None, pa.py_buffer(stacked)])
        flat = pa.array(stacked.reshape(-1))
        if pa.types.is_fixed_size_list(arrow_type):
            return pa.FixedSizeListArray.from_arrays(flat, arrow_type.list_size)
        return flat
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat_values = np.concatenate(values) if n else np.empty(0, field.numpy_dtype)
    if pa.types.is_large_binary(arrow_type):  # a sequence of a dtype Arrow does not know
        itemsize = field.numpy_dtype.itemsize
        return pa.Array.from_buffers(
            arrow_type, n, [None, pa.py_buffer(offsets * itemsize), pa.py_buffer(flat_values)]
        )
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat_values))


# ---------------------------------------------------------------- foreign Arrow -> fields

_TIME_UNITS = ("s", "ms", "us", "ns")


def field_from_arrow(arrow_field: pa.Field) -> Field:
    """The streamcache field for an Arrow field written by anyone.

    Fields written by streamcache carry their description in the field metadata. Others map
    by type: numbers and bools to scalar tensors, fixed-size lists of numbers to tensors,
    lists of numbers to sequences, binary to bytes, (dictionary-encoded) strings to str,
    timestamps and durations to datetime64/timedelta64 tensors.
    """
    meta = arrow_field.metadata or {}
    if FIELD_METADATA_KEY in meta:
        return Field.from_json(json.loads(meta[FIELD_METADATA_KEY]))
    name, t = arrow_field.name, arrow_field.type
    hf_array = _hf_array(arrow_field)
    if hf_array is not None:
        return Field.tensor(name, hf_array[1], hf_array[0])
    if _is_hf_media(t):
        return Field(name, "bytes")
    if pa.types.is_boolean(t):
        return Field.tensor(name, "bool")
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return Field.tensor(name, t.to_pandas_dtype())
    if pa.types.is_timestamp(t) and t.tz is None and t.unit in _TIME_UNITS:
        return Field.tensor(name, f"datetime64[{t.unit}]")
    if pa.types.is_duration(t) and t.unit in _TIME_UNITS:
        return Field.tensor(name, f"timedelta64[{t.unit}]")
    if pa.types.is_fixed_size_list(t):
        shape: list[int] = []
        inner = t
        while pa.types.is_fixed_size_list(inner):
            shape.append(inner.list_size)
            inner = inner.value_type
        if pa.types.is_integer(inner) or pa.types.is_floating(inner):
            return Field.tensor(name, inner.to_pandas_dtype(), shape)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        inner = t.value_type
        if pa.types.is_integer(inner) or pa.types.is_floating(inner):
            return Field.sequence(name, inner.to_pandas_dtype())
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return Field(name, "bytes")
    if pa.types.is_fixed_size_binary(t):
        return Field(name, "bytes")
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return Field(name, "str")
    if pa.types.is_dictionary(t) and (
        pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)
    ):
        return Field(name, "str")
    raise SchemaError(
        f"column {name!r} has Arrow type {t}, which streamcache cannot read; leave it out "
        "with fields=[...] (--fields), or flatten it and run `streamcache convert`"
    )


# Hugging Face ``datasets`` types: ArrayND (an extension type over nested lists, with its shape
# and dtype in the extension metadata, also when ``datasets`` is not imported) and the
# Image/Audio features (a struct of the encoded ``bytes`` and a ``path``).
_HF_ARRAY_PREFIX = "datasets.features.features.Array"
_EXTENSION_NAME = b"ARROW:extension:name"
_EXTENSION_METADATA = b"ARROW:extension:metadata"


def _hf_array(arrow_field: pa.Field) -> tuple[tuple[int, ...], str] | None:
    """(shape, dtype) of a Hugging Face ArrayND column, else None."""
    t = arrow_field.type
    if isinstance(t, pa.ExtensionType):
        name, meta = t.extension_name, t.__arrow_ext_serialize__()
    else:
        field_meta = arrow_field.metadata or {}
        name = field_meta.get(_EXTENSION_NAME, b"").decode("utf-8", "replace")
        meta = field_meta.get(_EXTENSION_METADATA, b"")
    if not name.startswith(_HF_ARRAY_PREFIX):
        return None
    try:
        shape, dtype = json.loads(meta)
        valid = all(type(d) is int and d > 0 for d in shape) and isinstance(dtype, str)
    except (ValueError, TypeError):
        valid = False
    if not valid:
        raise SchemaError(
            f"column {arrow_field.name!r} is a Hugging Face array of shape/dtype {meta!r}; "
            "streamcache reads fixed shapes only: leave it out with fields=[...] (--fields)"
        )
    return tuple(shape), dtype


def _is_hf_media(t: pa.DataType) -> bool:
    return (pa.types.is_struct(t) and [t.field(i).name for i in range(t.num_fields)]
            == ["bytes", "path"] and pa.types.is_binary(t.field(0).type))


def _nested_to_fixed(field: Field, array: pa.Array) -> pa.Array:
    """Nested lists of a fixed shape (Hugging Face ArrayND) as the field's fixed-size list."""
    values: pa.Array = array
    for dim in field.shape:
        if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
                or pa.types.is_fixed_size_list(values.type)):
            raise TypeError(f"values of {array.type} are not nested {len(field.shape)} deep")
        lengths = pc.list_value_length(values)
        if lengths.null_count or (len(lengths) and not (
                pc.min(lengths).as_py() == dim == pc.max(lengths).as_py())):
            raise TypeError(f"not every row has the shape {list(field.shape)}")
        values = pc.list_flatten(values)
    target = field.arrow_type()
    if not pa.types.is_fixed_size_list(target):
        raise TypeError(f"a {field.dtype} tensor is not stored as a fixed-size list")
    return pa.FixedSizeListArray.from_arrays(pc.cast(values, target.value_type),
                                             int(np.prod(field.shape)))


def to_canonical(field: Field, array: pa.Array | pa.ChunkedArray, *, where: str) -> pa.Array:
    """Cast one column of foreign (or compressed-and-decoded) data to its canonical array.

    Raises :class:`SchemaError` naming ``where`` for nulls and for types that do not fit.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    if field.kind == "bytes" and _is_hf_media(array.type) and not array.null_count:
        encoded = array.flatten()[0]  # the "bytes" child, offset and validity applied
        if encoded.null_count:
            raise SchemaError(
                f"{where}: column {field.name!r} refers to {encoded.null_count} files by path "
                "only; embed their bytes in the dataset before indexing"
            )
        array = encoded
    if array.null_count:
        raise SchemaError(
            f"{where}: column {field.name!r} holds {array.null_count} nulls; streamcache fields "
            "cannot be null (fill or drop them before indexing)"
        )
    target = field.arrow_type()
    try:
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        if array.type.equals(target):
            result = array
        elif field.kind == "tensor" and field.shape and not pa.types.is_fixed_size_list(
                array.type) and (pa.types.is_list(array.type)
                                 or pa.types.is_large_list(array.type)):
            result = _nested_to_fixed(field, array)
        elif pa.types.is_fixed_size_binary(target) and field.kind == "tensor":
            result = _raw_fixed(field, array)
        else:
            result = pc.cast(array, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, TypeError) as exc:
        raise SchemaError(
            f"{where}: column {field.name!r} of type {array.type} cannot be read as "
            f"{field.kind} {field.dtype or ''}{list(field.shape) if field.shape else ''}: {exc}"
        ) from exc
    _check_no_child_nulls(field, result, where)
    return result


def _raw_fixed(field: Field, array: pa.Array) -> pa.Array:
    """Bools, datetimes and durations as raw little-endian bytes of their numpy dtype."""
    if pa.types.is_fixed_size_binary(array.type) and array.type.byte_width == field.row_bytes:
        return array
    values = np.ascontiguousarray(
        array.to_numpy(zero_copy_only=False).astype(field.numpy_dtype, copy=False)
    )
    if values.dtype.itemsize * int(np.prod(field.shape)) != field.row_bytes or values.ndim != 1:
        raise TypeError(f"values of {array.type} do not have the field's layout")
    return pa.Array.from_buffers(field.arrow_type(), len(values), [None, pa.py_buffer(values)])


def _check_no_child_nulls(field: Field, array: pa.Array, where: str) -> None:
    if isinstance(array, (pa.LargeListArray, pa.FixedSizeListArray)) and array.values.null_count:
        raise SchemaError(
            f"{where}: column {field.name!r} holds null elements inside its lists; "
            "streamcache fields cannot hold nulls"
        )


# ---------------------------------------------------------------- Arrow -> raw buffers


@dataclass(frozen=True)
class ColumnBuffers:
    """Zero-copy views of one canonical column: packed rows, or values plus int64 offsets."""

    data: np.ndarray  # uint8
    offsets: np.ndarray | None  # int64, rows + 1 entries, in elements of the values buffer


def _bytes_view(buffer: pa.Buffer | None, start: int, length: int) -> np.ndarray:
    if buffer is None or length == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(buffer, dtype=np.uint8, count=length, offset=start)


def column_buffers(field: Field, array: pa.Array) -> ColumnBuffers:
    """The raw buffers of a canonical array, without copying.

    Raises :class:`SchemaError` when the array is not in the field's canonical layout.
    """
    if not array.type.equals(field.arrow_type()):
        raise SchemaError(
            f"column {field.name!r} has type {array.type}, not the canonical "
            f"{field.arrow_type()}; the shard must be materialized first"
        )
    if array.null_count:
        raise SchemaError(f"column {field.name!r} holds nulls")
    return _views(field, array)


def chunk_buffers(field: Field, chunks: list[pa.Array]) -> list[ColumnBuffers]:
    """:func:`column_buffers` of each record batch's array of one column (one type, checked
    once: the arrays of a file's batches share its schema). Raises as it does."""
    if chunks and not chunks[0].type.equals(field.arrow_type()):
        column_buffers(field, chunks[0])  # (raises the SchemaError that names the type)
    if any(chunk.null_count for chunk in chunks):
        raise SchemaError(f"column {field.name!r} holds nulls")
    return [_views(field, chunk) for chunk in chunks]


def _views(field: Field, array: pa.Array) -> ColumnBuffers:
    """The zero-copy views of a canonical, null-free array."""
    n, off = len(array), array.offset
    if field.kind == "tensor":
        stride = field.row_bytes
        if pa.types.is_fixed_size_list(array.type):
            child = array.values
            itemsize = field.numpy_dtype.itemsize
            start = (child.offset + off * array.type.list_size) * itemsize
            return ColumnBuffers(_bytes_view(child.buffers()[1], start, n * stride), None)
        return ColumnBuffers(_bytes_view(array.buffers()[1], off * stride, n * stride), None)
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64, count=n + 1, offset=off * 8)
    if pa.types.is_large_list(array.type):
        child = array.values
        itemsize = field.numpy_dtype.itemsize
        # offsets count elements of the child, which may itself start at an offset
        data = _bytes_view(child.buffers()[1], child.offset * itemsize, len(child) * itemsize)
        return ColumnBuffers(data, offsets)
    data_buffer = buffers[2]
    size = data_buffer.size if data_buffer is not None else 0
    return ColumnBuffers(_bytes_view(data_buffer, 0, size), offsets)
