"""From gathered rows to the batch a training loop receives.

- :func:`to_torch`: numpy batch arrays into tensors (zero-copy where the dtype allows);
  variable-length fields padded (plus lengths) or as values plus offsets.
- :func:`apply_sample_transform` / :func:`apply_batch_transform`: user transforms, each
  sample carrying its plan seed (``__seed__``) so augmentation does not depend on which rank
  or worker reads it.
- :func:`seeded_global_rngs`: run code with Python's, numpy's and torch's global RNGs seeded
  from (seed, epoch, step), then put the previous states back, so a transform that uses
  global randomness is reproducible and the training loop's own RNG streams are untouched.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .plan.bijection import derive_key
from .reader import Ragged
from .schema import Field

ID_KEY = "__id__"
SEED_KEY = "__seed__"
PADDING_KEY = "__padding__"
RAGGED_MODES = ("padded", "offsets")
_STEP_SEED_TAG = 0x5354_4550  # distinguishes step seeds from every other derived key


def step_seed(seed: int, epoch: int, step: int) -> int:
    """The 64-bit seed of the global RNGs for one step (the same on every rank and worker)."""
    return derive_key(seed, epoch, step, _STEP_SEED_TAG)


@contextlib.contextmanager
def seeded_global_rngs(seed: int) -> Iterator[None]:
    """Seed ``random``, ``numpy.random`` and torch's CPU generator; restore them afterwards."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed % (1 << 63))
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)


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
            padded, lengths = value.to_padded(pad_value)
            out[name] = _tensor(padded)
            out[f"{name}_lengths"] = _tensor(lengths)
    return out


def split_samples(arrays: Mapping[str, Any], fields: Mapping[str, Field]) -> list[dict[str, Any]]:
    """Per-sample dicts of a gathered batch (numpy rows, bytes, str, Python scalars)."""
    size = len(next(iter(arrays.values())))
    samples: list[dict[str, Any]] = [{} for _ in range(size)]
    for name, column in arrays.items():
        field = fields.get(name)
        scalar = field is None or (field.kind == "tensor" and field.shape == ())
        for i in range(size):
            value = column[i]
            samples[i][name] = value.item() if scalar and isinstance(value, np.generic) else value
    return samples


def apply_sample_transform(arrays: Mapping[str, Any], fields: Mapping[str, Field],
                           transform: Callable[[dict[str, Any]], Any],
                           collate: Callable[[list[Any]], Any]) -> Any:
    """Run ``transform`` on every sample (each with its ``__id__`` and ``__seed__``), collate.

    ``__id__`` (and ``__padding__``) are put back on the collated batch when the transform
    dropped them, so every batch can be checked against the plan.
    """
    samples = split_samples(arrays, fields)
    outputs = [transform(sample) for sample in samples]
    batch = collate(outputs)
    if isinstance(batch, dict):
        for key in (ID_KEY, PADDING_KEY):
            if key in arrays and key not in batch:
                batch[key] = _tensor(np.asarray(arrays[key]))
    return batch
