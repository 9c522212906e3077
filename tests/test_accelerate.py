"""Hugging Face Accelerate: ``accelerate launch`` on 2 CPU processes (gloo) with a
StreamLoader, stopped after ``save_state`` and resumed with ``load_state``; and the
refusal of a StreamDataset inside a DataLoader that Accelerate prepares, in each of its
modes (dispatching, sharding, ``split_batches``, ``even_batches=False``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from loader_helpers import make_dataset
from torch.utils.data import DataLoader

from streamcache import ConfigError, StreamDataset, StreamLoader

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.mark.timeout(600)
def test_accelerate_launch_two_processes_resume_exactly(tmp_path) -> None:
    """examples/accelerate_train.py checks the exactness itself (every sample once per
    epoch, the global batches of one process) and writes what it saw."""
    script = os.path.join(EXAMPLES, "accelerate_train.py")
    (tmp_path / "tmp").mkdir()  # torchrun's own temp folders (torchelastic_*) stay there
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path / "tmp")}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        env.pop(name, None)
    prepare = subprocess.run([sys.executable, script, "--prepare", "--workdir", str(tmp_path)],
                             capture_output=True, text=True, timeout=240, env=env)
    assert prepare.returncode == 0, prepare.stderr
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         script, "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=500, env=env, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "every sample exactly once per epoch" in result.stdout
    with open(tmp_path / "result.json") as f:
        assert json.load(f) == {"processes": 2, "steps": 30, "stopped_at": 20}


@pytest.fixture
def accelerator_factory() -> Iterator[Any]:
    """Accelerators in this process (one process, no launcher); their shared state is
    reset afterwards so that no other test inherits it."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    def make(**config: Any) -> Any:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        dataloader_config = accelerate.DataLoaderConfiguration(**config)
        return accelerate.Accelerator(cpu=True, dataloader_config=dataloader_config)

    yield make
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = str(tmp_path_factory.mktemp("accelerate"))
    return make_dataset(folder, [40, 40], seq=False), folder + "/cache"


@pytest.mark.parametrize(("config", "batch_size"), [
    ({}, None),  # an IterableDataset: Accelerate dispatches from rank 0 by default
    ({"dispatch_batches": False}, None),  # each process iterates it and keeps its shard
    ({"split_batches": True}, 4),  # (Accelerate needs a batch size to split)
    ({"even_batches": False, "dispatch_batches": False}, None),
    ({"dispatch_batches": False}, 4),  # as Trainer(train_dataset=StreamDataset(...)) does
])
def test_a_stream_dataset_inside_a_prepared_dataloader_is_refused(
        accelerator_factory: Any, data: tuple[str, str], config: dict[str, Any],
        batch_size: int | None) -> None:
    url, cache = data
    accelerator = accelerator_factory(**config)
    dataset = StreamDataset(url, global_batch_size=8, rank=0, world_size=1, cache_dir=cache)
    prepared = accelerator.prepare(DataLoader(dataset, batch_size=batch_size))
    with pytest.raises(ConfigError, match=r"Pass StreamLoader\(dataset\) to accelerator"):
        next(iter(prepared))
    dataset.close()


@pytest.mark.parametrize("config", [{}, {"split_batches": True}, {"even_batches": False}])
def test_a_stream_loader_passes_through_prepare_unchanged(
        accelerator_factory: Any, data: tuple[str, str], config: dict[str, Any]) -> None:
    url, cache = data
    accelerator = accelerator_factory(**config)
    with StreamLoader(StreamDataset(url, global_batch_size=8, rank=0, world_size=1,
                                    cache_dir=cache)) as loader:
        assert accelerator.prepare(loader) is loader
        ids = sorted(i for batch in loader for i in batch["__id__"].tolist())
    assert ids == list(range(80))


def test_a_plain_dataloader_over_a_stream_dataset_still_works(data: tuple[str, str]) -> None:
    """Not every wrapping is refused: torch's own DataLoader (batch_size=None) without
    Accelerate reads the dataset as it is."""
    url, cache = data
    dataset = StreamDataset(url, global_batch_size=8, rank=0, world_size=1, cache_dir=cache)
    ids = sorted(i for batch in DataLoader(dataset, batch_size=None)
                 for i in batch["__id__"].tolist())
    assert ids == list(range(80))
    dataset.close()
