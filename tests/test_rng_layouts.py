"""The seeder's direct mode (streamcache/loading/rng_layouts.py, ``GlobalRngs.attach`` in
csrc/bindings.cpp): where it is used, it gives every sample exactly the states and draws the
public functions give, clears every cached normal, and puts the loop's states back exactly;
where an address is wrong or a layout is not the expected one, the checks refuse it and the
seeder falls back to the public functions with the same results."""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from streamcache import _native
from streamcache.loading import rng_layouts, seeding
from streamcache.loading.batching import SampleColumns, apply_sample_transform
from streamcache.loading.rng_layouts import global_states, same_states

pytestmark = pytest.mark.skipif("native" not in _native.available_backends(),
                                reason="no extension")

SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 0x1234_5678_9ABC_DEF0]


@pytest.fixture(autouse=True)
def _keep_the_global_generators() -> Iterator[None]:
    with rng_layouts.public_preserved():  # (through the public functions, not direct mode)
        yield


def _direct() -> Any:
    addresses = rng_layouts.direct_addresses()
    assert addresses is not None  # this platform's torch and numpy: the layouts are found
    return _native.direct_global_rngs(random._inst, np.random.mtrand._rand,
                                      torch.random.get_rng_state().numpy(), *addresses)


def _twin_states(seed: int) -> tuple[Any, Any, bytes]:
    buffer = torch.random.get_rng_state()
    twin = _native.twin_global_rngs(random._inst, np.random.mtrand._rand, buffer.numpy())
    twin.seed(seed, True)
    torch.random.set_rng_state(buffer)
    return global_states()


def _fill_caches() -> None:
    rng_layouts._dirty()


def _draws() -> tuple[float, ...]:
    return (random.random(), random.gauss(0, 1), float(np.random.standard_normal()),
            float(np.random.standard_normal()), int(np.random.randint(1 << 30)),
            float(torch.rand(1)), *torch.randn(3).tolist(),
            *torch.randn(2, dtype=torch.float64).tolist(), *torch.randn(40).tolist())


@pytest.mark.parametrize("seed", SEEDS)
def test_direct_states_and_draws_are_the_twins(seed: int) -> None:
    direct = _direct()
    _fill_caches()
    want = _twin_states(seed)
    want_draws = _draws()
    _fill_caches()
    assert direct.seed(seed)
    assert same_states(global_states(), want)
    assert _draws() == want_draws


def test_every_cached_normal_is_cleared_between_samples() -> None:
    direct = _direct()
    direct.seed(1)
    first = _draws()  # leaves caches behind in Python, numpy and torch
    torch.randn(1, dtype=torch.float64)
    direct.seed(1)
    assert _draws() == first


def test_save_and_restore_give_back_every_state_and_cache() -> None:
    direct = _direct()
    _fill_caches()
    before = global_states()
    saved = direct.save()
    direct.seed(7)
    _draws()
    direct.restore(*saved)
    assert same_states(global_states(), before)
    _fill_caches()
    expected = _draws()
    _fill_caches()
    saved = direct.save()
    direct.seed(8)
    direct.restore(*saved)
    assert _draws() == expected  # the cached normals themselves came back


def test_preserved_global_rngs_nests() -> None:
    seeder = seeding.process_seeder()
    assert seeder.direct is not None
    _fill_caches()
    outer = global_states()
    with seeding.preserved_global_rngs():
        seeder(3)
        inner = global_states()
        with seeding.preserved_global_rngs():
            seeder(4)
            _draws()
        assert same_states(global_states(), inner)
        _draws()
    assert same_states(global_states(), outer)


def test_attach_save_and_restore_refuse_what_they_cannot_use() -> None:
    from streamcache import _core

    rngs = _core.GlobalRngs(random._inst, np.random.mtrand._rand,
                            torch.random.get_rng_state().numpy())
    with pytest.raises(RuntimeError, match="attach"):
        rngs.save()
    with pytest.raises(ValueError, match="aligned addresses"):
        rngs.attach(0, 0)
    engine, gauss = rng_layouts.direct_addresses() or (0, 0)
    with pytest.raises(ValueError, match="aligned addresses"):
        rngs.attach(engine + 1, gauss)
    rngs.attach(engine, gauss)
    before = global_states()
    with pytest.raises(ValueError, match="not a state save"):
        rngs.restore(b"\0" * 100, None)
    assert same_states(global_states(), before)  # nothing written


def _scratch_address(keep: list[np.ndarray]) -> int:
    scratch = np.zeros(4096, dtype=np.uint8)  # writable memory that is no generator's
    keep.append(scratch)
    return int(scratch.ctypes.data)


def test_the_check_refuses_an_address_that_is_not_the_generators() -> None:
    engine, gauss = rng_layouts.direct_addresses() or (0, 0)
    keep: list[np.ndarray] = []
    assert not rng_layouts._direct_mode_agrees(_scratch_address(keep), gauss)
    assert not rng_layouts._direct_mode_agrees(engine, _scratch_address(keep))
    assert rng_layouts._direct_mode_agrees(engine, gauss)


def test_a_layout_not_found_means_no_direct_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rng_layouts, "_TORCH_SEARCH_BYTES", 0)  # the words are not found
    assert rng_layouts.torch_engine() is None
    assert rng_layouts._find_and_check() is None
    monkeypatch.undo()
    other = np.random.RandomState(np.random.PCG64(1))  # not the MT19937 the seeder writes
    monkeypatch.setattr(np.random.mtrand, "_rand", other)
    assert rng_layouts._find_and_check() is None


def _transform(sample: dict[str, Any]) -> dict[str, Any]:
    return {"x": torch.tensor([random.random(), float(np.random.standard_normal()),
                               float(np.random.standard_normal())]),
            "t": torch.randn(3), "__id__": sample["__id__"]}


def _transformed() -> tuple[Any, tuple[float, ...]]:
    arrays = {"__id__": np.arange(6, dtype=np.int64),
              "__seed__": np.arange(100, 106, dtype=np.uint64)}
    samples = SampleColumns(("__id__", "__seed__"), (list(range(6)), list(range(100, 106))))
    _fill_caches()
    with seeding.preserved_global_rngs():
        batch = apply_sample_transform(arrays, {}, _transform, samples=samples)
    return batch, _draws()  # the loop's own draws after the batch


def test_the_fallback_transforms_and_preserves_as_direct_mode_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seeding, "_seeder", None)
    direct_batch, direct_after = _transformed()
    assert seeding.process_seeder().direct is not None
    monkeypatch.setattr(seeding, "direct_addresses", lambda: None)
    monkeypatch.setattr(seeding, "_seeder", None)
    batch, after = _transformed()
    assert seeding.process_seeder().direct is None
    assert torch.equal(batch["x"], direct_batch["x"]) and torch.equal(batch["t"],
                                                                       direct_batch["t"])
    assert after == direct_after
    monkeypatch.setattr(seeding, "_seeder", None)


def _child_draws(queue: Any) -> None:
    seeding.process_seeder()(42)
    queue.put((seeding.process_seeder().direct is not None, _draws()))


def test_a_forked_child_finds_and_checks_its_own() -> None:
    seeding.process_seeder()(42)
    want = _draws()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_draws, args=(queue,))
    child.start()
    direct, draws = queue.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0 and direct and draws == want
