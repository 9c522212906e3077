"""The map-style baselines over the source ``.npy`` (a numpy memmap is their native format):
torchdata's StatefulDataLoader, a plain torch DataLoader, and the raw page-cache limit (a
numpy fancy-index gather of sorted shuffled batches in one process)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
from common import LoaderAdapter, Spec, source_array

_NO_REMOTE = "map-style dataset over a local memmap: no remote store of its own"


class MemmapDataset:
    """Sample ``i`` is row ``i`` of the source memmap, as ``{"id", "data"}``."""

    def __init__(self, data: str) -> None:
        self.data = data
        self.length = len(source_array(data))
        self.array: Any = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        if self.array is None:
            self.array = source_array(self.data)
        return {"id": i, "data": torch.from_numpy(np.array(self.array[i]))}


def build(data: str, array: np.ndarray, out: str) -> None:
    """Nothing to write: the source .npy is read as it is."""


class _TorchLoader(LoaderAdapter):
    """torch's DataLoader, or torchdata's StatefulDataLoader where :attr:`STATEFUL`."""

    STATEFUL = False

    def __init__(self, spec: Spec) -> None:
        import torch

        dataset = MemmapDataset(spec.data)
        options: dict[str, Any] = dict(batch_size=spec.per_rank_batch,
                                       num_workers=spec.workers, drop_last=True)
        if spec.world_size > 1:
            options["sampler"] = torch.utils.data.DistributedSampler(
                dataset, num_replicas=spec.world_size, rank=spec.rank, shuffle=True,
                seed=spec.seed, drop_last=True)
        else:
            options.update(shuffle=True,
                           generator=torch.Generator().manual_seed(spec.seed))
        if self.STATEFUL:
            from torchdata.stateful_dataloader import StatefulDataLoader

            self.loader: Any = StatefulDataLoader(dataset, **options)
        else:
            self.loader = torch.utils.data.DataLoader(dataset, **options)


class _StatefulTorchLoader(_TorchLoader):
    STATEFUL = True


class TorchData:
    NAME = "torchdata"
    CANNOT: ClassVar[dict[str, str]] = {"cold": _NO_REMOTE}
    ELASTIC_NOTE = ("no elastic resume: the state is per rank (samples its sampler yielded) "
                    "and is not resharded; rank 0's state loaded on each of 4 ranks")
    build = staticmethod(build)

    @staticmethod
    def import_library() -> None:
        import torchdata.stateful_dataloader  # noqa: F401

    open_loader = staticmethod(_StatefulTorchLoader.open)


class DataLoader:
    NAME = "dataloader"
    CANNOT: ClassVar[dict[str, str]] = {"cold": _NO_REMOTE,
              "resume": "no state_dict: a restart starts the epoch again",
              "elastic": "no state_dict"}
    build = staticmethod(build)

    @staticmethod
    def open_loader(spec: Spec, state: Any = None, global_batch: int | None = None) -> Any:
        return _TorchLoader(spec)  # no state to resume from (CANNOT)


class _Gather:
    def __init__(self, spec: Spec) -> None:
        self.array = source_array(spec.data)
        self.order = np.random.default_rng(spec.seed).permutation(len(self.array))
        self.batch = spec.per_rank_batch

    def __iter__(self) -> Iterator[np.ndarray]:
        for start in range(0, len(self.order) - self.batch + 1, self.batch):
            ids = np.sort(self.order[start:start + self.batch])
            rows = self.array[ids]  # the copy out of the page cache is what is measured
            yield ids if rows.size else ids  # noqa: RUF034 - rows is read so the copy happens

    def state(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RawLimit:
    NAME = "raw-gather"
    CANNOT: ClassVar[dict[str, str]] = {
        "w2": "one process by definition", "cold": "page-cache limit: local only",
        "resume": "not a loader", "elastic": "not a loader"}
    build = staticmethod(build)

    @staticmethod
    def open_loader(spec: Spec, state: Any = None, global_batch: int | None = None) -> Any:
        return _Gather(spec)
