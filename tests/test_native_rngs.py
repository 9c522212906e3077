"""The per-sample states of the global generators (``GlobalRngs``, csrc/bindings.cpp): the
native class writes into Python's, numpy's and torch's generators the states the twin sets
through their public functions, for every seed, and gives numpy's cached normal no way to
leak from one sample into the next."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from streamcache import _native
from streamcache._twin_rngs import STREAM_NUMPY, STREAM_PYTHON, state_words

SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 0x1234_5678_9ABC_DEF0]


def _states() -> tuple[Any, Any, bytes]:
    return (random.getstate(), np.random.get_state(legacy=False),
            torch.random.get_rng_state().numpy().tobytes())


def _seeded(make: Any, seed: int) -> tuple[Any, Any, bytes]:
    torch_state = torch.random.get_rng_state()
    rngs = make(random._inst, np.random.mtrand._rand, torch_state.numpy())
    np.random.seed(0)  # no cached normal: the state numpy's seed() leaves
    assert rngs.seed(seed, True)
    torch.random.set_rng_state(torch_state)
    return _states()


def _equal(a: tuple[Any, Any, bytes], b: tuple[Any, Any, bytes]) -> bool:
    return a[0] == b[0] and a[2] == b[2] and a[1]["state"]["pos"] == b[1]["state"]["pos"] and \
        np.array_equal(a[1]["state"]["key"], b[1]["state"]["key"]) and \
        (a[1]["has_gauss"], a[1]["gauss"]) == (b[1]["has_gauss"], b[1]["gauss"])


@pytest.fixture(autouse=True)
def _keep_the_global_generators() -> Any:
    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.random.set_rng_state(saved[2])


@pytest.mark.skipif("native" not in _native.available_backends(), reason="no extension")
@pytest.mark.parametrize("seed", SEEDS)
def test_native_states_are_the_twins(seed: int) -> None:
    from streamcache import _core

    random.gauss(0, 1)  # a cached normal, which seeding must clear
    twin = _seeded(_native.twin_global_rngs, seed)
    random.gauss(0, 1)
    assert _equal(_seeded(_core.GlobalRngs, seed), twin)
    assert twin[0][2] is None and twin[1]["has_gauss"] == 0  # no cached normal in either


def test_each_generator_and_seed_has_its_own_stream() -> None:
    words = [state_words(s, t) for s in (5, 6) for t in (STREAM_PYTHON, STREAM_NUMPY)]
    assert len({w.tobytes() for w in words}) == 4
    _seeded(_native.twin_global_rngs, 5)
    draws = (random.random(), float(np.random.random_sample()), float(torch.rand(1)))
    assert len(set(draws)) == 3


@pytest.mark.skipif("native" not in _native.available_backends(), reason="no extension")
def test_a_numpy_draw_since_the_last_seed_asks_for_numpys_own_reset() -> None:
    """A draw of one normal leaves numpy's second normal cached, where only numpy's seeding
    reaches: the native class notices any numpy draw and writes nothing until forced."""
    from streamcache import _core

    torch_state = torch.random.get_rng_state()
    rngs = _core.GlobalRngs(random._inst, np.random.mtrand._rand, torch_state.numpy())
    np.random.seed(0)
    assert rngs.seed(5, True)
    assert rngs.seed(6, False)  # no draw in between: numpy written again
    random.random()
    torch.rand(3)  # draws from the others do not matter
    assert rngs.seed(7, False)
    np.random.standard_normal()  # a pair drawn, one cached
    before = _states()
    assert not rngs.seed(8, False)
    assert _equal(_states(), before)  # nothing written
    np.random.seed(0)
    assert rngs.seed(8, True)
    torch.random.set_rng_state(torch_state)
    assert _equal(_states(), _seeded(_native.twin_global_rngs, 8))


def test_refuses_generators_it_does_not_know(backend: str) -> None:
    torch_state = torch.random.get_rng_state().numpy()
    make = _native.global_rngs
    with pytest.raises(TypeError):
        make(object(), np.random.mtrand._rand, torch_state)
    with pytest.raises(TypeError):
        make(random._inst, np.random.RandomState(np.random.PCG64(1)), torch_state)
    with pytest.raises((TypeError, ValueError)):
        make(random._inst, np.random.mtrand._rand, torch_state[:100])
