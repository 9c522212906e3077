"""WebDataset: tar shards (one ``.bin`` member per sample, the id in ``__key__``), a shard
shuffle plus a 1,000-sample shuffle buffer, batched in the pipeline, WebLoader for workers.
Cold reads stream each tar over HTTP from the loopback S3 server (``pipe:curl``)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from common import BUCKET, DATASETS, SHARD_BYTES, LoaderAdapter, Spec, native_dir, s3_key

NAME = "webdataset"
CANNOT = {
    "resume": "no loader state (no state_dict); a restart starts the epoch again",
    "elastic": "no loader state (no state_dict)",
}
SHUFFLE_BUFFER = 1000


def import_library() -> None:
    import webdataset  # noqa: F401


def build(data: str, array: np.ndarray, out: str) -> None:
    import webdataset as wds

    os.makedirs(out, exist_ok=True)
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=SHARD_BYTES,
                         verbose=0) as writer:
        for i in range(len(array)):
            writer.write({"__key__": f"{i:09d}", "bin": np.asarray(array[i]).tobytes()})


def _decode(data: str) -> Any:
    shape, dtype, _, _ = DATASETS[data]

    def decode(sample: dict[str, Any]) -> tuple[int, np.ndarray]:
        return int(sample["__key__"]), np.frombuffer(sample["bin"], dtype=dtype).reshape(shape)

    return decode


def _collate(samples: list[tuple[int, np.ndarray]]) -> dict[str, Any]:
    import torch

    return {"id": torch.tensor([s[0] for s in samples]),
            "data": torch.from_numpy(np.stack([s[1] for s in samples]))}


def _signed_urls(spec: Spec, names: list[str]) -> list[str]:
    """Presigned GET URLs of the tars on the loopback S3 server (curl has no S3 signing)."""
    import boto3

    client = boto3.client("s3", endpoint_url=spec.endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    return [client.generate_presigned_url(
        "get_object", Params={"Bucket": BUCKET, "Key": f"{s3_key(NAME, spec.data)}/{name}"},
        ExpiresIn=3600) for name in names]


class _Loader(LoaderAdapter):
    def __init__(self, spec: Spec) -> None:
        import webdataset as wds

        folder = native_dir(NAME, spec.data)
        names = sorted(n for n in os.listdir(folder) if n.endswith(".tar"))
        if spec.source == "s3":
            urls = [f"pipe:curl -s -f '{url}'" for url in _signed_urls(spec, names)]
        else:
            urls = [os.path.join(folder, n) for n in names]
        dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=spec.seed,
                                  nodesplitter=wds.split_by_node, empty_check=False)
                   .shuffle(SHUFFLE_BUFFER).map(_decode(spec.data))
                   .batched(spec.per_rank_batch, collation_fn=_collate, partial=False))
        self.loader = wds.WebLoader(dataset, batch_size=None, num_workers=spec.workers)

    def state(self) -> Any:
        raise NotImplementedError(CANNOT["resume"])


def open_loader(spec: Spec, state: Any = None, global_batch: int | None = None) -> _Loader:
    return _Loader(spec)  # no state to resume from (CANNOT)
