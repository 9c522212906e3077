"""The root's lease against what another job, a paused holder or a planted file can do.

- A holder paused (SIGSTOP) for longer than its TTL while another job takes the root over,
  saves and exits: on SIGCONT the holder publishes nothing more and its saves fail, and the
  other job's checkpoints stay the newest (no split brain).
- ``LEASE.json`` that is not a lease (garbage, a JSON list, a huge file, wrong types, an
  endless TTL, a directory, a symlink) is a clear :class:`CheckpointError` at once, never a
  wait or a spin; a holder whose file is replaced that way loses its lease.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from streamcache.checkpoint import Checkpointer, CheckpointError, lease

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TTL_S = 1.0

# Job A: saves step 10, then step 20 with a pause point before the commit's lease check
# (the test stops the process there, and lets it go on only after SIGCONT), then tries step
# 30. Prints what happened to each.
_JOB_A = """
import os, sys, time, torch
from streamcache.checkpoint import Checkpointer, CheckpointError, commit
root, at_commit, go = sys.argv[1], sys.argv[2], sys.argv[4]
publish = commit.Committer._publish
def paused_publish(self, job, gathered):
    if job.step == 20:
        open(at_commit, "w").write("ready")
        while not os.path.exists(go):  # the test sends SIGSTOP while this waits
            time.sleep(0.01)
    return publish(self, job, gathered)
commit.Committer._publish = paused_publish
state = {"model": torch.nn.Linear(4, 4)}
ckpt = Checkpointer(root, lease_ttl=float(sys.argv[3]))
for step in (10, 20, 30):
    try:
        ckpt.save(step, state)
        ckpt.wait()
        print(f"step {step} committed", flush=True)
    except CheckpointError as exc:
        print(f"step {step} failed: {exc}", flush=True)
