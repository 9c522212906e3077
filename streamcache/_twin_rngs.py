"""Twin of ``_core.GlobalRngs`` (csrc/bindings.cpp, csrc/seeding.h): the per-sample states of
the global generators of Python, numpy and torch, set through each library's public
``setstate``/``set_state``.

The state of a seed is, for each generator, 624 words of a counter-based mix of the seed and
the generator's tag (:func:`state_words`), with the generator's position at the end of its
state (its next draw twists it first) and no cached normal. The native class writes the same
words into the generators' memory; ``streamcache._native.global_rngs`` checks, once per
process, that both give the same states.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

MT_STATE_WORDS = 624
STREAM_PYTHON = 0x5059_5448_4F4E_0001
STREAM_NUMPY = 0x4E55_4D50_5900_0002
STREAM_TORCH = 0x544F_5243_4800_0003
TORCH_STATE_BYTES = 5056  # torch.Generator.get_state() of a CPU generator
TORCH_STATE_WORDS_AT = 24

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)


def mix64(z: int) -> int:
    """The SplitMix64 finalizer (a bijection of 64-bit integers)."""
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK
    return z ^ (z >> 31)


def state_words(seed: int, stream: int) -> np.ndarray:
    """The 624 uint32 words of ``seed``'s state for one generator: word pair k is the low and
    high half of ``mix64(key + (k + 1) * 0x9E3779B97F4A7C15)``, key ``mix64(seed ^ stream)``."""
    key = np.uint64(mix64((seed ^ stream) & _MASK))
    z = key + np.arange(1, MT_STATE_WORDS // 2 + 1, dtype=np.uint64) * _GOLDEN  # wraps
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58_476D_1CE4_E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D0_49BB_1331_11EB)
    z = z ^ (z >> np.uint64(31))
    return z.astype("<u8").view("<u4").astype(np.uint32)


def torch_state(seed: int) -> np.ndarray:
    """The bytes of torch's CPU generator state for ``seed``: initial seed, ``left`` 1 (the
    next draw twists), ``seeded`` 1, the words as 64-bit entries, no cached normals."""
    out = np.zeros(TORCH_STATE_BYTES, dtype=np.uint8)
    out[0:8] = np.array([seed & _MASK], "<u8").view(np.uint8)
    out[8:16] = np.array([1, 1], "<i4").view(np.uint8)
    words = state_words(seed, STREAM_TORCH).astype("<u8")
    out[TORCH_STATE_WORDS_AT:TORCH_STATE_WORDS_AT + 8 * MT_STATE_WORDS] = words.view(np.uint8)
    return out


class GlobalRngs:
    """Sets ``python_random`` (a ``random.Random``), ``numpy_random_state`` (a legacy
    ``RandomState``) and the bytes of ``torch_state`` (the caller passes them to
    ``Generator.set_state``) to the states of a seed. See ``_core.GlobalRngs``.
    """

    def __init__(self, python_random: Any, numpy_random_state: Any,
                 torch_state: np.ndarray) -> None:
        if not isinstance(python_random, random.Random):
            raise TypeError("python_random must be a random.Random")
        if type(numpy_random_state._bit_generator).__name__ != "MT19937":
            raise TypeError("numpy_random_state must draw from an MT19937 bit generator")
        if not (isinstance(torch_state, np.ndarray) and torch_state.dtype == np.uint8
                and torch_state.shape == (TORCH_STATE_BYTES,)
                and torch_state.flags.c_contiguous and torch_state.flags.writeable
                and torch_state.ctypes.data % 8 == 0):
            raise ValueError("torch_state must hold the 5056 bytes of a CPU generator's state, "
                             "8-byte aligned")
        self._python = python_random
        self._numpy = numpy_random_state
        self._torch_state = torch_state

    def seed(self, seed: int, force_numpy: bool = True) -> bool:
        """Set every generator to ``seed``'s state (numpy's through ``set_state``, which also
        clears its cached normal, so this twin never needs ``force_numpy``); returns True."""
        words = state_words(seed, STREAM_PYTHON)
        self._python.setstate((3, (*words.tolist(), MT_STATE_WORDS), None))
        self._numpy.set_state(("MT19937", state_words(seed, STREAM_NUMPY), MT_STATE_WORDS, 0,
                               0.0))
        self._torch_state[:] = torch_state(seed)
        return True
