"""The examples a new user runs first keep working (each is also its own check)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.mark.parametrize("script, args", [
    ("demo.py", ["--samples", "20000"]),
    ("parquet_stream.py", []),
    ("image_classification.py", ["--steps", "3"]),
    ("lightning_train.py", []),  # DDP on 2 CPU processes, stopped and resumed mid-epoch
])
def test_example_runs(tmp_path, script: str, args: list[str]) -> None:
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--workdir",
                             str(tmp_path), *args], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exactly once" in result.stdout or "identically" in result.stdout


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