ckpt.close()
"""


def saved(root: Path) -> list[int]:
    with Checkpointer(root, async_mode="sync") as reader:
        return [info.step for info in reader.list() if info.complete]


def test_a_paused_holder_whose_root_was_taken_over_publishes_nothing_more(
    tmp_path: Path,
) -> None:
    root, at_commit, go = tmp_path / "root", tmp_path / "at-commit", tmp_path / "go"
    job_a = subprocess.Popen([sys.executable, "-c", _JOB_A, str(root), str(at_commit),
                              str(TTL_S), str(go)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240  # a loaded machine takes long to import torch
        while not at_commit.exists():
            assert job_a.poll() is None and time.monotonic() < deadline, job_a.communicate()
            time.sleep(0.02)
        os.kill(job_a.pid, signal.SIGSTOP)  # inside step 20's commit, before it publishes
        # job B resumes the root (A's process exists but no longer renews: B takes the lease
        # after A's TTL) and saves steps 11 and 12; its retention leaves A's step-20
        # directory alone (a newer step), so A could still publish it
        with Checkpointer(root, async_mode="sync", lease_ttl=TTL_S) as job_b:
            state = {"model": torch.nn.Linear(4, 4)}
            assert job_b.load(state) == 10
            job_b.save(11, state)
            job_b.save(12, state)
        assert not (root / lease.LEASE_NAME).exists()  # B released it on close
    finally:
        go.touch()  # A goes on with step 20's commit once it runs again
        with contextlib.suppress(ProcessLookupError):
            os.kill(job_a.pid, signal.SIGCONT)
    output, _ = job_a.communicate(timeout=240)
    assert "step 10 committed" in output, output
    assert "step 20 failed" in output and "lost its lease" in output, output
    assert "step 30 failed" in output, output
    assert saved(root) == [10, 11, 12]  # A published nothing after it lost the root
    with Checkpointer(root, async_mode="sync") as reader:
        assert reader.load({"model": torch.nn.Linear(4, 4)}) == 12


# ------------------------------------------------------------------ files that are no lease

def _valid_body(**changes: Any) -> dict[str, Any]:
    body = {"token": "other", "job_id": None, "host": "another-host", "pid": 1,
            "process": "x", "renewals": 1, "ttl_s": 60.0, "time": 0.0}
    body.update(changes)
    return body


def _write(text: str | bytes) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return plant


def _huge(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: costs no disk, would cost 1 GiB of memory to read


def _directory(path: Path) -> None:
    path.mkdir()


def _symlink_to_valid_lease(path: Path) -> None:
    target = path.parent.parent / "elsewhere.json"
    target.write_text(json.dumps(_valid_body()))
    path.symlink_to(target)


def _dangling_symlink(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere")


def _fifo(path: Path) -> None:
    os.mkfifo(path)  # opening it for reading would block forever


PLANTED: dict[str, Callable[[Path], None]] = {
    "garbage": _write(b"\x00\xffnot json at all"),
    "json list": _write("[1, 2, 3]"),
    "json string": _write('"lease"'),
    "empty": _write(""),
    "deep nesting": _write("[" * 100_000 + "]" * 100_000),
    "huge": _huge,
    "token not a string": _write(json.dumps(_valid_body(token=7))),
    "pid a string": _write(json.dumps(_valid_body(pid="1"))),
    "renewals a bool": _write(json.dumps(_valid_body(renewals=True))),
    "ttl a string": _write(json.dumps(_valid_body(ttl_s="60"))),
    "ttl endless": _write(json.dumps(_valid_body(ttl_s=1e300))),
    "ttl negative": _write(json.dumps(_valid_body(ttl_s=-1))),
    "ttl NaN": _write(json.dumps(_valid_body()).replace("60.0", "NaN")),
    "no token": _write(json.dumps({k: v for k, v in _valid_body().items() if k != "token"})),
    "directory": _directory,
    "symlink to a lease": _symlink_to_valid_lease,
    "dangling symlink": _dangling_symlink,
    "fifo": _fifo,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_file_that_is_no_lease_is_a_clear_error_not_a_wait(tmp_path: Path, case: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    PLANTED[case](root / lease.LEASE_NAME)
    started = time.monotonic()
    with Checkpointer(root, async_mode="sync", lease_ttl=TTL_S) as ckpt, pytest.raises(
            CheckpointError, match=r"LEASE\.json is not a checkpoint lease .*delete it"):
        ckpt.save(1, {"model": torch.nn.Linear(2, 2)})
    assert time.monotonic() - started < 10  # refused at once: not a wait of the TTL
    assert saved(root) == []


def test_a_holder_whose_lease_file_is_replaced_by_garbage_loses_it(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, async_mode="sync", lease_ttl=TTL_S) as ckpt:
        model = torch.nn.Linear(2, 2)
        ckpt.save(1, {"model": model})
        (tmp_path / lease.LEASE_NAME).write_text("[]")
        with pytest.raises(CheckpointError, match="lost its lease"):
            ckpt.save(2, {"model": model})
        with pytest.raises(CheckpointError, match="lost its lease"):  # and stays lost
            ckpt.save(3, {"model": model})
    assert saved(tmp_path) == [1]
    assert (tmp_path / lease.LEASE_NAME).read_text() == "[]"  # not removed by close


def test_a_holder_whose_lease_file_vanished_loses_it(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, async_mode="sync", lease_ttl=TTL_S) as ckpt:
        model = torch.nn.Linear(2, 2)
        ckpt.save(1, {"model": model})
        (tmp_path / lease.LEASE_NAME).unlink()  # what a job that took over and left does
        with pytest.raises(CheckpointError, match="disappeared"):
            ckpt.save(2, {"model": model})
    assert saved(tmp_path) == [1]
    assert not (tmp_path / lease.LEASE_NAME).exists()


def test_an_endless_or_invalid_lease_ttl_is_refused(tmp_path: Path) -> None:
    for ttl in (float("inf"), float("nan"), 0.0, 1e12):
        with pytest.raises(CheckpointError, match="lease_ttl"):
            Checkpointer(tmp_path, async_mode="sync", lease_ttl=ttl)
