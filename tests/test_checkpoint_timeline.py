"""Timelines (a rollback starts one; loads and retention follow the live one) and the lease
(one job writes a root; a job that died does not block its restart)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from streamcache.checkpoint import Checkpointer, CheckpointError, lease
from streamcache.cli.main import main as cli_main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state_at(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": torch.nn.Linear(4, 4), "extra": {"step": step}}


def loaded_step(ckpt: Checkpointer, step: int | None = None) -> tuple[int | None, int]:
    """(the step load returns, the step whose values were loaded)."""
    target = state_at(0)
    found = ckpt.load(target, step)
    torch.manual_seed(target["extra"]["step"])
    assert torch.equal(target["model"].weight, torch.nn.Linear(4, 4).weight)
    return found, target["extra"]["step"]


def test_rollback_starts_a_timeline_that_loads_and_retention_follow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Checkpointer(tmp_path, async_mode="sync", keep_last=3) as ckpt:
        for step in (100, 200, 300, 400, 500):
            ckpt.save(step, state_at(step))
    with Checkpointer(tmp_path, async_mode="sync", keep_last=3) as ckpt:
        assert loaded_step(ckpt, 300) == (300, 300)  # a deliberate rollback
        ckpt.save(350, state_at(351))
        ckpt.save(400, state_at(401))
    with Checkpointer(tmp_path, async_mode="sync", keep_last=3) as ckpt:
        assert loaded_step(ckpt) == (400, 401)  # the new timeline's newest save
        latest = ckpt.latest()
        assert latest is not None and latest.step == 400 and latest.timeline != ""
        complete = sorted((i.step, i.timeline != "") for i in ckpt.list() if i.complete)
    # the live history kept its newest 3 (300, 350, 400); the abandoned 400 and 500 are kept
    assert complete == [(300, False), (350, True), (400, False), (400, True), (500, False)]
    assert cli_main(["checkpoints", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("abandoned") == 2 and "latest complete: 400" in out


def test_a_rollback_without_saves_after_it_still_wins(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state_at(step))
        assert loaded_step(ckpt, 2) == (2, 2)
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:  # the job died before saving
        assert loaded_step(ckpt) == (2, 2)
        assert loaded_step(ckpt, 3) == (3, 3)  # an abandoned step, on request: rolls forward
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        assert loaded_step(ckpt) == (3, 3)


def test_a_second_job_on_the_root_is_refused(tmp_path: Path) -> None:
    first = Checkpointer(tmp_path, async_mode="sync")
    second = Checkpointer(tmp_path, async_mode="sync")
    try:
        first.save(1, state_at(1))
        with pytest.raises(CheckpointError, match="being written by another job"):
            second.save(2, state_at(2))
        assert loaded_step(second) == (1, 1)  # reading needs no lease
        first.close()
        second.save(2, state_at(2))  # released by close
        assert [i.step for i in second.list()] == [1, 2]
    finally:
        first.close()
        second.close()


def test_the_lease_of_a_killed_job_on_this_host_is_taken_at_once(tmp_path: Path) -> None:
    script = (
        "import os, signal, sys, torch\n"
        "from streamcache.checkpoint import Checkpointer\n"
        "ckpt = Checkpointer(sys.argv[1], async_mode='sync')\n"
        "ckpt.save(1, {'model': torch.nn.Linear(4, 4)})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    process = subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=False,
                             timeout=120)
    assert process.returncode == -9
    held = json.loads((tmp_path / lease.LEASE_NAME).read_text())
    assert held["host"] == socket.gethostname()
    with Checkpointer(tmp_path, async_mode="sync", lease_ttl=3600) as ckpt:
        ckpt.save(2, state_at(2))  # a TTL of an hour: only the dead holder's pid lets it in
        assert json.loads((tmp_path / lease.LEASE_NAME).read_text())["token"] != held["token"]


def foreign_lease(root: Path, *, ttl_s: float, job_id: str | None = None,
                  renewals: int = 1) -> None:
    body = {"token": "other", "job_id": job_id, "host": "another-host", "pid": 1,
            "renewals": renewals, "ttl_s": ttl_s}
    (root / lease.LEASE_NAME).write_text(json.dumps(body))


def test_a_lease_from_another_host_lapses_unless_renewed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    renewed, lapsed = tmp_path / "renewed", tmp_path / "lapsed"
    renewed.mkdir()
    lapsed.mkdir()
    foreign_lease(renewed, ttl_s=1.0)
    stop = threading.Event()

    def renew() -> None:
        count = 1
        while not stop.wait(0.1):
            count += 1
            foreign_lease(renewed, ttl_s=1.0, renewals=count)

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        with Checkpointer(renewed, async_mode="sync", lease_ttl=1.0) as ckpt, pytest.raises(
                CheckpointError, match=r"another-host.*renews it"):
            ckpt.save(1, state_at(1))
    finally:
        stop.set()
        renewer.join()
    foreign_lease(lapsed, ttl_s=1.0)
    with caplog.at_level(logging.WARNING, "streamcache.checkpoint"), Checkpointer(
            lapsed, async_mode="sync", lease_ttl=1.0) as ckpt:
        ckpt.save(1, state_at(1))
    assert "taking over the lease" in caplog.text


def test_a_restart_with_the_same_job_id_takes_the_lease_at_once(tmp_path: Path) -> None:
    foreign_lease(tmp_path, ttl_s=3600, job_id="job-7")
    with Checkpointer(tmp_path, async_mode="sync", job_id="job-7") as ckpt:
        ckpt.save(1, state_at(1))
    assert not (tmp_path / lease.LEASE_NAME).exists()  # released by close


def test_a_holder_whose_lease_was_taken_over_fails_its_next_save(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, async_mode="sync", lease_ttl=0.6) as ckpt:
        ckpt.save(1, state_at(1))
        foreign_lease(tmp_path, ttl_s=0.6)  # another job took over while this one stalled
        deadline = time.monotonic() + 30
        while ckpt._lease is not None and ckpt._lease.problem() is None:
            assert time.monotonic() < deadline, "the renewal thread never noticed"
            time.sleep(0.05)
        with pytest.raises(CheckpointError, match="took over the lease"):
            ckpt.save(2, state_at(2))
    assert json.loads((tmp_path / lease.LEASE_NAME).read_text())["token"] == "other"
    with Checkpointer(tmp_path, async_mode="sync") as reader:
        assert [i.step for i in reader.list()] == [1]


def test_the_lease_on_an_s3_root(s3_bucket: Any) -> None:
    root = s3_bucket.url(f"lease-{uuid.uuid4().hex}")
    options = s3_bucket.storage_options()
    with Checkpointer(root, async_mode="sync", storage_options=options) as first:
        first.save(1, state_at(1))
        with Checkpointer(root, async_mode="sync", storage_options=options) as second:
            with pytest.raises(CheckpointError, match="being written by another job"):
                second.save(2, state_at(2))
            assert loaded_step(second) == (1, 1)  # reading needs no lease
    with Checkpointer(root, async_mode="sync", storage_options=options) as third:
        third.save(2, state_at(2))  # close gave the lease back
        assert [i.step for i in third.list()] == [1, 2]


def test_a_job_that_takes_the_lease_later_saves_into_the_live_timeline(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state_at(step))
    waiting = Checkpointer(tmp_path, async_mode="sync")  # made before the rollback below
    try:
        with Checkpointer(tmp_path, async_mode="sync") as other:
            assert loaded_step(other, 1) == (1, 1)  # a rollback, then this job ends
        waiting.save(2, state_at(22))
        assert loaded_step(waiting) == (2, 22)
    finally:
        waiting.close()
