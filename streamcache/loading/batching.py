"""From gathered rows to the batch a training loop receives.

- :func:`to_torch`: numpy batch arrays into tensors (zero-copy where the dtype allows);
  variable-length fields padded (plus lengths) or as values plus offsets.
- :func:`apply_sample_transform` / :func:`apply_batch_transform`: user transforms, each
  sample carrying its plan seed (``__seed__``) so augmentation does not depend on which rank
  or worker reads it.

The randomness contract (the global RNGs seeded per sample or per batch, and put back) is
:mod:`streamcache.loading.seeding`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from ..errors import TransformError
from ..format.reader import Ragged, bytes_as_rows
from ..format.schema import Field
from .seeding import GlobalRngSeeder, global_rng_seeds, process_seeder, seed_global_rngs

ID_KEY = "__id__"
SEED_KEY = "__seed__"
PADDING_KEY = "__padding__"
SOURCE_KEY = "__source__"  # a mixture's batches: each sample's source (index in the list)
#: What a batch says about its samples for the plan; put back when a transform drops them.
BOOKKEEPING_KEYS = (ID_KEY, SOURCE_KEY, PADDING_KEY)
RAGGED_MODES = ("padded", "offsets")


def transform_name(transform: Callable[..., Any]) -> str:
    """How an error names a user's transform (its qualified name, else its repr)."""
    name = getattr(transform, "__qualname__", None) or getattr(transform, "__name__", None)
    return str(name) if name else repr(transform)


def check_transform_output(value: Any, transform: Callable[..., Any], option: str,
                           what: str) -> Mapping[str, Any]:
    """``value`` if it is a dict (a mapping of field names), else :class:`TransformError`."""
    if isinstance(value, Mapping):
        return value
    raise TransformError(
        f"{option} {transform_name(transform)} returned a {type(value).__name__} for {what}; "
        f"it must return a dict of fields (e.g. {{'image': tensor, 'label': 3}})"
        + (", which the default collate batches (to return something else, pass a collate_fn "
           "that batches it)" if option == "transform" else ", which becomes the batch"))


def stopped(option: str, function: Callable[..., Any], what: str) -> TransformError:
    """The error for a user's function that raised StopIteration: let through, it would end
    the loop's iteration as if the epoch were over (a DataLoader's does), and the rest of the
    epoch's samples would be lost without a word."""
    return TransformError(
        f"{option} {transform_name(function)} raised StopIteration for {what}; it must not: "
        "the loop's iteration would end there as if the epoch were over, silently losing the "
        "rest of its samples. Raise another exception (or return a value) instead")


def batch_named(arrays: Mapping[str, Any]) -> str:
    """How an error names a batch: by its first sample's ``__id__``."""
    ids = arrays.get(ID_KEY)
    return (f"the batch starting at __id__ {int(ids[0])}" if ids is not None and len(ids)
            else "an empty batch")


def _tensor(array: np.ndarray) -> torch.Tensor:
    if array.dtype.kind in "mM":  # datetimes travel as their int64 counts
        array = array.view(np.int64)
    return torch.from_numpy(np.ascontiguousarray(array))


def to_torch(arrays: Mapping[str, Any], fields: Mapping[str, Field], *, ragged: str = "padded",
             pad_value: int | float = 0) -> dict[str, Any]:
    """Tensors for a gathered batch.

    Fixed-width fields become one ``[B, ...]`` tensor. Sequences become, with
    ``ragged="padded"``, a ``[B, L]`` tensor padded with ``pad_value`` plus ``<name>_lengths``;
    with ``ragged="offsets"``, the concatenated values plus ``<name>_offsets`` (int64, B + 1).
    ``str`` fields become lists of str; ``bytes`` fields lists of bytes (or values plus offsets
    with ``ragged="offsets"``). Keys that are not fields (``__id__``...) are converted as arrays.
    """
    out: dict[str, Any] = {}
    for name, value in arrays.items():
        field = fields.get(name)
        if not isinstance(value, Ragged):
            out[name] = _tensor(value) if isinstance(value, np.ndarray) else value
        elif field is not None and field.kind == "str":
            out[name] = value.tolist()
        elif ragged == "offsets":
            out[name] = _tensor(value.values)
            out[f"{name}_offsets"] = _tensor(value.offsets)
        elif field is not None and field.kind == "bytes":
            out[name] = value.tolist()
        else:
            padded, lengths = value.to_padded(pad_value, share=True)
            out[name] = _tensor(padded)
            out[f"{name}_lengths"] = _tensor(lengths)
    return out


