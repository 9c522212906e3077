"""streamcache: ShardWriter (uncompressed Arrow IPC shards), StreamDataset + StreamLoader."""

from __future__ import annotations

from typing import Any

import numpy as np
from common import (
    BUCKET,
    DATASETS,
    SHARD_BYTES,
    LoaderAdapter,
    Spec,
    native_dir,
    s3_key,
    s3_storage_options,
)

NAME = "streamcache"
CANNOT: dict[str, str] = {}  # every case runs


def import_library() -> None:
    from streamcache import StreamDataset, StreamLoader  # noqa: F401  (lazy names: import now)


def build(data: str, array: np.ndarray, out: str) -> None:
    import pyarrow as pa

    from streamcache import Field, Schema, ShardWriter
    from streamcache.format.columns import build_column

    shape, dtype, _, _ = DATASETS[data]
    schema = Schema([Field.tensor("data", dtype, shape)])
    with ShardWriter(out, schema=schema, compression=None, shard_size=SHARD_BYTES,
                     overwrite=True) as writer:
        step = max(1, (4 << 20) // array[0].nbytes)
        for start in range(0, len(array), step):
            column = build_column(schema.fields[0], np.asarray(array[start:start + step]))
            writer.write_batch(pa.table({"data": column}))


class _Loader(LoaderAdapter):
    ID_KEY = "__id__"

    def __init__(self, spec: Spec, global_batch: int | None = None) -> None:
        from streamcache import StreamDataset, StreamLoader

        options: dict[str, Any] = dict(rank=spec.rank, world_size=spec.world_size,
                                       seed=spec.seed, shuffle=True)
        if global_batch:
            options["global_batch_size"] = global_batch
        else:
            options["batch_size"] = spec.per_rank_batch
        if spec.source == "s3":
            url = f"s3://{BUCKET}/{s3_key(NAME, spec.data)}"
            options.update(cache_dir=spec.cache_dir,
                           storage_options=s3_storage_options(spec.endpoint))
        else:
            url = native_dir(NAME, spec.data)
            options["cache_dir"] = spec.cache_dir or None
        self.dataset = StreamDataset(url, **options)
        self.loader = StreamLoader(self.dataset, num_workers=spec.workers, prefetch=4)

    def close(self) -> None:
        self.loader.close()


def open_loader(spec: Spec, state: Any = None, global_batch: int | None = None) -> _Loader:
    loader = _Loader(spec, global_batch)
    if state is not None:
        loader.load(state)
    return loader
