"""Where torch's and numpy's global generators keep their states, for the native seeder's
direct mode (``GlobalRngs.attach`` in csrc/bindings.cpp).

In direct mode one native call per sample writes all three generators (torch's through its
engine, not ``Generator.set_state``: 0.2 us a sample less, and no Python call between), and
the loop's own states are saved and put back with one copy each (``save``/``restore``)
instead of each library's ``get_state``/``set_state``, ~85 us a batch of which numpy's
state dictionary is ~70.

Neither library exports these layouts, so nothing is assumed: each address is found by
looking for a state the library was just given through its public function (torch's words
in its generator object, numpy's cache beside the pointer to its bit generator), and the mode
is then checked, once per process, against the public functions: every seed's states, cached
normals cleared, and a save/restore round trip over states with every cache filled. Where
anything differs, :func:`direct_addresses` gives None and the seeder goes through the public
functions (the same states, slower).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .. import _native, _twin_rngs

# Where torch's engine (TorchEngineLayout in csrc/bindings.cpp: mt19937_data_pod, then the
# two cached normals) keeps its state words:
_TORCH_WORDS_AT = 20  # the state words, after seed_, left_, seeded_ and next_
_TORCH_SEARCH_BYTES = 512  # the engine starts this close to the generator's start (80 today)
_CHECK_SEEDS = (0, 0x0123_4567_89AB_CDEF, (1 << 64) - 1)

_found: tuple[int, tuple[int, int] | None] | None = None  # (pid, addresses)


def direct_addresses() -> tuple[int, int] | None:
    """(torch's engine, numpy's normal cache) for ``GlobalRngs.attach``, found and checked
    once per process (a forked child checks again); None where direct mode must not be used.
    The caller has checked that the native seeder is in use and gives the twin's states."""
    global _found
    if _found is None or _found[0] != os.getpid():
        with public_preserved():
            _found = (os.getpid(), _find_and_check())
    return _found[1]


def public_save() -> tuple[Any, Any, torch.Tensor]:
    """The global generators' states, through their public functions."""
    return random.getstate(), np.random.get_state(), torch.random.get_rng_state()


def public_restore(saved: tuple[Any, Any, torch.Tensor]) -> None:
    """Put back what :func:`public_save` returned."""
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.random.set_rng_state(saved[2])


@contextlib.contextmanager
def public_preserved() -> Iterator[None]:
    """Put the global generators back as they were, through their public functions."""
    saved = public_save()
    try:
        yield
    finally:
        public_restore(saved)


def _find_and_check() -> tuple[int, int] | None:
    try:
        engine, gauss = torch_engine(), numpy_gauss()
        if engine is None or gauss is None:
            return None
        return (engine, gauss) if _direct_mode_agrees(engine, gauss) else None
    except (AttributeError, TypeError, ValueError):  # a generator of another kind
        return None


def torch_engine() -> int | None:
    """The address of the default CPU generator's engine, or None where it is not found.

    A ``torch.Generator`` is a Python object head and one pointer to the C++ generator; the
    engine is found in that generator as the state words ``set_rng_state`` just gave it (a
    first block looked for in its first bytes, then the whole state compared)."""
    generator = torch.default_generator
    head = object.__basicsize__
    if type(generator).__basicsize__ < head + ctypes.sizeof(ctypes.c_void_p):
        return None
    impl = ctypes.c_void_p.from_address(id(generator) + head).value
    if not impl:
        return None
    marker = _twin_rngs.torch_state(0x5EED_0F_70C4)
    torch.random.set_rng_state(torch.from_numpy(marker))
    words = marker[_twin_rngs.TORCH_STATE_WORDS_AT:][:8 * _twin_rngs.MT_STATE_WORDS]
    words32 = words.view("<u8").astype("<u4").tobytes()
    at = ctypes.string_at(impl, _TORCH_SEARCH_BYTES + 64).find(words32[:64])
    if at < _TORCH_WORDS_AT or at % 4:
        return None
    engine = impl + at - _TORCH_WORDS_AT
    if engine % 8 or ctypes.string_at(engine + _TORCH_WORDS_AT, len(words32)) != words32:
        return None
    return engine


def numpy_gauss() -> int | None:
    """The address of the legacy generator's cached normal (``has_gauss``, then ``gauss``),
    or None where it is not found: in the ``RandomState`` object, the pointer to its own copy
    of the bit generator's functions (the one whose first word is the state's address) is
    followed by the cache."""
    state = np.random.mtrand._rand
    base, size = id(state), type(state).__basicsize__
    words = np.frombuffer(ctypes.string_at(base, size), dtype=np.uintp)
    state_address = state._bit_generator.ctypes.state_address
    own = [base + 8 * k for k in np.flatnonzero(words == state_address)]
    found = [8 * k for k in np.flatnonzero(np.isin(words, own))]
    if len(found) != 1 or found[0] + 24 > size:
        return None
    return int(base + found[0] + 8)


def _dirty() -> None:
    """Set every generator to a fixed state with its caches filled (Python's gauss, numpy's
    normal, both of torch's)."""
    random.seed(11)
    random.gauss(0.0, 1.0)
    np.random.seed(12)
    np.random.standard_normal()
    state = _twin_rngs.torch_state(13)
    raw = state.data
    struct.pack_into("<i", raw, 5040, 1)  # normal_is_valid
    struct.pack_into("<d", raw, 5024, 0.25)  # normal_y
    struct.pack_into("<f", raw, 5048, 0.5)  # next_float_normal_sample
    state[5052] = 1  # is_next_float_normal_sample_valid
    torch.random.set_rng_state(torch.from_numpy(state))


def global_states() -> tuple[Any, Any, bytes]:
    """The global generators' public states: ``(random, numpy, torch)``."""
    return (random.getstate(), np.random.get_state(),
            torch.random.get_rng_state().numpy().tobytes())


def same_states(a: tuple[Any, Any, bytes], b: tuple[Any, Any, bytes]) -> bool:
    """Whether two ``(random, numpy, torch)`` public states are equal."""
    (py_a, np_a, torch_a), (py_b, np_b, torch_b) = a, b
    return py_a == py_b and torch_a == torch_b and np_a[0] == np_b[0] and \
        np.array_equal(np_a[1], np_b[1]) and tuple(np_a[2:]) == tuple(np_b[2:])


def _direct_mode_agrees(engine: int, gauss: int) -> bool:
    buffer = torch.random.get_rng_state()
    twin = _native.twin_global_rngs(random._inst, np.random.mtrand._rand, buffer.numpy())
    direct = _native.direct_global_rngs(random._inst, np.random.mtrand._rand,
                                        torch.random.get_rng_state().numpy(), engine, gauss)
    for seed in _CHECK_SEEDS:
        _dirty()
        twin.seed(seed, True)
        torch.random.set_rng_state(buffer)
        expected = global_states()
        _dirty()
        if not direct.seed(seed, False) or not same_states(global_states(), expected):
            return False
    _dirty()
    before = global_states()
    saved = direct.save()
    direct.seed(_CHECK_SEEDS[1], True)
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    torch.randn(3, dtype=torch.float64)
    direct.restore(*saved)
    return same_states(global_states(), before)
