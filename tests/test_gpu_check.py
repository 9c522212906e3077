"""benchmarks/gpu_check.py: the CPU path of the GPU feed check runs every check's code (the
CUDA-only parts report themselves skipped), and without CUDA the plain command says so and
exits 0."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _gpu_check() -> ModuleType:
    path = os.path.join(HERE, "..", "benchmarks", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_path_runs_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert _gpu_check().main(["--device", "cpu", "--mb", "1", "--batches", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    verdicts = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert verdicts == {"pinned-gather": "skipped", "h2d-overlap": "ok",
                        "rng-roundtrip": "ok", "dcp-cpu": "ok"}, lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA runs the checks")
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert _gpu_check().main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
