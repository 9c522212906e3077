"""The randomness contract of transforms: the global generators seeded per sample or per step.

A per-sample transform runs with the global generators (Python's ``random``,
``numpy.random`` and torch's default CPU generator) set to states that depend on its sample's
seed alone, so that a transform drawing from them gives a sample the same output on any
world size, worker count or resume. A batch transform runs with them set from its batch's
first sample, and the loop's own states are put back afterwards (:func:`preserved_global_rngs`).

The states of a seed are each generator's 624 state words from a counter-based mix of the
seed (``streamcache/_twin_rngs.py`` defines them; every generator has its own stream), set in
one native call per sample (:class:`GlobalRngSeeder`): about 1.5 us, where each library's own
seeding function cost 7.9 us a sample (Python's ``random.seed`` alone 4.6, a serial
recurrence over the whole state). The native call writes the states into the generators'
memory, whose layouts the libraries do not export; :func:`native_rngs_usable` checks, once
per process, that it gives exactly the states the twin sets through each library's public
``setstate``/``set_state``, and the twin is used where it does not (same states, slower).
Where torch's engine and numpy's normal cache are found too (:mod:`.rng_layouts`), the call
writes torch's generator itself (~0.45 us a sample in all) and the loop's states are kept
around a batch with one copy (~85 us a batch through the libraries' functions).

Only the CPU generator of torch: ``torch.manual_seed`` would also reseed every CUDA
generator, which the training loop owns (dropout) and which is not restored afterwards.

Thread safety: the global generators belong to the process; seeding them must not run on two
threads at once (the loader runs transforms on one thread).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .. import _native
from .._native_backend import DirectGlobalRngsImpl
from ..plan.bijection import derive_key, derive_keys
from .rng_layouts import (
    direct_addresses,
    global_states,
    public_preserved,
    public_restore,
    public_save,
    same_states,
)

_STEP_SEED_TAG = 0x5354_4550  # distinguishes step seeds from every other derived key
# The global RNGs of a sample are seeded from its __seed__ folded with this key, so that they
# do not replay the stream a transform gets from numpy.random.default_rng(__seed__).
_GLOBAL_RNG_KEY = derive_key(0x474C_4F42)
# Seeds the native states are checked with (any will do; these cover both 32-bit halves).
_CHECK_SEEDS = (0, 0x0123_4567_89AB_CDEF, (1 << 64) - 1)


def step_seed(seed: int, epoch: int, step: int) -> int:
    """The 64-bit seed of the global RNGs for one step (the same on every rank and worker)."""
    return derive_key(seed, epoch, step, _STEP_SEED_TAG)


def global_rng_seeds(sample_seeds: np.ndarray) -> list[int]:
    """The seed of the global RNGs for each sample, from its ``__seed__`` alone."""
    keys = derive_keys(_GLOBAL_RNG_KEY, np.asarray(sample_seeds, dtype=np.uint64))
    seeds: list[int] = keys.tolist()  # Python ints
    return seeds


@contextlib.contextmanager
def preserved_global_rngs() -> Iterator[None]:
    """Put the global RNGs (Python, numpy, torch CPU) back as they were when the block ends."""
    seeder = process_seeder()
    saved = seeder.save()
    try:
        yield
    finally:
        seeder.restore(saved)


class GlobalRngSeeder:
    """Sets the global generators to the states of one seed after another (the samples of a
    batch): ``seeder(seed)`` before each sample's transform; :meth:`save` and
    :meth:`restore` keep the loop's own states around a batch.

    Where the layouts of torch's engine and numpy's normal cache are found and checked
    (:func:`~.rng_layouts.direct_addresses`), one native call writes all three generators
    (:attr:`direct`, which the per-sample loop calls itself) and saving and restoring are one
    copy each. Else torch's state is written into a buffer for its ``set_state``, and numpy's
    legacy generator, which caches the second of each pair of normals it draws out of reach
    of its state words, is reset by its own ``seed`` after a sample that drew from it (the
    native call notices any draw), so a sample never sees another's cached normal.
    """

    def __init__(self) -> None:
        self._torch_state = torch.random.get_rng_state()  # a buffer of the right layout
        self._set_torch = torch.random.default_generator.set_state
        generators = (random._inst, np.random.mtrand._rand, self._torch_state.numpy())
        usable = native_rngs_usable()
        addresses = direct_addresses() if usable else None
        #: with the layouts found: the native ``seed(seed)``, which writes every generator
        self.direct: Callable[[int], bool] | None = None
        self._direct: DirectGlobalRngsImpl | None = None
        if addresses is not None:
            self._direct = _native.direct_global_rngs(*generators, *addresses)
            self.direct = self._direct.seed
        make = _native.global_rngs if usable else _native.twin_global_rngs
        self._rngs = self._direct or make(*generators)
        self._force_numpy = True

    def __call__(self, seed: int) -> None:
        if self.direct is not None:
            self.direct(seed)
            return
        if self._force_numpy or not self._rngs.seed(seed, False):
            np.random.seed(0)  # numpy was (or may have been) drawn from: clear its cache
            self._rngs.seed(seed, True)
            self._force_numpy = False
        self._set_torch(self._torch_state)

    def save(self) -> Any:
        """The global generators' states, for :meth:`restore`."""
        return self._direct.save() if self._direct is not None else public_save()

    def restore(self, saved: Any) -> None:
        if self._direct is not None:
            self._direct.restore(*saved)
        else:
            public_restore(saved)


_seeder: tuple[tuple[int, str], GlobalRngSeeder] | None = None


def process_seeder() -> GlobalRngSeeder:
    """This process's :class:`GlobalRngSeeder` (made once per process and backend; the
    global generators are the process's, and seeding them runs on one thread at a time)."""
    global _seeder
    key = (os.getpid(), _native.backend_name())
    if _seeder is None or _seeder[0] != key:
        _seeder = (key, GlobalRngSeeder())
    return _seeder[1]


def seed_global_rngs(seed: int) -> None:
    """Set ``random``, ``numpy.random`` and torch's default CPU generator to ``seed``'s states
    (the same states a :class:`GlobalRngSeeder` gives ``seed``)."""
    process_seeder()(seed)


_usable: tuple[int, bool] | None = None  # (pid, whether the native states are the twin's)


def native_rngs_usable() -> bool:
    """Whether the native core's ``GlobalRngs`` is in use and gives exactly the twin's states
    in this interpreter (checked once per process; a forked child inherits the answer)."""
    global _usable
    if _native.backend_name() != "native":
        return False
    if _usable is None or _usable[0] != os.getpid():
        _usable = (os.getpid(), _native_matches_twin())
    return _usable[1]


def _native_matches_twin() -> bool:
    with public_preserved():
        torch_state = torch.random.get_rng_state()
        try:
            native = _native.global_rngs(random._inst, np.random.mtrand._rand,
                                         torch_state.numpy())
        except (TypeError, ValueError):
            return False
        twin = _native.twin_global_rngs(random._inst, np.random.mtrand._rand,
                                        torch_state.numpy())
        for seed in _CHECK_SEEDS:
            states = []
            for rngs in (native, twin):
                np.random.seed(0)
                rngs.seed(seed, True)
                torch.random.set_rng_state(torch_state)
                states.append(global_states())
            if not same_states(*states):
                return False
    return True
