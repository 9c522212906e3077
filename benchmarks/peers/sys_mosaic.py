"""Mosaic Streaming (mosaicml-streaming): MDSWriter shards, StreamingDataset +
StreamingDataLoader. Ranks come from RANK/WORLD_SIZE/LOCAL_* in the environment, so a
simulated multi-rank run starts one process per rank (see :func:`rank_env`)."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import numpy as np
from common import BUCKET, DATASETS, SHARD_BYTES, LoaderAdapter, Spec, native_dir, s3_key

NAME = "mosaic"
CANNOT: dict[str, str] = {}
RANKS_IN_PROCESSES = True
CANONICAL_NODES = 8  # fixed, so that a resume on another world size keeps the global order


def _import_streaming() -> Any:
    """``import streaming``, which imports torchvision for its vision datasets. The PyPI
    torchvision wheel is a CUDA build that cannot load next to the CPU torch here; this
    benchmark uses no vision dataset, so a failing torchvision is replaced by empty stand-ins
    for the two names streaming imports."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        stub = types.ModuleType("torchvision")
        datasets = types.ModuleType("torchvision.datasets")
        transforms = types.ModuleType("torchvision.transforms")
        functional = types.ModuleType("torchvision.transforms.functional")
        datasets.VisionDataset = type("VisionDataset", (), {})  # type: ignore[attr-defined]
        datasets.CIFAR10 = type("CIFAR10", (), {})  # type: ignore[attr-defined]
        functional.to_tensor = lambda *a, **k: None  # type: ignore[attr-defined]
        stub.datasets, stub.transforms, transforms.functional = datasets, transforms, functional  # type: ignore[attr-defined]
        for module in (stub, datasets, transforms, functional):
            module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
            sys.modules[module.__name__] = module
    import streaming

    return streaming


def import_library() -> None:
    _import_streaming()


def build(data: str, array: np.ndarray, out: str) -> None:
    streaming = _import_streaming()
    shape, dtype, _, _ = DATASETS[data]
    columns = {"id": "int64", "data": f"ndarray:{np.dtype(dtype).name}:{shape[0]}"}
    with streaming.MDSWriter(out=out, columns=columns, compression=None,
                             size_limit=SHARD_BYTES) as writer:
        for i in range(len(array)):
            writer.write({"id": i, "data": np.asarray(array[i])})


def rank_env(spec: Spec) -> dict[str, str]:
    return {"RANK": str(spec.rank), "WORLD_SIZE": str(spec.world_size),
            "LOCAL_RANK": str(spec.rank), "LOCAL_WORLD_SIZE": str(spec.world_size)}


class _Loader(LoaderAdapter):
    def __init__(self, spec: Spec) -> None:
        streaming = _import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        if spec.world_size == 1:
            clean_stale_shared_memory()
        if spec.source == "s3":
            remote, local = f"s3://{BUCKET}/{s3_key(NAME, spec.data)}", spec.cache_dir
        else:
            remote, local = None, native_dir(NAME, spec.data)
        self.dataset = streaming.StreamingDataset(
            remote=remote, local=local, shuffle=True, shuffle_seed=spec.seed,
            batch_size=spec.per_rank_batch, num_canonical_nodes=CANONICAL_NODES)
        self.loader = streaming.StreamingDataLoader(
            self.dataset, batch_size=spec.per_rank_batch, num_workers=spec.workers,
            drop_last=True, persistent_workers=False)


open_loader = _Loader.open
