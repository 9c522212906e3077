"""Hugging Face Accelerate: ``accelerate launch`` on 2 CPU processes (gloo) with a
StreamLoader, stopped after ``save_state`` and resumed with ``load_state``; and the
refusal of a StreamDataset inside a DataLoader that Accelerate prepares, in each of its
modes (dispatching, sharding, ``split_batches``, ``even_batches=False``); and the refusal
of an Accelerator that runs each process of a 2-process job alone (``cpu=True`` forgotten on
a machine without GPUs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from dist import run_ranks
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


def _accelerate_in_a_two_process_group(rank: int, world_size: int, url: str,
                                       cache: str) -> tuple[str, list[int]]:
    """In a 2-process gloo group with CUDA hidden: ``Accelerator()`` (which runs each
    process alone on CPU) is refused when a pass starts; ``Accelerator(cpu=True)`` joins the
    group and the pass reads this rank's half of every global batch."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    alone = Accelerator()
    assert (alone.num_processes, alone.distributed_type) == (1, "NO")
    with StreamLoader(StreamDataset(url, global_batch_size=8, cache_dir=cache)) as loader:
        assert alone.prepare(loader) is loader
        try:
            next(iter(loader))
            refusal = ""
        except ConfigError as exc:
            refusal = str(exc)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    joined = Accelerator(cpu=True)
    assert joined.num_processes == world_size
    with StreamLoader(StreamDataset(url, global_batch_size=8, cache_dir=cache)) as loader:
        ids = [i for batch in joined.prepare(loader) for i in batch["__id__"].tolist()]
    return refusal, ids


def test_an_accelerator_that_runs_each_process_alone_is_refused(
        data: tuple[str, str]) -> None:
    """``Accelerator()`` without ``cpu=True`` on a machine without GPUs, in a job of 2
    processes, is 1 process to Accelerate (no DDP, every process the main one) while the
    loader splits every global batch in 2: two unsynchronized models, unless refused."""
    url, cache = data
    results = run_ranks(_accelerate_in_a_two_process_group, 2, url, cache, timeout_s=240,
                        env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
                        start_method="spawn")  # (variables read when torch is imported)
    for result in results:
        refusal, ids = result.value
        assert "Accelerator(cpu=True)" in refusal, refusal
        assert "1 process" in refusal and "2" in refusal, refusal
        assert len(ids) == 40
    assert sorted(results[0].value[1] + results[1].value[1]) == list(range(80))
