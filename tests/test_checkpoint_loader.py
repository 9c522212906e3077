"""The StreamLoader through the Checkpointer: saved once as global state, resumed exactly on
another world size (2 ranks -> 1 and 3), across an epoch boundary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import run_ranks
from helpers.resume import LoaderSubject, check_resume
from loader_helpers import ids_of, make_dataset
from torch.distributed.checkpoint import FileSystemReader

from streamcache.checkpoint import Checkpointer, ModelState, layout
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.loader import StreamLoader

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3 ranks; 200 samples: 16 full steps an epoch
SAVE_AT = 14
MORE = 6  # crosses into the next epoch


def _loader(url: str, cache: str) -> StreamLoader:
    return StreamLoader(StreamDataset(url, global_batch_size=GLOBAL_BATCH, cache_dir=cache,
                                      seed=5, infinite=True))


def _global_ids(batch: dict[str, Any]) -> list[int]:
    ids = ids_of(batch).tolist()
    if not dist.is_initialized():
        return ids
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, ids)
    return [i for part in parts for i in part]


def _save_midway(rank: int, world: int, url: str, cache: str, root: str) -> list[list[int]]:
    loader = _loader(url, cache)
    state = {"train": ModelState(torch.nn.Linear(2, 2)), "loader": loader}
    with Checkpointer(root) as ckpt:
        batches = iter(loader)
        for _ in range(SAVE_AT):
            next(batches)
        ckpt.save(SAVE_AT, state)
        after = [_global_ids(next(batches)) for _ in range(MORE)]
    loader.close()
    return after


def _resume(rank: int, world: int, url: str, cache: str, root: str) -> tuple[int | None,
                                                                            list[list[int]]]:
    loader = _loader(url, cache)
    state = {"train": ModelState(torch.nn.Linear(2, 2)), "loader": loader}
    with Checkpointer(root, async_mode="sync") as ckpt:
        step = ckpt.load(state)
    batches = iter(loader)
    after = [_global_ids(next(batches)) for _ in range(MORE)]
    loader.close()
    return step, after


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_loader_resumes_exactly_on_other_world_sizes(tmp_path: Path) -> None:
    url = make_dataset(str(tmp_path), [37, 50, 13, 60, 40], seq=False)
    cache, root = str(tmp_path / "cache"), str(tmp_path / "ckpt")
    expected = run_ranks(_save_midway, 2, url, cache, root)[0].value
    info = layout.latest(layout.Location(root))
    assert info is not None and info.marker is not None
    # saved once, in global.json, not per rank through DCP
    saved_global = (Path(root) / info.name / layout.GLOBAL_NAME).read_text()
    assert '"loader"' in saved_global and "cursor" in saved_global
    dcp_keys = FileSystemReader(str(Path(root) / info.name)).read_metadata().state_dict_metadata
    assert not [key for key in dcp_keys if key.startswith("loader")]

    step, one_rank = _resume(0, 1, url, cache, root)  # this process: no torch.distributed
    assert step == SAVE_AT and one_rank == expected
    for rank_result in run_ranks(_resume, 3, url, cache, root):
        assert rank_result.value == (SAVE_AT, expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_resume_oracle_through_the_checkpointer(tmp_path: Path) -> None:
    """The shared oracle, with the state saved by a Checkpointer and loaded by another one
    into a fresh loader (resumed at the start, a midpoint, an epoch's end, the next epoch)."""
    url = make_dataset(str(tmp_path), [37, 50, 13, 60, 40], seq=False)
    cache = str(tmp_path / "cache")
    roots = iter(range(100))

    def make() -> LoaderSubject:
        return LoaderSubject(StreamLoader(StreamDataset(url, global_batch_size=20,
                                                        cache_dir=cache, seed=5)))

    def save(subject: Any) -> str:
        root = str(tmp_path / f"ckpt{next(roots)}")
        with Checkpointer(root, async_mode="sync") as ckpt:
            ckpt.save(1, {"loader": subject.loader})
        return root

    def load(subject: Any, root: str) -> None:
        with Checkpointer(root, async_mode="sync") as ckpt:
            assert ckpt.load({"loader": subject.loader}) == 1

    check_resume(make, steps_per_epoch=10, epoch_samples=range(200), save=save, load=load)