def gathering(ragged: str, *, transform: bool, batch_transform: bool,
              ) -> contextlib.AbstractContextManager[None]:
    """The form to gather ``bytes`` fields in for a batch of this kind: one ``bytes`` object per
    row, copied once from the shard, where the batch hands out bytes objects (``ragged=
    "padded"``, or a per-sample transform); contiguous values plus offsets where it hands out
    those (``ragged="offsets"``, or a batch transform, which receives :class:`Ragged`)."""
    if not batch_transform and (ragged == "padded" or transform):
        return bytes_as_rows()
    return contextlib.nullcontext()


class SampleColumns:
    """A gathered batch's samples, column by column: each column's per-sample values (numpy
    row views, bytes, str, Python scalars), from which :meth:`dicts` makes the samples' dicts
    one small run at a time.

    The values are made where the step is read (a reader thread); the dicts where they are
    transformed, a run of :data:`DICTS_AT_ONCE` just before: a batch's dicts made at once,
    or a reader's few batches' (2,048 of 1 KB rows), each counted by Python's collector as
    an allocation until freed, ran its youngest collection every 700 of them and promoted
    the loop's live tensors with it: 5x the DataLoader's collections (1,706 against 340 in an
    epoch of 1 GB) and two more full ones (~65 ms each with torch imported), ~5% of a light
    transform's time.
    """

    __slots__ = ("names", "values")

    def __init__(self, names: tuple[str, ...], values: tuple[list[Any], ...]) -> None:
        self.names = names
        self.values = values

    def __len__(self) -> int:
        return len(self.values[0]) if self.values else 0

    def dicts(self) -> Iterator[dict[str, Any]]:
        """Each sample's dict, in order (columns of unequal length: ValueError)."""
        names, values = self.names, self.values
        if not names:
            return
        count = len(values[0])
        if any(len(column) != count for column in values):
            raise ValueError(f"columns of unequal length: {[len(c) for c in values]}")
        first, rest = names[0], tuple(zip(names[1:], values[1:], strict=True))
        for start in range(0, count, DICTS_AT_ONCE):
            stop = start + DICTS_AT_ONCE
            run = [{first: value} for value in values[0][start:stop]]
            # column by column: a third of the time of one dict(zip(...)) per sample
            for name, column in rest:
                for sample, value in zip(run, column[start:stop], strict=True):
                    sample[name] = value
            yield from run


#: Samples' dicts made at once (:meth:`SampleColumns.dicts`): well below the 700 allocations
#: after which Python's collector runs.
DICTS_AT_ONCE = 64


def sample_columns(arrays: Mapping[str, Any], fields: Mapping[str, Field]) -> SampleColumns:
    """The per-sample values of a gathered batch's columns (numpy rows, bytes, str, Python
    scalars): what :meth:`SampleColumns.dicts` makes the samples' dicts of."""
    names: list[str] = []
    values: list[list[Any]] = []
    for name, column in arrays.items():
        field = fields.get(name)
        scalar = field is None or (field.kind == "tensor" and field.shape == ())
        if isinstance(column, np.ndarray):
            # tolist(): the Python scalars that item() gives; list(): the rows as array views
            values.append(column.tolist() if scalar and column.ndim == 1 else list(column))
        elif type(column) is list:  # Python values already (the seeds' tolist())
            values.append(column)
        else:
            values.append([value.item() if scalar and isinstance(value, np.generic) else value
                           for value in column])
        names.append(name)
    return SampleColumns(tuple(names), tuple(values))


