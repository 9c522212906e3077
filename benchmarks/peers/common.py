"""What every system's adapter shares: the two datasets, the spec of one measured run, the
loopback S3 server, and small helpers.

The source of truth for both datasets is a numpy ``.npy`` file per dataset (sample ``i`` is
row ``i``); every system's native copy is written from it, and every system reports the
global sample id of each sample it delivers, so duplicates and skips can be counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(REPO, "benchmarks", "out", "peers")
DATA = os.path.join(OUT, "data")
BUCKET = "peers"
SHARD_BYTES = 16 << 20  # every system writes shards/chunks of about this size

#: name -> (row shape, dtype, per-rank batch size, default number of samples)
DATASETS: dict[str, tuple[tuple[int, ...], Any, int, int]] = {
    "tokens": ((256,), np.int32, 256, 196_608),   # 1 KB samples, ~200 MB
    "blobs": ((100_000,), np.uint8, 32, 2_048),   # 100 KB samples, ~205 MB
}


@dataclasses.dataclass
class Spec:
    """One loader to open: which dataset, where from, and the topology."""

    data: str                      # "tokens" or "blobs"
    source: str = "local"          # "local" (warm page cache) or "s3" (loopback server)
    workers: int = 0
    seed: int = 17
    rank: int = 0
    world_size: int = 1
    batch: int = 0                 # per-rank batch; 0: the dataset's default
    cache_dir: str = ""            # fresh folder for remote runs
    endpoint: str = ""             # loopback S3 endpoint for source="s3"

    @property
    def per_rank_batch(self) -> int:
        return self.batch or DATASETS[self.data][2]

    @property
    def num_samples(self) -> int:
        return num_samples(self.data)


class Loader(Protocol):
    """What an adapter returns: batches as arrays of global sample ids, and a state."""

    def __iter__(self) -> Iterator[np.ndarray]: ...
    def state(self) -> Any: ...
    def close(self) -> None: ...


class LoaderAdapter:
    """The adapter shape every DataLoader-like peer shares: ``__init__(spec)`` sets
    ``self.loader``, whose batches are dicts holding the global sample ids under
    :attr:`ID_KEY`; its state is the loader's ``state_dict``."""

    ID_KEY = "id"
    loader: Any

    def __iter__(self) -> Iterator[np.ndarray]:
        for batch in self.loader:
            yield batch[self.ID_KEY].numpy()

    def state(self) -> Any:
        return self.loader.state_dict()

    def load(self, state: Any) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Drop the library's objects, so that their workers and files are released."""
        vars(self).clear()

    @classmethod
    def open(cls, spec: Spec, state: Any = None,
             global_batch: int | None = None) -> LoaderAdapter:
        """A loader for ``spec`` (per-rank batch ``global_batch // world_size`` if given),
        resumed from ``state`` if given."""
        if global_batch:
            spec.batch = global_batch // spec.world_size
        loader = cls(spec)  # type: ignore[call-arg]
        if state is not None:
            loader.load(state)
        return loader


def use_streamcache_snapshot() -> str:
    """Import streamcache from ``$PEERS_STREAMCACHE_SRC`` (an exported commit with the built
    ``_core`` extension copied in) instead of the editable install, which follows a working
    tree that other engineers edit while this runs. Returns what is measured."""
    src = os.environ.get("PEERS_STREAMCACHE_SRC")
    if not src:
        return "editable install (working tree)"
    sys.meta_path[:] = [finder for finder in sys.meta_path
                        if not type(finder).__module__.startswith("_editable_skbc_streamcache")]
    sys.path.insert(0, src)
    return src


def num_samples(data: str) -> int:
    with open(os.path.join(DATA, f"{data}.n")) as f:
        return int(f.read())


def source_array(data: str) -> np.ndarray:
    return np.load(os.path.join(DATA, f"{data}.npy"), mmap_mode="r")


def native_dir(system: str, data: str) -> str:
    return os.path.join(DATA, system, data)


def s3_key(system: str, data: str) -> str:
    return f"{system}/{data}"


def aws_env(endpoint: str = "") -> dict[str, str]:
    """Dummy credentials for the loopback server (and its endpoint for the peers that read
    it from the environment)."""
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    if endpoint:
        env["S3_ENDPOINT_URL"] = endpoint  # Mosaic Streaming reads this one
    return env


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """fsspec/s3fs options for the loopback server (streamcache)."""
    return {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def generate(data: str, n: int) -> None:
    """Write ``DATA/<data>.npy`` (random content, seeded) and its sample count."""
    shape, dtype, _, _ = DATASETS[data]
    os.makedirs(DATA, exist_ok=True)
    rng = np.random.default_rng(0)
    array = np.lib.format.open_memmap(os.path.join(DATA, f"{data}.npy"), mode="w+",
                                      dtype=dtype, shape=(n, *shape))
    step = max(1, (8 << 20) // array[0].nbytes)
    for start in range(0, n, step):
        stop = min(n, start + step)
        array[start:stop] = rng.integers(0, 255, (stop - start, *shape), dtype=dtype)
    array.flush()
    with open(os.path.join(DATA, f"{data}.n"), "w") as f:
        f.write(str(n))


def fresh_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def warm_page_cache(path: str) -> None:
    """Read every file under ``path`` once, so a warm run finds it in the page cache."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(8 << 20):
                    pass


@contextlib.contextmanager
def timer() -> Iterator[list[float]]:
    box: list[float] = []
    started = time.perf_counter()
    yield box
    box.append(time.perf_counter() - started)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
