"""What the state may hold: raw modules and optimizers, strict loads, snapshots never torn.

Raw ``nn.Module``/``Optimizer`` values are saved by parameter names as ModelState saves them;
a load that would leave part of the checkpoint or part of the state behind is an error; the
checkpoint holds the values of the ``save`` call whatever the loop does to the tensors next.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.stand_ins import Cursor

from streamcache.checkpoint import Checkpointer, CheckpointError, ModelState, commit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def model_and_optimizer(seed: int, width: int = 8) -> tuple[torch.nn.Module,
                                                             torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(6, 4, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_raw_model_and_optimizer_resume_exactly(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer(0)
    for seed in range(3):
        step(model, optimizer, seed)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(3, {"model": model, "optim": optimizer, "loader": Cursor(30)})
        fresh, fresh_optimizer = model_and_optimizer(1)  # never stepped: empty state
        cursor = Cursor()
        assert ckpt.load({"model": fresh, "optim": fresh_optimizer, "loader": cursor}) == 3
    assert cursor.samples_consumed == 30
    assert fresh_optimizer.state_dict()["state"], "the optimizer's state was not loaded"
    step(model, optimizer, 3)
    step(fresh, fresh_optimizer, 3)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def test_raw_optimizer_needs_exactly_one_model_in_the_state(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer(0)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        with pytest.raises(CheckpointError, match=r"no nn\.Module in the state.*ModelState"):
            ckpt.save(1, {"optim": optimizer})
        wrapper = torch.nn.Sequential(model)  # holds the same parameters under other names
        with pytest.raises(CheckpointError, match=r"ambiguous.*ModelState"):
            ckpt.save(1, {"a": model, "b": wrapper, "optim": optimizer})
        assert ckpt.list() == []


def test_a_load_that_would_be_partial_is_an_error(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer(0)
    step(model, optimizer, 0)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(1, {"train": ModelState(model, optimizer), "loader": Cursor(5),
                      "extra": {"epoch": 1}})
        fresh, fresh_optimizer = model_and_optimizer(1)
        initial = {k: v.clone() for k, v in fresh.state_dict().items()}
        train = ModelState(fresh, fresh_optimizer)
        # keys of the checkpoint that the state leaves out
        with pytest.raises(CheckpointError, match=r"'extra'.*not in the given state"):
            ckpt.load({"train": train, "loader": Cursor()})
        with pytest.raises(CheckpointError, match=r"'loader'.*not in the given state"):
            ckpt.load({"train": train, "extra": {"epoch": 0}})
        # a key of the state that the checkpoint lacks
        with pytest.raises(CheckpointError, match=r"'more'.*not in the checkpoint"):
            ckpt.load({"train": train, "loader": Cursor(), "extra": {"epoch": 0},
                       "more": {"x": 1}})
        # values inside an entry: the checkpoint's model has a wider layer than this one
        narrow, narrow_optimizer = model_and_optimizer(1, width=4)
        with pytest.raises(CheckpointError):
            ckpt.load({"train": ModelState(narrow, narrow_optimizer), "loader": Cursor(),
                       "extra": {"epoch": 0}})
        # an optimizer saved but loaded without it: the model alone is partial
        with pytest.raises(CheckpointError, match=r"train\.optim.*not in the given state"):
            ckpt.load({"train": ModelState(fresh), "loader": Cursor(), "extra": {"epoch": 0}})
        for key, value in fresh.state_dict().items():  # nothing was applied
            assert torch.equal(value, initial[key]), key
        assert ckpt.load({"train": train, "loader": Cursor(), "extra": {"epoch": 0}}) == 1


def test_writes_after_save_returns_never_reach_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMA-style and ``.data`` writes right after save() (no hooked optimizer.step())."""
    written = threading.Event()
    original = commit.Committer._write

    def write_after_the_loop_moved_on(self: Any, job: Any) -> None:
        assert written.wait(30)
        original(self, job)

    monkeypatch.setattr(commit.Committer, "_write", write_after_the_loop_moved_on)
    model, optimizer = model_and_optimizer(0)
    step(model, optimizer, 0)
    ema, _ = model_and_optimizer(5)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_ema = {k: v.clone() for k, v in ema.state_dict().items()}
    with Checkpointer(tmp_path) as ckpt:  # the defaults
        ckpt.save(1, {"train": ModelState(model, optimizer), "ema": ema})
        with torch.no_grad():
            for p, e in zip(model.parameters(), ema.parameters(), strict=True):
                e.mul_(0.5).add_(p, alpha=0.5)  # an EMA update
        model[0].weight.data.fill_(7.0)  # a .data write
        written.set()
        ckpt.wait()
        loaded, loaded_optimizer = model_and_optimizer(1)
        loaded_ema, _ = model_and_optimizer(2)
        ckpt.load({"train": ModelState(loaded, loaded_optimizer), "ema": loaded_ema})
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    for key, value in loaded_ema.state_dict().items():
        assert torch.equal(value, expected_ema[key]), key