def apply_sample_transform(arrays: Mapping[str, Any], fields: Mapping[str, Field],
                           transform: Callable[[dict[str, Any]], Any],
                           collate: Callable[[list[Any]], Any] | None = None,
                           seeder: GlobalRngSeeder | None = None,
                           samples: SampleColumns | None = None) -> Any:
    """Run ``transform`` on every sample (each with its ``__id__`` and ``__seed__``), collate.

    Each call runs with the global RNGs seeded from its sample's ``__seed__`` (the caller
    restores them afterwards), so even a transform that draws from ``random``,
    ``numpy.random`` or ``torch.rand`` gives a sample the same result on any world size,
    worker count, batch size or resume. The bookkeeping keys (``__id__``, a mixture's
    ``__source__``, ``__padding__``) are put back on the collated batch when the transform
    dropped them, so every batch can be checked against the plan. ``collate`` None means
    torch's ``default_collate``, for which the transform must return dicts; a custom
    ``collate`` batches whatever the transform returns. ``seeder``: the batch's
    :class:`GlobalRngSeeder`, if the caller has made one already. ``samples``: what
    :func:`sample_columns` gives of ``arrays``, where the caller made it already.

    Raises:
        TransformError: with the default collate, the transform returned no dict.
    """
    columns = sample_columns(arrays, fields) if samples is None else samples
    plan_seeds = np.asarray(arrays[SEED_KEY], dtype=np.uint64)
    seeds = global_rng_seeds(plan_seeds)
    seed_all = seeder or process_seeder()
    seed_one = seed_all.direct or seed_all  # (the native call itself, where it can)
    outputs = []
    seeds_returned = False
    sample: dict[str, Any] = {}
    try:
        for sample, seed in zip(columns.dicts(), seeds, strict=True):
            seed_one(seed)
            output = transform(sample)
            if collate is None:
                if type(output) is not dict:
                    check_transform_output(output, transform, "transform",
                                           f"the sample with __id__ {sample[ID_KEY]}")
                elif SEED_KEY in output:
                    # a sample dict returned as it came: its __seed__ is a Python int of up
                    # to 2**64 - 1, which default_collate cannot make a tensor of (it
                    # overflows int64); the batch gets the seeds column instead, as without
                    # a transform
                    output = {key: value for key, value in output.items() if key != SEED_KEY}
                    seeds_returned = True
            outputs.append(output)
    except StopIteration as stop:
        raise stopped("transform", transform,
                      f"the sample with __id__ {sample.get(ID_KEY)}") from stop
    try:
        batch = (collate or default_collate)(outputs)
    except StopIteration as stop:
        raise stopped("collate_fn", collate or default_collate, batch_named(arrays)) from stop
    if isinstance(batch, dict):
        for key in BOOKKEEPING_KEYS:
            if key in arrays and key not in batch:
                batch[key] = _tensor(np.asarray(arrays[key]))
        if seeds_returned:  # as a batch without a transform has them: int64 views
            batch[SEED_KEY] = _tensor(plan_seeds.view(np.int64))
    return batch


def apply_batch_transform(arrays: dict[str, Any],
                          transform: Callable[[dict[str, Any]], Any]) -> Mapping[str, Any]:
    """Run ``transform`` on a batch's numpy arrays (with ``__seed__``).

    It runs with the global RNGs seeded from the batch's first sample (its ``__seed__``; an
    empty batch, from the step): a rerun or a resume draws the same for the same batch, and
    ranks draw differently. A batch depends on the world size, so these draws do too: for
    augmentation that does not, draw per sample from ``__seed__``. The bookkeeping keys
    (``__id__``, ``__source__``, ``__padding__``) the output lacks are put back (a transform
    that changes the number of rows sets its own).

    Raises:
        TransformError: the transform returned something other than a dict.
    """
    seeds = np.asarray(arrays[SEED_KEY], dtype=np.uint64)
    if len(seeds):
        seed_global_rngs(global_rng_seeds(seeds[:1])[0])
    what = batch_named(arrays)
    kept = {key: arrays[key] for key in BOOKKEEPING_KEYS if key in arrays}
    try:
        returned = transform(arrays)
    except StopIteration as stop:
        raise stopped("batch_transform", transform, what) from stop
    output = check_transform_output(returned, transform, "batch_transform", what)
    dropped = {key: value for key, value in kept.items() if key not in output}
    return {**output, **dropped} if dropped else output


def empty_like(batch: Any) -> Any:
    """A collated batch of one sample, emptied: tensors and arrays keep their dtype and
    trailing shape with a leading 0, dicts and namedtuples keep their keys; a list or tuple
    of one item is that sample's entry and becomes empty, a longer one is a structure (such
    as ``(inputs, targets)``) and is emptied item by item."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[:0] if batch.ndim else batch
    if isinstance(batch, Mapping):
        return {key: empty_like(value) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(empty_like(value) for value in batch))
    if isinstance(batch, (list, tuple)):
        items = [] if len(batch) == 1 else [empty_like(value) for value in batch]
        return items if isinstance(batch, list) else tuple(items)
    return batch
