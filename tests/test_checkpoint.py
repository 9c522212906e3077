"""Checkpointer in one process: round trip, commit protocol, corruption, retention, tiers, S3.

Multi-process behaviour (elastic reload, writer failure on one rank, SIGKILL at random
moments) is in test_checkpoint_dist.py and test_checkpoint_crash.py; raw objects, strict
loads and torn snapshots in test_checkpoint_state.py; timelines and the lease in
test_checkpoint_timeline.py; crafted pickles and transient errors in test_checkpoint_restore.py.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.stand_ins import Cursor

from streamcache.checkpoint import (
    AsyncMode,
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    GlobalState,
    ModelState,
    commit,
    layout,
    restore,
    rng,
)
from streamcache.cli.main import main as cli_main

# DCP warns on every single-process save/load that it assumes one process: that is the case
# these tests are about.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    state = {"train": ModelState(model, optimizer), "loader": Cursor(seed * 100),
             "extra": {"epoch": seed, "note": "x"}}
    return model, optimizer, state


def fresh_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(12345)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # DCP loads what the given state asks for: plain values need their keys present
    return model, optimizer, {"train": ModelState(model, optimizer), "loader": Cursor(),
                              "extra": {"epoch": -1, "note": ""}}


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def data_file(root: Path) -> Path:
    """The largest DCP data file of the newest checkpoint directory under ``root``."""
    newest = sorted(p for p in root.iterdir() if p.name.startswith("step-"))[-1]
    return max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_round_trip_model_optimizer_loader_rng_extras(tmp_path: Path, mode: str) -> None:
    model, optimizer, state = make_state(1)
    with Checkpointer(tmp_path, async_mode=mode) as ckpt:
        assert ckpt.save(7, state)
        after_save = (random.random(), np.random.rand(), torch.rand(3))
        ckpt.wait()
        model2, optimizer2, state2 = fresh_state()
        assert ckpt.load(state2) == 7
    assert_same(model, model2)
    opt_a, opt_b = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    assert all(torch.equal(opt_a[k]["exp_avg_sq"], opt_b[k]["exp_avg_sq"]) for k in opt_a)
    assert state2["loader"].samples_consumed == 100
    assert state2["extra"] == {"epoch": 1, "note": "x"}
    # RNG states are those at save time: the draws after load repeat the draws after save
    assert random.random() == after_save[0]
    assert np.random.rand() == after_save[1]
    assert torch.equal(torch.rand(3), after_save[2])


def test_load_without_checkpoints_returns_none_and_missing_step_raises(tmp_path: Path) -> None:
    _, _, state = fresh_state()
    with Checkpointer(tmp_path / "empty", async_mode="sync") as ckpt:
        assert ckpt.load(state) is None
        assert ckpt.latest() is None
        with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint of step 3"):
            ckpt.load(state, step=3)


def test_marker_lists_every_file_with_size_and_checksum(tmp_path: Path) -> None:
    _, _, state = make_state(2)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(5, state)
        info = ckpt.latest()
    assert info is not None and info.complete and info.step == 5 and info.world_size == 1
    directory = tmp_path / info.name
    assert info.marker is not None
    on_disk = {p.name for p in directory.iterdir()} - {layout.MARKER_NAME}
    assert set(info.marker.files) == on_disk
    assert {".metadata", "global.json", "__0_0.distcp"} <= on_disk
    for name, entry in info.marker.files.items():
        assert entry.size == (directory / name).stat().st_size
        assert entry.checksum.startswith("xxh64:")
    assert json.loads((directory / "global.json").read_bytes())["states"] == {
        "loader": {"version": 1, "samples_consumed": 200}
    }


def test_latest_never_returns_a_partial_or_tampered_checkpoint(tmp_path: Path) -> None:
    _, _, state = make_state(3)
    with Checkpointer(tmp_path, async_mode="sync", keep_last=5) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
        ckpt.save(3, state)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    # step 3: marker removed (a save killed before its commit)
    (tmp_path / names[2] / layout.MARKER_NAME).unlink()
    # step 2: marker edited by hand (its self-checksum no longer matches)
    marker_path = tmp_path / names[1] / layout.MARKER_NAME
    marker_path.write_bytes(marker_path.read_bytes().replace(b'"step": 2', b'"step": 9'))
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        infos = ckpt.list()
        latest = ckpt.latest()
    assert [(i.step, i.complete) for i in infos] == [(1, True), (2, False), (3, False)]
    assert "no commit marker" in (infos[2].problem or "")
    assert "does not match its checksum" in (infos[1].problem or "")
    assert latest is not None and latest.step == 1
    # a truncated data file is caught by the cheap check (sizes) too
    shard = next((tmp_path / names[0]).glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    assert layout.latest(layout.Location(tmp_path)) is None


def flip_4k_in_the_middle(path: Path) -> None:
    size = path.stat().st_size
    assert size > 3 * 4096, f"{path} is too small to flip 4 KiB in its middle"
    with open(path, "r+b") as f:
        f.seek(size // 2 - 2048)
        block = f.read(4096)
        f.seek(size // 2 - 2048)
        f.write(bytes(b ^ 0xFF for b in block))


def big_state(seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(256, 256)  # 256 KiB of weights: the flip lands inside a tensor
    return model, {"model": model}


def test_flipped_4k_is_caught_and_the_previous_checkpoint_is_loaded(tmp_path: Path) -> None:
    model1, state1 = big_state(1)
    model2, state2 = big_state(2)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(1, state1)
        ckpt.save(2, state2)
    damaged = data_file(tmp_path)
    flip_4k_in_the_middle(damaged)

    # DCP alone loads the damaged shard without any error, and the values are wrong
    plain, plain_state = big_state(3)
    dcp.load(plain_state, checkpoint_id=str(damaged.parent), no_dist=True)
    assert not torch.equal(plain.weight, model2.weight)
    assert torch.equal(plain.bias, model2.bias)  # it did load: the undamaged part matches

    loaded, loaded_state = big_state(4)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        assert ckpt.latest() is not None  # the cheap check cannot see a flip (same size)
        assert ckpt.load(loaded_state) == 1  # refused step 2, fell back to step 1
        assert_same(loaded, model1)
        with pytest.raises(CheckpointCorruptError, match="is corrupt: checksum"):
            ckpt.load(loaded_state, step=2)


def test_retention_keeps_newest_complete_and_leaves_newer_partials(tmp_path: Path) -> None:
    _, _, state = make_state(4)
    stale = tmp_path / layout.dir_name(2, "dead00", 0)  # a crashed save, older
    newer = tmp_path / layout.dir_name(99, "beef00", 0)  # a save of a newer step, no marker
    stale.mkdir(parents=True)
    newer.mkdir()
    with Checkpointer(tmp_path, async_mode="thread", keep_last=2) as ckpt:
        for step in (1, 3, 5, 7):
            ckpt.save(step, state)
        ckpt.wait()
        steps = [(i.step, i.complete) for i in ckpt.list()]
    assert steps == [(5, True), (7, True), (99, False)]


def test_keep_last_one_never_deletes_the_newest_complete(tmp_path: Path) -> None:
    _, _, state = make_state(5)
    with Checkpointer(tmp_path, async_mode="sync", keep_last=1) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
        assert [(i.step, i.complete) for i in ckpt.list()] == [(2, True)]
    with pytest.raises(CheckpointError, match="keep at least 1"):
        Checkpointer(tmp_path, keep_last=0)


def test_writer_failure_publishes_nothing_and_is_raised_at_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    _, _, state = make_state(6)
    original = dcp.FileSystemWriter.write_data
    failed = threading.Event()

    def disk_full(self: Any, plan: Any, planner: Any) -> Any:
        failed.set()
        raise OSError(28, "No space left on device")

    with Checkpointer(tmp_path, async_mode="thread") as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", disk_full)
        ckpt.save(2, state)  # returns after staging; the write fails in the background
        assert failed.wait(30)
        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", original)
        with pytest.raises(CheckpointWriteError, match=r"step 2 was not committed.*No space"):
            ckpt.save(3, state)
        ckpt.save(3, state)  # the error was reported once; saving works again
        ckpt.wait()
        complete = [i.step for i in ckpt.list() if i.complete]
    assert complete == [1, 3]


def test_upload_failure_publishes_nothing_and_is_raised_at_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, state = make_state(7)

    def refused(target: Any, local_file: str, name: str) -> None:
        raise PermissionError(13, "Permission denied", target.join(name))

    monkeypatch.setattr(commit, "upload_file", refused)
    with Checkpointer(tmp_path / "root", local_dir=tmp_path / "nvme") as ckpt:
        ckpt.save(1, state)
        with pytest.raises(CheckpointWriteError, match="Permission denied"):
            ckpt.wait()
        assert ckpt.latest() is None


def test_tiered_save_loads_local_copy_and_falls_back_to_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _, state = make_state(8)
    root, nvme = tmp_path / "root", tmp_path / "nvme"
    with Checkpointer(root, local_dir=nvme) as ckpt:
        ckpt.save(4, state)
        ckpt.wait()
    name = next(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert (root / name / layout.MARKER_NAME).exists()
    assert not (nvme / name / layout.MARKER_NAME).exists()  # root's marker is the truth
    local_files = {p.name for p in (nvme / name).iterdir()}
    assert local_files == {p.name for p in (root / name).iterdir()} - {layout.MARKER_NAME}

    sources: list[str] = []
    original = restore.Restorer.load_from

    def spy(self: Any, source: Any, info: Any, state: Any) -> None:
        sources.append(source.url)
        original(self, source, info, state)

    monkeypatch.setattr(restore.Restorer, "load_from", spy)
    with Checkpointer(root, local_dir=nvme) as ckpt:
        model2, _, state2 = fresh_state()
        assert ckpt.load(state2) == 4
        assert_same(model, model2)
        flip_4k_in_the_middle(data_file(nvme))  # the local copy differs from root's
        model3, _, state3 = fresh_state()
        assert ckpt.load(state3) == 4
        assert_same(model, model3)
        shutil.rmtree(nvme / name)  # a different node: no local copy at all
        _, _, state4 = fresh_state()
        assert ckpt.load(state4) == 4
    assert sources == [str(nvme / name), str(root / name), str(root / name)]


def test_s3_root_through_local_tier(tmp_path: Path, s3_bucket: Any) -> None:
    model, _, state = make_state(9)
    root = s3_bucket.url(f"ckpt-{os.getpid()}-{random.randrange(1 << 30)}")
    options = s3_bucket.storage_options()
    with Checkpointer(root, local_dir=tmp_path / "nvme", storage_options=options,
                      keep_last=1) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)
        ckpt.wait()
        assert [(i.step, i.complete) for i in ckpt.list()] == [(2, True)]
    shutil.rmtree(tmp_path / "nvme")  # restart elsewhere: load straight from S3
    with Checkpointer(root, storage_options=options, async_mode="sync") as ckpt:
        model2, _, state2 = fresh_state()
        assert ckpt.load(state2) == 2
        assert_same(model, model2)
        assert state2["loader"].samples_consumed == 900


def _held_uploads(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[bool]]:
    """Uploads wait for the returned event (and fail while the returned flag is set)."""
    import threading

    release = threading.Event()
    original = commit.upload_file
    fail = [False]

    def held_upload(target: Any, local_file: str, name: str) -> None:
        release.wait(30)
        if fail[0]:
            raise OSError("the remote refused the upload")
        original(target, local_file, name)

    monkeypatch.setattr(commit, "upload_file", held_upload)
    return release, fail


def test_skip_if_busy_returns_false_while_a_write_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, state = make_state(10)
    release, _ = _held_uploads(monkeypatch)
    with Checkpointer(tmp_path / "root", local_dir=tmp_path / "nvme", if_busy="skip") as ckpt:
        assert ckpt.save(1, state)
        assert not ckpt.save(2, state)
        release.set()
        ckpt.wait()
        assert ckpt.save(3, state)
        ckpt.wait()
        assert [i.step for i in ckpt.list()] == [1, 3]


def test_in_flight_is_true_until_the_save_is_committed_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, state = make_state(10)
    release, fail = _held_uploads(monkeypatch)
    with Checkpointer(tmp_path / "root", local_dir=tmp_path / "nvme") as ckpt:
        assert not ckpt.in_flight
        ckpt.save(1, state)
        assert ckpt.in_flight and ckpt.latest() is None
        release.set()
        deadline = time.monotonic() + 30
        while ckpt.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ckpt.in_flight
        info = ckpt.latest()  # committed by the time in_flight turned False, before wait()
        assert info is not None and info.step == 1
        ckpt.wait()
        release.clear()
        fail[0] = True
        ckpt.save(2, state)
        assert ckpt.in_flight
        release.set()
        while ckpt.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not ckpt.in_flight  # a failed save ends too; in_flight itself does not raise
        with pytest.raises(CheckpointWriteError, match="step 2 was not committed"):
            ckpt.wait()
        assert not ckpt.in_flight


def test_global_state_must_be_json_and_reserved_keys_rejected(tmp_path: Path) -> None:
    class Bad(Cursor):
        def state_dict(self) -> dict[str, Any]:
            return {"t": torch.zeros(1)}

    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        with pytest.raises(CheckpointError, match="not JSON-able"):
            ckpt.save(1, {"loader": Bad()})
        with pytest.raises(CheckpointError, match="reserved"):
            ckpt.save(1, {"_streamcache_x": 1})
        wrapped = GlobalState(Cursor(5))
        ckpt.save(2, {"loader": wrapped})
        target = GlobalState(Cursor())
        assert ckpt.load({"loader": target}) == 2
        assert target.state_dict()["samples_consumed"] == 5
        with pytest.raises(CheckpointError, match="not in the checkpoint"):
            ckpt.load({"loader": target, "other": Cursor()})


def test_rng_derived_for_missing_rank_is_deterministic() -> None:
    rng.derive(seed=3, rank=5, step=10)
    first = (random.random(), np.random.rand(), torch.rand(2))
    rng.derive(seed=3, rank=6, step=10)
    other = random.random()
    rng.derive(seed=3, rank=5, step=10)
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    assert other != first[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_round_trip() -> None:  # pragma: no cover - runs on GPU machines only
    torch.cuda.init()
    saved = rng.capture()
    expected = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")
    rng.restore(saved)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_process_mode_needs_torch_distributed(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"needs torch\.distributed"):
        Checkpointer(tmp_path, async_mode=AsyncMode.PROCESS)


def test_cli_lists_and_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, _, state = make_state(12)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(10, state)
        ckpt.save(20, state)
    (tmp_path / layout.dir_name(30, "abc123", 0)).mkdir()
    assert cli_main(["checkpoints", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "partial (no commit marker" in out
    assert "latest complete: 20" in out
    assert cli_main(["checkpoints", str(tmp_path), "--verify", "latest"]) == 0
    assert "step 20:" in capsys.readouterr().out
    _, big = big_state(1)
    with Checkpointer(tmp_path / "big", async_mode="sync") as ckpt:
        ckpt.save(1, big)
    flip_4k_in_the_middle(data_file(tmp_path / "big"))
    assert cli_main(["checkpoints", str(tmp_path / "big"), "--verify", "1"]) == 1
    assert "is damaged" in capsys.readouterr().err
    assert cli_main(["checkpoints", str(tmp_path / "nonexistent")]) == 1
    assert capsys.readouterr().err.count("\n") == 1  # one clear line, no traceback


def test_background_staging_saves_the_state_of_the_save_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from streamcache.checkpoint import staging

    original = staging.Staging.stage_later

    def slow(self: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        time.sleep(0.3)  # the training loop runs on meanwhile
        return original(self, state_dict)

    monkeypatch.setattr(staging.Staging, "stage_later", slow)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    state = {"train": ModelState(model, optimizer)}
    with Checkpointer(tmp_path, async_mode="thread", background_staging=True) as ckpt:
        model(torch.randn(8, 4)).sum().backward()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        started = time.perf_counter()
        ckpt.save(1, state)
        blocked = time.perf_counter() - started
        model(torch.randn(8, 4)).sum().backward()  # BatchNorm statistics: waits for the copy
        optimizer.step()  # waits for the copy
        waited = time.perf_counter() - started
        ckpt.wait()
        assert blocked < 0.25 < waited
        torch.manual_seed(1)
        loaded = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        ckpt.load({"train": ModelState(loaded, torch.optim.SGD(loaded.parameters()))})
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert not torch.equal(model[0].weight, expected["0.weight"])  # the step did happen


def test_newest_attempt_of_a_step_wins(tmp_path: Path) -> None:
    import time

    # a run resumed from step 1 saves step 2 again; the later run's attempt is the newest
    _, state_a = big_state(1)
    model_b, state_b = big_state(2)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        for _ in range(11):
            ckpt.save(2, state_a)
        first_run = ckpt.latest()
    assert first_run is not None and first_run.name.endswith("-10")  # 10 sorts after 9
    assert sorted(n.rsplit("-", 1)[1] for n in os.listdir(tmp_path)
                  if n.startswith("step-")) == ["10", "8", "9"]
    time.sleep(0.002)  # the next run's id (its start time in ms) is later
    with Checkpointer(tmp_path, async_mode="sync", keep_last=20) as ckpt:
        ckpt.save(2, state_b)
        newest = ckpt.latest()
        loaded, loaded_state = big_state(3)
        assert ckpt.load(loaded_state) == 2
    assert newest is not None and newest.name == sorted(
        (p.name for p in tmp_path.iterdir() if p.name.startswith("step-")),
        key=lambda n: layout.parse_dir_name(n)[1])[-1]
    assert_same(loaded, model_b)


def test_a_one_process_checkpointer_does_not_warn(tmp_path: Path) -> None:
    import warnings

    _, _, state = make_state(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DCP's "torch.distributed is disabled" would raise
        with Checkpointer(tmp_path, async_mode="thread") as ckpt:
            ckpt.save(1, state)
            ckpt.wait()
            assert ckpt.load(fresh_state()[2]) == 1


def test_a_root_or_local_dir_under_a_file_is_a_clear_error(tmp_path: Path) -> None:
    from streamcache.errors import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"root must be a folder, but .*a-file is a file"):
        Checkpointer(blocker / "ckpt", async_mode="sync")
    with pytest.raises(ConfigError, match=r"local_dir must be a folder, but .*a-file"):
        Checkpointer(tmp_path / "root", local_dir=blocker, async_mode="sync")
