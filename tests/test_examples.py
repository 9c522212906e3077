"""The examples a new user runs first keep working (each is also its own check)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _run_or_dump(command: list[str], env: dict[str, str], timeout: float = 240
                 ) -> subprocess.CompletedProcess[str]:
    """Run ``command``; if it has not ended after ``timeout`` s, fail with the Python stacks
    of all its threads (faulthandler on SIGABRT), so that a hang says where it is."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**env, "PYTHONFAULTHANDLER": "1"})
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        pytest.fail(f"{' '.join(command)} did not end in {timeout} s; its stacks:\n{out}\n{err}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.parametrize("script, args", [
    ("demo.py", ["--samples", "20000"]),
    ("parquet_stream.py", []),
    ("image_classification.py", ["--steps", "3"]),
    ("hf_datasets.py", ["--rows", "600"]),
    ("lightning_train.py", []),  # DDP on 2 CPU processes, stopped and resumed mid-epoch
])
def test_example_runs_and_leaves_no_files(script: str, args: list[str]) -> None:
    """Each example works in a temporary folder of its own and removes it (hf_datasets and
    lightning_train left theirs)."""
    # Short: worker processes pass shared memory over a Unix socket made in TMPDIR (a
    # folder deep under tmp_path is too long for one; the loader refuses it).
    temp = Path(tempfile.mkdtemp(prefix="ex-"))
    try:
        result = _run_or_dump([sys.executable, os.path.join(EXAMPLES, script), *args],
                              env={**os.environ, "TMPDIR": str(temp)})
        # (torch's compile cache, made when Lightning imports torch._dynamo, is torch's own)
        leftovers = [str(p) for p in temp.iterdir()
                     if not p.name.startswith(("pymp-", "torchinductor_"))]
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exactly once" in result.stdout or "identically" in result.stdout
    assert leftovers == [], leftovers


def test_train_ddp_without_a_dataset_says_to_prepare_one(tmp_path) -> None:
    script = os.path.join(EXAMPLES, "train_ddp.py")
    result = subprocess.run([sys.executable, script, "--data", str(tmp_path / "data"), "--ckpt",
                             str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=240)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--prepare" in lines[0], result.stderr


@pytest.mark.parametrize("command", [
    [os.path.join(EXAMPLES, "demo.py"), "--samples", "20000"],
    ["-m", "streamcache", "bench", "--demo", "--steps", "5"],
])
def test_demos_leave_no_files_behind(tmp_path, command: list[str]) -> None:
    temp, home = tmp_path / "tmp", tmp_path / "home"
    temp.mkdir()
    home.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "HOME": str(home)}
    env.pop("STREAMCACHE_CACHE_DIR", None)
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True,
                            timeout=240, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert str(temp) in result.stdout + result.stderr  # it says where its files were
    leftovers = [str(p) for p in (*temp.rglob("*"), *home.rglob("*"))]
    assert leftovers == [], leftovers
