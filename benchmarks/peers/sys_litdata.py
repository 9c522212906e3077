"""LitData: optimize() chunks, StreamingDataset + StreamingDataLoader. Ranks come from
WORLD_SIZE/GLOBAL_RANK in the environment (when torch.distributed is not initialized), so a
simulated multi-rank run starts one process per rank (see :func:`rank_env`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from common import BUCKET, SHARD_BYTES, LoaderAdapter, Spec, native_dir, s3_key, source_array

NAME = "litdata"
CANNOT: dict[str, str] = {}
RANKS_IN_PROCESSES = True
_SOURCE: dict[str, Any] = {}


def _samples(job: tuple[str, int, int]) -> Iterator[dict[str, Any]]:
    data, start, stop = job
    array = _SOURCE.get(data)
    if array is None:
        array = _SOURCE[data] = source_array(data)
    for i in range(start, stop):
        yield {"id": i, "data": np.asarray(array[i])}


def import_library() -> None:
    from litdata import StreamingDataLoader, StreamingDataset  # noqa: F401


def build(data: str, array: np.ndarray, out: str) -> None:
    from litdata import optimize

    step = max(1, len(array) // 64)
    jobs = [(data, start, min(len(array), start + step)) for start in range(0, len(array), step)]
    optimize(fn=_samples, inputs=jobs, output_dir=out, chunk_bytes=SHARD_BYTES,
             num_workers=2, mode="overwrite", verbose=False)


def rank_env(spec: Spec) -> dict[str, str]:
    return {"WORLD_SIZE": str(spec.world_size), "GLOBAL_RANK": str(spec.rank), "NNODES": "1"}


def _allow_http() -> None:
    """LitData's async chunk downloader (obstore) refuses a plain-http endpoint and has no
    option for it (a real S3 endpoint is https): let it reach the loopback server."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"  # type: ignore[index]


class _Loader(LoaderAdapter):
    def __init__(self, spec: Spec) -> None:
        from litdata import StreamingDataLoader, StreamingDataset

        options: dict[str, Any] = {}
        if spec.source == "s3":
            _allow_http()
            input_dir = f"s3://{BUCKET}/{s3_key(NAME, spec.data)}"
            options.update(cache_dir=spec.cache_dir, storage_options={
                "endpoint_url": spec.endpoint, "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing", "region_name": "us-east-1"})
        else:
            input_dir = native_dir(NAME, spec.data)
        self.dataset = StreamingDataset(input_dir, shuffle=True, drop_last=True, seed=spec.seed,
                                        **options)
        self.loader = StreamingDataLoader(self.dataset, batch_size=spec.per_rank_batch,
                                          num_workers=spec.workers, drop_last=True)


open_loader = _Loader.open
