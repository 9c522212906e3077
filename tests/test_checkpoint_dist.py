"""Checkpointer across real processes (gloo on 127.0.0.1): round trip, failures, elastic reload.

Full StreamLoader round trips come with the loader; a stand-in global Stateful (``Cursor``)
takes its place here.
"""

from __future__ import annotations

import errno
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from helpers.stand_ins import Cursor

from streamcache.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    ModelState,
    commit,
    layout,
    rng,
)

SEED = 0


def draws() -> tuple[float, float, list[float]]:
    """The next values of every generator the checkpointer restores."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def seed_rank(rank: int) -> None:
    random.seed(1000 + rank)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)


def small_model(seed: int, mesh: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP and its optimizer; sharded FSDP2-style over ``mesh`` if given."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    model(torch.randn(4, 8) + rank).square().mean().backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()
    optimizer.zero_grad()


def full(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Plain full tensors of a (possibly DTensor) flat state dict."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in tensors.items() if isinstance(v, torch.Tensor)}


def optimizer_fulls(state: ModelState) -> dict[str, torch.Tensor]:
    optim_state = state.state_dict()["optim"]["state"]
    return {f"{fqn}.{k}": v for fqn, per in optim_state.items() for k, v in full(per).items()}


# ---------------------------------------------------------------- round trip and failures


def _round_trip_and_failures(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, optimizer = small_model(0)
    train_step(model, optimizer, rank)
    cursor = Cursor(640)
    state = {"train": ModelState(model, optimizer), "loader": cursor, "extra": {"epoch": 2}}
    for mode in ("thread", "sync", "process"):
        seed_rank(rank)
        with Checkpointer(f"{tmp}/{mode}", local_dir=f"{tmp}/{mode}-nvme",
                          async_mode=mode) as ckpt:
            ckpt.save(3, state)
            expected_draws = draws()
            ckpt.wait()
            model2, optimizer2 = small_model(99)
            state2 = {"train": ModelState(model2, optimizer2), "loader": Cursor(),
                      "extra": {"epoch": -1}}
            assert ckpt.load(state2) == 3
            out[mode] = {
                "weights_equal": all(torch.equal(a, b) for a, b in
                                     zip(model.state_dict().values(),
                                         model2.state_dict().values(), strict=True)),
                "optim_equal": all(torch.equal(a, b) for a, b in zip(
                    optimizer_fulls(state["train"]).values(),
                    optimizer_fulls(state2["train"]).values(), strict=True)),
                "cursor": state2["loader"].samples_consumed,
                "extra": state2["extra"],
                "rng_restored": draws() == expected_draws,
            }
    with Checkpointer(f"{tmp}/fail", local_dir=f"{tmp}/fail-nvme") as ckpt:
        # a global state that differs between ranks is refused on every rank
        try:
            ckpt.save(1, {"loader": Cursor(rank)})
            out["mismatch"] = None
        except CheckpointError as exc:
            out["mismatch"] = str(exc)
        # disk full in rank 1's DCP writer
        original = torch.distributed.checkpoint.FileSystemWriter.write_data

        def disk_full(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

        if rank == 1:
            torch.distributed.checkpoint.FileSystemWriter.write_data = disk_full  # type: ignore[method-assign]
        ckpt.save(2, state)
        try:
            ckpt.wait()
            out["disk_full"] = None
        except CheckpointWriteError as exc:
            out["disk_full"] = str(exc)
        torch.distributed.checkpoint.FileSystemWriter.write_data = original  # type: ignore[method-assign]
        # permission denied while rank 1 uploads to root
        original_upload = commit.upload_file

        def denied(target: Any, local_file: str, name: str) -> None:
            raise PermissionError(errno.EACCES, "Permission denied", target.join(name))

        if rank == 1:
            commit.upload_file = denied  # type: ignore[assignment]
        ckpt.save(4, state)
        try:
            ckpt.save(5, state)  # reported at the next save
            out["denied"] = None
        except CheckpointWriteError as exc:
            out["denied"] = str(exc)
        commit.upload_file = original_upload  # type: ignore[assignment]
        ckpt.save(6, state)
        ckpt.wait()
        out["complete"] = [i.step for i in ckpt.list() if i.complete]
    return out


def test_two_ranks_round_trip_and_failures_reach_every_rank(tmp_path: Path) -> None:
    results = [r.value for r in run_ranks(_round_trip_and_failures, 2, str(tmp_path))]
    for mode in ("thread", "sync", "process"):
        for value in results:
            assert value[mode] == {"weights_equal": True, "optim_equal": True, "cursor": 640,
                                   "extra": {"epoch": 2}, "rng_restored": True}, mode
    for value in results:
        assert "global states differ between ranks (ranks [1]" in value["mismatch"]
        assert "step 2 was not committed" in value["disk_full"]
        assert "rank 1: OSError: [Errno 28] No space left on device" in value["disk_full"]
        assert "step 4 was not committed" in value["denied"]
        assert "rank 1: PermissionError" in value["denied"]
        assert value["complete"] == [6]  # no marker for 2 or 4; step 1 was refused up front
    names = [p.name for p in (tmp_path / "fail").iterdir()]
    committed = [n for n in names if (tmp_path / "fail" / n / layout.MARKER_NAME).exists()]
    assert [layout.parse_dir_name(n)[0] for n in committed] == [6]  # type: ignore[index]


# ---------------------------------------------------------------- elastic reload


def _save_sharded(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    sharded, sharded_opt = small_model(1, init_device_mesh("cpu", (world,)))
    replicated, replicated_opt = small_model(2)
    for _ in range(2):
        train_step(replicated, replicated_opt, rank)
        sharded(torch.randn(4, 8) + rank).square().mean().backward()  # FSDP reduces grads
        sharded_opt.step()
        sharded_opt.zero_grad()
    state = {"sharded": ModelState(sharded, sharded_opt),
             "replicated": ModelState(replicated, replicated_opt), "loader": Cursor(4096)}
    seed_rank(rank)
    with Checkpointer(tmp, async_mode="thread") as ckpt:
        ckpt.save(2, state)
        expected_draws = draws()
        ckpt.wait()
    assert isinstance(sharded[0].weight, torch.distributed.tensor.DTensor)
    return {
        "draws": expected_draws,
        "sharded": full(state["sharded"].state_dict()["model"]),
        "sharded_optim": optimizer_fulls(state["sharded"]),
        "replicated": full(replicated.state_dict()),
        "replicated_optim": optimizer_fulls(state["replicated"]),
    }


def _load_elastic(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    sharded, sharded_opt = small_model(7, init_device_mesh("cpu", (world,)))  # M shards
    replicated, replicated_opt = small_model(8)
    state = {"sharded": ModelState(sharded, sharded_opt),
             "replicated": ModelState(replicated, replicated_opt), "loader": Cursor()}
    with Checkpointer(tmp, async_mode="sync", seed=SEED) as ckpt:
        step = ckpt.load(state)
    return {
        "step": step,
        "draws": draws(),
        "cursor": state["loader"].samples_consumed,
        "sharded": full(state["sharded"].state_dict()["model"]),
        "sharded_optim": optimizer_fulls(state["sharded"]),
        "replicated": full(replicated.state_dict()),
        "replicated_optim": optimizer_fulls(state["replicated"]),
    }


def assert_tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """One checkpoint saved by 2 ranks, shared by the reloads on other world sizes."""
    root = tmp_path_factory.mktemp("elastic")
    return root, [r.value for r in run_ranks(_save_sharded, 2, str(root))]


@pytest.mark.parametrize("new_world", [1, 3])
def test_elastic_reload_2_to_m(saved_by_two_ranks: tuple[Path, list[Any]],
                               new_world: int) -> None:
    root, saved = saved_by_two_ranks
    loaded = [r.value for r in run_ranks(_load_elastic, new_world, str(root))]
    for rank, value in enumerate(loaded):
        assert value["step"] == 2 and value["cursor"] == 4096
        for key in ("sharded", "sharded_optim", "replicated", "replicated_optim"):
            assert_tensors_equal(value[key], saved[0][key])
        if rank < 2:
            assert value["draws"] == saved[rank]["draws"]  # this rank's own RNG states
        else:
            rng.derive(SEED, rank, 2)  # a new rank: derived from (seed, rank, step)
            assert value["draws"] == draws()
    if new_world == 3:
        assert loaded[2]["draws"] != loaded[1]["draws"]


# ---------------------------------------------------------------- raw FSDP2 objects


def _raw_fsdp2_round_trip(rank: int, world: int, tmp: str) -> dict[str, bool]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, optimizer = small_model(1, mesh)
    for _ in range(2):
        model(torch.randn(4, 8) + rank).square().mean().backward()  # FSDP reduces grads
        optimizer.step()
        optimizer.zero_grad()
    with Checkpointer(tmp, async_mode="thread") as ckpt:
        ckpt.save(2, {"model": model, "optim": optimizer})
        fresh, fresh_optimizer = small_model(9, mesh)  # never stepped: empty state
        assert ckpt.load({"model": fresh, "optim": fresh_optimizer}) == 2
    return {
        "weights": all(torch.equal(a, b) for a, b in zip(
            full(model.state_dict()).values(), full(fresh.state_dict()).values(), strict=True)),
        "optimizer": all(torch.equal(a, b) for a, b in zip(
            optimizer_fulls(ModelState(model, optimizer)).values(),
            optimizer_fulls(ModelState(fresh, fresh_optimizer)).values(), strict=True)),
        "sharded": isinstance(fresh[0].weight, torch.distributed.tensor.DTensor),
    }


# ---------------------------------------------------------------- timelines on two ranks


def _rollback(rank: int, world: int, tmp: str) -> dict[str, Any]:
    model, optimizer = small_model(0)
    with Checkpointer(tmp, async_mode="thread") as ckpt:
        for step in (1, 2, 3):
            train_step(model, optimizer, rank)
            ckpt.save(step, {"train": ModelState(model, optimizer), "loader": Cursor(step)})
        cursor = Cursor()
        rolled_back = ckpt.load({"train": ModelState(model, optimizer), "loader": cursor}, 1)
        ckpt.save(2, {"train": ModelState(model, optimizer), "loader": Cursor(20)})
    with Checkpointer(tmp, async_mode="sync") as ckpt:
        resumed = Cursor()
        step = ckpt.load({"train": ModelState(*small_model(5)), "loader": resumed})
        latest = ckpt.latest()
    return {"rolled_back": (rolled_back, cursor.samples_consumed),
            "resumed": (step, resumed.samples_consumed),
            "new_timeline": latest is not None and latest.timeline != ""}


def _raw_fsdp2_then_rollback(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Two checks in one process start each (starting ranks costs seconds)."""
    return {"fsdp2": _raw_fsdp2_round_trip(rank, world, f"{tmp}/fsdp2"),
            "rollback": _rollback(rank, world, f"{tmp}/rollback")}


def test_raw_fsdp2_objects_round_trip_and_a_rollback_starts_one_timeline(
    tmp_path: Path,
) -> None:
    for result in run_ranks(_raw_fsdp2_then_rollback, 2, str(tmp_path)):
        assert result.value["fsdp2"] == {"weights": True, "optimizer": True, "sharded": True}
        assert result.value["rollback"] == {"rolled_back": (1, 1), "resumed": (2, 20),
                                            "new_timeline": True}
