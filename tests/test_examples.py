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
])
def test_example_runs(tmp_path, script: str, args: list[str]) -> None:
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--workdir",
                             str(tmp_path), *args], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exactly once" in result.stdout or "identically" in result.stdout
