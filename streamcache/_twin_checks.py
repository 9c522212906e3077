"""The argument checks of the pure-Python twin (``streamcache._twin``): the status codes of
``csrc/status.h`` and the checks that refuse what the extension refuses, in its order.

``streamcache._native`` also uses them to say why the extension refused an argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

OK, OUT_OF_RANGE, CORRUPT, IO, INVALID = 0, 1, 2, 3, 4

Status = tuple[int, int, str]

Array = tuple[str, object, np.dtype | None, bool]  # name, value, exact dtype, writable


def array_problem(name: str, array: object, dtype: np.dtype | None = None, *,
                  writable: bool = False, one_d: bool = True) -> str | None:
    """What makes ``array`` unfit for the native core, or None.

    The extension refuses to convert arrays (``.noconvert()`` in ``csrc/bindings.cpp``): a
    converting cast would silently copy an output, whose result is then lost, or truncate
    int64 values to uint8. Arrays must be numpy arrays of the exact dtype, C-contiguous,
    and writable if they are outputs.
    """
    if not isinstance(array, np.ndarray):
        return f"{name} must be a numpy array, got {type(array).__name__}"
    if dtype is not None and array.dtype != dtype:
        return f"{name} must have dtype {dtype}, got {array.dtype}"
    if one_d and array.ndim != 1:
        return f"{name} must be one-dimensional, got shape {array.shape}"
    if not array.flags.c_contiguous:
        return f"{name} must be C-contiguous (it would be copied, and an output's copy lost)"
    if writable and not array.flags.writeable:
        return f"{name} must be writable"
    return None


def array_problem_status(function: str, name: str, array: object,
                         dtype: np.dtype) -> Status | None:
    """:func:`array_problem` of one input array as a status naming ``function``, or None."""
    problem = array_problem(name, array, dtype)
    return None if problem is None else (INVALID, -1, f"{function}: {problem}")


def first_problem(function: str, arrays: Sequence[Array]) -> Status | None:
    for name, array, dtype, writable in arrays:
        problem = array_problem(name, array, dtype, writable=writable)
        if problem is not None:
            return INVALID, -1, f"{function}: {problem}"
    return None


_U8, _I32, _I64 = np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64)


def _each(name: str, arrays: Sequence[object], dtype: np.dtype) -> list[Array]:
    if not isinstance(arrays, (list, tuple)):
        return [(name, arrays, None, False)]  # "must be a numpy array": a list is expected
    return [(f"{name}[{k}]", a, dtype, False) for k, a in enumerate(arrays)]


def check_fixed_args(sources: Sequence[object], stride: int, which: object, rows: object,
                     out: object) -> Status | None:
    """The array checks of ``gather_fixed`` (``out`` may have any dtype and shape)."""
    arrays = [*_each("sources", sources, _U8), ("which", which, _I32, False),
              ("rows", rows, _I64, False)]
    if (err := first_problem("gather_fixed", arrays)) is not None:
        return err
    problem = array_problem("out", out, writable=True, one_d=False)
    return None if problem is None else (INVALID, -1, f"gather_fixed: {problem}")


def check_var_args(function: str, values: Sequence[object], offsets: Sequence[object],
                   which: object, rows: object, out_offsets: object,
                   out_values: object = None) -> Status | None:
    """The array checks of ``var_offsets`` and (with ``out_values``) ``gather_var``."""
    arrays = [*_each("values", values, _U8), *_each("offsets", offsets, _I64),
              ("which", which, _I32, False), ("rows", rows, _I64, False),
              ("out_offsets", out_offsets, _I64, out_values is None)]
    if (err := first_problem(function, arrays)) is not None:
        return err
    if out_values is None:
        return None
    problem = array_problem("out_values", out_values, writable=True, one_d=False)
    return None if problem is None else (INVALID, -1, f"{function}: {problem}")


def check_var_request(
    values: Sequence[np.ndarray], offsets: Sequence[np.ndarray], elem_size: int,
    which: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray,
) -> Status | None:
    """The checks var_offsets and gather_var share, in the extension's order."""
    if len(which) != len(rows):
        return INVALID, -1, "which and rows differ in length"
    if out_offsets.size != len(rows) + 1:
        return INVALID, -1, "out_offsets must hold len(rows) + 1 entries"
    if len(values) != len(offsets):
        return INVALID, -1, "values and offsets lists differ in length"
    for i, off in enumerate(offsets):
        if off.size == 0:
            return CORRUPT, i, "an offsets buffer must hold at least one entry"
    if elem_size <= 0:
        return INVALID, -1, "elem_size must be positive"
    return None
