"""Staging a CPU state into buffers kept from save to save (streamcache/checkpoint/host_buffers.py).

The contract: a save holds the values of its call whatever the loop writes afterwards; a save
after it copies into the same memory (no allocation, the floor of a blocking save); every
container and non-tensor leaf is the state's own at that call; a tensor whose shape, dtype or
sharding changed gets a new buffer; DTensors stay DTensors of the same mesh and placements.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from dist import RankGroup

from streamcache.checkpoint import Checkpointer, ModelState
from streamcache.checkpoint.host_buffers import HostBuffers


def _state() -> dict:
    return {"model": collections.OrderedDict(w=torch.arange(6.0).reshape(2, 3),
                                             b=torch.zeros(3)),
            "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
            "extra": (torch.full((2,), 7.0), "name", 5)}


def test_the_staged_state_holds_the_values_of_the_call_and_its_structure() -> None:
    live = _state()
    staged = HostBuffers().stage(live)
    live["model"]["w"].add_(100)
    live["optim"]["state"][0]["exp_avg"].zero_()
    live["optim"]["param_groups"][0]["lr"] = 0.5
    assert type(staged["model"]) is collections.OrderedDict
    assert list(staged["model"]) == ["w", "b"]
    assert torch.equal(staged["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(staged["optim"]["state"][0]["exp_avg"], torch.ones(4))
    assert staged["optim"]["param_groups"][0]["lr"] == 0.1
    assert isinstance(staged["extra"], tuple) and staged["extra"][1:] == ("name", 5)
    assert staged["model"]["w"].data_ptr() != live["model"]["w"].data_ptr()


def test_a_later_save_copies_into_the_same_memory_and_a_changed_tensor_gets_new_memory(
) -> None:
    buffers = HostBuffers()
    live = _state()
    first = buffers.stage(live)
    pointers = {name: first["model"][name].data_ptr() for name in ("w", "b")}
    live["model"]["w"].mul_(2)
    live["model"]["b"] = torch.zeros(5)  # another shape at the same place
    second = buffers.stage(live)
    assert second["model"]["w"].data_ptr() == pointers["w"]
    assert torch.equal(second["model"]["w"], 2 * torch.arange(6.0).reshape(2, 3))
    assert second["model"]["b"].shape == (5,)
    assert second["model"]["b"].data_ptr() != pointers["b"]
    live["model"]["w"] = live["model"]["w"].to(torch.float64)  # another dtype
    third = buffers.stage(live)
    assert third["model"]["w"].dtype == torch.float64
    assert third["model"]["w"].data_ptr() != pointers["w"]


def test_places_the_state_no_longer_has_release_their_buffers() -> None:
    buffers = HostBuffers()
    live = _state()
    buffers.stage(live)
    del live["extra"]
    buffers.stage(live)
    assert not any(path[0] == "extra" for path in buffers._staged)


def test_tensors_that_require_grad_are_copied_without_a_graph() -> None:
    live = {"w": torch.ones(3, requires_grad=True)}
    staged = HostBuffers().stage(live)
    assert not staged["w"].requires_grad and staged["w"].grad_fn is None


def test_a_checkpointer_round_trip_after_the_loop_changed_the_state(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    with Checkpointer(tmp_path, async_mode="thread") as ckpt:
        for step in (1, 2, 3):
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save(step, {"train": ModelState(model, optimizer)})
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # the loop goes on while the save writes
            ckpt.wait()
            restored = torch.nn.Linear(4, 3)
            ckpt.load({"train": ModelState(restored, torch.optim.AdamW(
                restored.parameters()))}, step)
            for name, value in restored.state_dict().items():
                assert torch.equal(value, expected[name]), (step, name)


def _fsdp_round_trip(rank: int, world: int, root: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    state = ModelState(model, optimizer)
    staged = HostBuffers().stage(state.state_dict())
    placements = sorted({repr(v.placements) for v in staged["model"].values()
                         if isinstance(v, DTensor)})
    expected = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with Checkpointer(root, async_mode="thread") as ckpt:
        ckpt.save(1, {"train": state})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ckpt.wait()
        ckpt.save(2, {"train": state})  # the same buffers, the values of this call
        ckpt.wait()
        restored = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        for layer in restored:
            fully_shard(layer, mesh=mesh)
        fully_shard(restored, mesh=mesh)
        ckpt.load({"train": ModelState(restored, torch.optim.AdamW(restored.parameters()))}, 1)
        for name, value in restored.state_dict().items():
            assert torch.equal(value.full_tensor(), expected[name]), name
    return placements


def test_fsdp2_dtensors_are_staged_as_dtensors_and_round_trip(tmp_path: Path) -> None:
    results = RankGroup(_fsdp_round_trip, 2, args=(str(tmp_path / "ckpt"),),
                        timeout_s=180).join(check=True)
    placements = [r.value for r in results]
    assert placements[0] == placements[1] and placements[0] == ["(Shard(dim=0),)"]
    assert json.dumps(placements)  # (what each rank saw, for the message)


@pytest.mark.parametrize("value", [collections.defaultdict(list, a=[torch.ones(2)]),
                                   collections.Counter(a=2)])
def test_other_mapping_types_are_copied_whole(value) -> None:
    staged = HostBuffers().stage({"x": value})
    assert type(staged["x"]) is type(value) and staged["x"] is not value
