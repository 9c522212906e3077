"""A load that refuses changes nothing; what a checkpoint's files say is confined and checked.

- Every refusal of ``load`` (a loader state of another dataset, keys, a value whose pickle is
  unsafe, malformed RNG states, a global state its object refuses) leaves the model,
  optimizer, loader, extras and RNG states exactly as they were: everything is checked
  before anything is applied.
- DCP metadata whose storage entries point outside the step (an absolute path, ``../``,
  a file the commit marker does not list, bytes past a file's end, stream transforms) is
  refused before DCP opens a file, even under a resealed (self-consistent) marker.
- The allow-list unpickler of ``.metadata`` answers crafted gadgets and fuzzed pickles with
  :class:`CheckpointUnsafeError` only.
- A commit marker that lists names outside the step, has fields of the wrong types, or is a
  symlink, huge or deeply nested, makes its checkpoint incomplete: the previous one loads.
"""

from __future__ import annotations

import copy
import os
import pickle
import random
import shutil
from collections import OrderedDict
from pathlib import Path, PosixPath
from typing import Any

import numpy as np
import pytest
import torch
from helpers.stand_ins import Cursor
from loader_helpers import make_dataset
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

from streamcache.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointUnsafeError,
    ModelState,
    layout,
    rng,
)
from streamcache.checkpoint.dcp_metadata import check_metadata
from streamcache.checkpoint.unpickle import load_metadata
from streamcache.format.checksum import checksum_file
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader
from streamcache.plan import CursorMismatchError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(6, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a load could change: weights, optimizer state, extras, RNG states."""
    train = state["train"]
    return {"model": copy.deepcopy(train.model.state_dict()),
            "optim": copy.deepcopy(train.optimizers[0].state_dict()),
            "extra": copy.deepcopy(state.get("extra")),
            "rng": (random.getstate(), np.random.get_state(legacy=True)[1].tolist(),  # type: ignore[index]
                    torch.get_rng_state())}


def assert_unchanged(before: dict[str, Any], state: dict[str, Any]) -> None:
    after = snapshot(state)
    for name, tensor in before["model"].items():
        assert torch.equal(tensor, after["model"][name]), f"weight {name} changed"
    assert after["optim"]["state"].keys() == before["optim"]["state"].keys()
    for index, values in before["optim"]["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value),
                               torch.as_tensor(after["optim"]["state"][index][key])), key
    assert after["extra"] == before["extra"]
    assert after["rng"][0] == before["rng"][0] and after["rng"][1] == before["rng"][1]
    assert torch.equal(after["rng"][2], before["rng"][2])


# ------------------------------------------------------------------ refusals change nothing

def test_a_loader_of_another_dataset_is_refused_and_the_model_is_untouched(
    tmp_path: Path,
) -> None:
    ours = make_dataset(str(tmp_path / "a"), [20, 20], seq=False)
    theirs = make_dataset(str(tmp_path / "b"), [25, 25], seq=False)
    model, optimizer = trained(0)
    with StreamLoader(StreamDataset(ours, global_batch_size=4, cache_dir=str(tmp_path / "c1"),
                                    seed=1)) as loader:
        next(iter(loader))
        with Checkpointer(tmp_path / "root", async_mode="sync") as ckpt:
            ckpt.save(5, {"train": ModelState(model, optimizer), "loader": loader,
                          "extra": {"epoch": 3}})
    other_model, other_optimizer = trained(1)
    with StreamLoader(StreamDataset(theirs, global_batch_size=4,
                                    cache_dir=str(tmp_path / "c2"), seed=1)) as other_loader:
        state = {"train": ModelState(other_model, other_optimizer), "loader": other_loader,
                 "extra": {"epoch": 0}}
        before, cursor = snapshot(state), other_loader.state_dict()
        with Checkpointer(tmp_path / "root", async_mode="sync") as ckpt, pytest.raises(
                CursorMismatchError):
            ckpt.load(state)
        assert other_loader.state_dict() == cursor
    assert_unchanged(before, state)


class Refusing(Cursor):
    """A global state whose object refuses every saved state (as a loader of other data)."""

    def validate_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise CheckpointError("refused by its object")


class Plain:
    """A value whose pickle is more than plain data (torch's weights-only loader refuses)."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.mark.parametrize("case", ["keys", "global state", "unsafe value", "rng"])
def test_every_refusal_leaves_the_state_untouched(tmp_path: Path, case: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = trained(0)
    saved: dict[str, Any] = {"train": ModelState(model, optimizer), "loader": Cursor(30),
                             "extra": {"epoch": 3}}
    if case == "unsafe value":
        saved["extra"] = {"epoch": Plain(3)}
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        with monkeypatch.context() as patched:
            if case == "rng":
                patched.setattr(rng, "encode", lambda state: '{"version": 1, "python": 5}')
            ckpt.save(5, saved)
        other_model, other_optimizer = trained(1)
        state: dict[str, Any] = {"train": ModelState(other_model, other_optimizer),
                                 "loader": Refusing() if case == "global state" else Cursor(),
                                 "extra": {"epoch": 0}}
        if case == "keys":
            state["unexpected"] = {"x": 1}
        before = snapshot(state)
        expected = {"keys": "does not match the given state", "global state": "refused by its",
                    "unsafe value": "refusing to load the value", "rng": "RNG states"}[case]
        with pytest.raises(CheckpointError, match=expected):
            ckpt.load(state)
    assert_unchanged(before, state)
    assert state["loader"].samples_consumed == 0


# ------------------------------------------------------------------ metadata confinement

def reseal(directory: Path) -> None:
    """Make the commit marker vouch for the files as they are now."""
    marker_path = directory / layout.MARKER_NAME
    marker = layout.Marker.from_json(marker_path.read_bytes(), where=str(marker_path))
    files = {name: layout.FileEntry((directory / name).stat().st_size,
                                    checksum_file(directory / name)) for name in marker.files}
    marker_path.write_bytes(layout.Marker(marker.step, marker.time, marker.world_size,
                                          files).to_json())


def two_steps(root: Path) -> tuple[Path, Path, torch.nn.Linear]:
    """Steps 10 and 20 of different weights; returns their directories and step 10's model."""
    torch.manual_seed(10)
    model_10 = torch.nn.Linear(4, 4)
    with Checkpointer(root, async_mode="sync") as ckpt:
        ckpt.save(10, {"model": model_10})
        ckpt.save(20, {"model": torch.nn.Linear(4, 4)})
    step_10, step_20 = sorted(p for p in root.iterdir() if p.name.startswith("step-"))
    return step_10, step_20, model_10


def redirect(metadata: Metadata, change: Any) -> Metadata:
    """``metadata`` with each weight's storage entry replaced by ``change(fqn, entry)``."""
    crafted = copy.deepcopy(metadata)
    crafted.storage_data = {index: change(index.fqn, info) if index.fqn.startswith("model.")
                            else info for index, info in crafted.storage_data.items()}
    return crafted


def _info(info: _StorageInfo, **changes: Any) -> _StorageInfo:
    return _StorageInfo(**{"relative_path": info.relative_path, "offset": info.offset,
                           "length": info.length, **changes})


@pytest.mark.parametrize("case", ["absolute", "dot-dot", "unlisted", "past the end",
                                  "path object", "transforms", "the marker"])
def test_metadata_pointing_outside_the_step_is_refused(tmp_path: Path, case: str) -> None:
    root = tmp_path / "root"
    step_10, step_20, _ = two_steps(root)
    (data_10,) = step_10.glob("*.distcp")
    metadata_path = step_20 / layout.DCP_METADATA_NAME
    metadata = load_metadata(metadata_path.read_bytes(), where="test")
    # step 10's own entries: a redirected weight reads step 10's bytes, which DCP loads
    # without a complaint (the attack of #21 item 7)
    of_10 = {index.fqn: info for index, info in load_metadata(
        (step_10 / layout.DCP_METADATA_NAME).read_bytes(), where="test").storage_data.items()}
    if case == "unlisted":  # a copy of step 10's file, in the step, not in the marker
        shutil.copy(data_10, step_20 / "extra.distcp")
    change = {
        "absolute": lambda fqn, i: _info(of_10[fqn], relative_path=str(data_10)),
        "dot-dot": lambda fqn, i: _info(of_10[fqn],
                                        relative_path=f"../{step_10.name}/{data_10.name}"),
        "unlisted": lambda fqn, i: _info(of_10[fqn], relative_path="extra.distcp"),
        "past the end": lambda fqn, i: _info(i, length=i.length + (1 << 20)),
        "path object": lambda fqn, i: _info(i, relative_path=PosixPath(i.relative_path)),
        "transforms": lambda fqn, i: _info(i, transform_descriptors=["zstd"]),
        "the marker": lambda fqn, i: _info(i, relative_path=layout.MARKER_NAME),
    }[case]
    metadata_path.write_bytes(pickle.dumps(redirect(metadata, change)))
    reseal(step_20)
    target = torch.nn.Linear(4, 4)
    before = target.weight.detach().clone()
    with Checkpointer(root, async_mode="sync") as ckpt, pytest.raises(
            CheckpointUnsafeError, match="refusing DCP metadata"):
        ckpt.load({"model": target}, step=20)
    assert torch.equal(target.weight, before)


# ------------------------------------------------------------------ the allow-list unpickler

class Gadget:
    """Pickles as a call of ``target(*args)``: what a crafted ``.metadata`` can ask for."""

    def __init__(self, target: Any, *args: Any) -> None:
        self.target, self.args = target, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.target, self.args


GADGETS = {
    "unknown layout name (a KeyError)": Gadget(torch.serialization._get_layout, "nope"),
    "OrderedDict of a number": Gadget(OrderedDict, 5),
    "set of a list": Gadget(set, [[1]]),
    "frozenset of a dict": Gadget(frozenset, [{}]),
    "Size of a string": Gadget(torch.Size, "abc"),
    "Size of a float": Gadget(torch.Size, [1.5]),
    "PosixPath of None": Gadget(PosixPath, None),
    "memory format 99": Gadget(_MEM_FORMAT_ENCODING, 99),
    "slice of too many": Gadget(slice, 1, 2, 3, 4),
    "a list, not Metadata": [1, 2, 3],
    "os.system": Gadget(os.system, "true"),
    "getattr": Gadget(getattr, "x", "upper"),
}


@pytest.mark.parametrize("case", sorted(GADGETS))
def test_crafted_metadata_gadgets_are_a_clear_refusal(case: str) -> None:
    with pytest.raises(CheckpointUnsafeError, match=r"refusing DCP metadata|holds a"):
        load_metadata(pickle.dumps(GADGETS[case]), where="crafted")


FUZZ_ATTEMPTS = 150  # a new seed every run; STREAMCACHE_FUZZ_SEED replays one


def test_fuzzed_metadata_pickles_are_refused_or_confined(tmp_path: Path) -> None:
    model, optimizer = trained(0)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(1, {"train": ModelState(model, optimizer), "extra": {"epoch": 1}})
    (directory,) = [p for p in tmp_path.iterdir() if p.name.startswith("step-")]
    original = (directory / layout.DCP_METADATA_NAME).read_bytes()
    marker = layout.Marker.from_json((directory / layout.MARKER_NAME).read_bytes(), where="t")
    seed = int(os.environ.get("STREAMCACHE_FUZZ_SEED") or random.randrange(1 << 30))
    chooser = random.Random(seed)
    outcomes = {"refused": 0, "loaded": 0}
    for attempt in range(FUZZ_ATTEMPTS):
        data = bytearray(original)
        for _ in range(chooser.randint(1, 4)):
            kind, at = chooser.randrange(4), chooser.randrange(len(data))
            if kind == 0:
                data[at] = chooser.randrange(256)
            elif kind == 1:
                del data[at:at + chooser.randint(1, 64)]
            elif kind == 2:
                data[at:at] = bytes(chooser.randrange(256) for _ in range(chooser.randint(1, 8)))
            else:
                data = data[:at]
        try:
            metadata = load_metadata(bytes(data), where="fuzzed")
            check_metadata(metadata, marker.files, "fuzzed")
            outcomes["loaded"] += 1
        except CheckpointUnsafeError:
            outcomes["refused"] += 1
        except Exception as exc:  # anything else is the defect this test looks for
            raise AssertionError(f"STREAMCACHE_FUZZ_SEED={seed}, attempt {attempt}: "
                                 f"{type(exc).__name__}: {exc}") from exc
    assert outcomes["refused"] > FUZZ_ATTEMPTS * 3 // 4, (seed, outcomes)


# ------------------------------------------------------------------ commit markers

def _remark(directory: Path, edit: Any) -> None:
    """Rewrite the marker with ``edit(body)`` applied, its own checksum made to match."""
    import json

    from streamcache.format.checksum import checksum_bytes

    marker_path = directory / layout.MARKER_NAME
    body = json.loads(marker_path.read_bytes())["body"]
    edit(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    marker_path.write_text(json.dumps({"body": body, "checksum": checksum_bytes(canonical)}))


def _rename_file(body: dict[str, Any], new: str) -> None:
    name = next(n for n in body["files"] if n.endswith(".distcp"))
    body["files"][new] = body["files"].pop(name)


MARKERS: dict[str, Any] = {
    "dot-dot name": lambda body: _rename_file(body, "../elsewhere.distcp"),
    "absolute name": lambda body: _rename_file(body, "/etc/hostname"),
    "negative size": lambda body: next(iter(body["files"].values())).update(size=-1),
    "size a bool": lambda body: next(iter(body["files"].values())).update(size=True),
    "size a string": lambda body: next(iter(body["files"].values())).update(size="12"),
    "world size 0": lambda body: body.update(world_size=0),
    "step a float": lambda body: body.update(step=20.0),
    "files a list": lambda body: body.update(files=[]),
}


@pytest.mark.parametrize("case", [*sorted(MARKERS), "symlink", "huge", "deep nesting"])
def test_a_marker_that_is_not_truthful_is_never_loaded(tmp_path: Path, case: str) -> None:
    root = tmp_path / "root"
    _, step_20, model_10 = two_steps(root)
    marker = step_20 / layout.MARKER_NAME
    if case == "symlink":  # a valid marker elsewhere, linked in
        target = tmp_path / "marker-elsewhere.json"
        marker.rename(target)
        marker.symlink_to(target)
    elif case == "huge":
        with open(marker, "ab") as f:
            f.truncate(layout.MARKER_LIMIT + 10)
    elif case == "deep nesting":
        marker.write_text("[" * 100_000 + "]" * 100_000)
    else:
        _remark(step_20, MARKERS[case])
    target_model = torch.nn.Linear(4, 4)
    with Checkpointer(root, async_mode="sync") as ckpt:
        latest = ckpt.latest()
        assert latest is not None and latest.step == 10  # step 20 is not complete
        assert ckpt.load({"model": target_model}) == 10
    assert torch.equal(target_model.weight, model_10.weight)
