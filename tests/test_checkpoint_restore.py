"""Loading is safe against what a writer of the root controls, and judges damage only on proof.

- A crafted checkpoint (a self-consistent marker over a pickle that would run code) is
  refused with a clear error, and the code does not run.
- Transient read errors from an object store (5xx through the fault-injecting proxy in front
  of the moto S3 server) are retried; only proven damage makes ``load`` fall back.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from streamcache.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointUnsafeError,
    layout,
)
from streamcache.format.checksum import checksum_file

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class WritesAFile:
    """Unpickling this calls ``open(path, "w")``: code run by a load, visible on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (str(self.path), "w")


def reseal(directory: Path) -> None:
    """Rewrite the commit marker so it vouches for the files as they are now."""
    marker_path = directory / layout.MARKER_NAME
    marker = layout.Marker.from_json(marker_path.read_bytes(), where=str(marker_path))
    files = {name: layout.FileEntry((directory / name).stat().st_size,
                                    checksum_file(directory / name)) for name in marker.files}
    resealed = layout.Marker(marker.step, marker.time, marker.world_size, files)
    marker_path.write_bytes(resealed.to_json())


def only_checkpoint(root: Path) -> Path:
    (directory,) = [p for p in root.iterdir() if p.name.startswith("step-")]
    return directory


def test_crafted_metadata_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    root, ran = tmp_path / "root", tmp_path / "code-ran"
    with Checkpointer(root, async_mode="sync") as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(2, 2)})
    directory = only_checkpoint(root)
    (directory / layout.DCP_METADATA_NAME).write_bytes(pickle.dumps(WritesAFile(ran)))
    reseal(directory)
    with Checkpointer(root, async_mode="sync") as ckpt:
        assert ckpt.latest() is not None  # the marker is self-consistent
        with pytest.raises(CheckpointUnsafeError,
                           match=r"refusing DCP metadata: io\.open is not part"):
            ckpt.load({"model": torch.nn.Linear(2, 2)})
    assert not ran.exists()


def test_crafted_value_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    root, ran = tmp_path / "root", tmp_path / "code-ran"
    with Checkpointer(root, async_mode="sync") as ckpt:
        # a value whose pickle calls open() when loaded; DCP pickles it as it is
        ckpt.save(1, {"model": torch.nn.Linear(2, 2), "extra": {"v": WritesAFile(ran)}})
    assert not ran.exists()
    with Checkpointer(root, async_mode="sync") as ckpt, pytest.raises(
            CheckpointUnsafeError, match=r"refusing to load the value 'extra\.v'"):
        ckpt.load({"model": torch.nn.Linear(2, 2), "extra": {"v": None}})
    assert not ran.exists()


def test_plain_values_still_load(tmp_path: Path) -> None:
    extra = {"epoch": 3, "name": "run", "ratio": 0.5, "flags": [True, None], "pair": (1, 2),
             "t": torch.arange(3)}
    with Checkpointer(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(1, {"extra": extra})
        loaded: dict[str, Any] = {"extra": {k: None for k in extra}}
        loaded["extra"]["t"] = torch.zeros(3, dtype=torch.int64)
        assert ckpt.load(loaded) == 1
    assert loaded["extra"]["pair"] == (1, 2) and loaded["extra"]["flags"] == [True, None]
    assert torch.equal(loaded["extra"]["t"], torch.arange(3))
    assert {k: v for k, v in loaded["extra"].items() if k != "t"} == {
        k: v for k, v in extra.items() if k != "t"}


# ------------------------------------------------------------------ transient errors


def saved_on_s3(s3_bucket: Any, steps: list[int]) -> tuple[str, dict[int, torch.nn.Module]]:
    root = s3_bucket.url(f"ckpt-{os.getpid()}-{random.randrange(1 << 30)}")
    models = {}
    with Checkpointer(root, storage_options=s3_bucket.storage_options(),
                      async_mode="sync", keep_last=5) as ckpt:
        for step in steps:
            torch.manual_seed(step)
            models[step] = torch.nn.Linear(64, 64)
            ckpt.save(step, {"model": models[step]})
    return root, models


def data_path(s3_bucket: Any, root: str, step: int) -> str:
    """The request path (as the proxy sees it) of ``step``'s DCP data file."""
    names = [key["Key"] for key in s3_bucket.client.list_objects_v2(
        Bucket=s3_bucket.name, Prefix=root.split("/", 3)[3])["Contents"]]
    (name,) = [n for n in names if f"step-{step:010d}" in n and n.endswith(".distcp")]
    return f"/{s3_bucket.name}/{name}"


def test_five_503s_while_verifying_are_retried_not_taken_for_damage(
    s3_bucket: Any, s3_fault_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root, models = saved_on_s3(s3_bucket, [1, 2])
    s3_fault_proxy.faults.script(data_path(s3_bucket, root, 2), ["error"] * 5)
    options = s3_bucket.storage_options(via=s3_fault_proxy.url)
    loaded = torch.nn.Linear(64, 64)
    with caplog.at_level(logging.WARNING, "streamcache.checkpoint"), Checkpointer(
            root, storage_options=options, async_mode="sync") as ckpt:
        assert ckpt.load({"model": loaded}) == 2
    assert s3_fault_proxy.faults.injected["error"] == 5
    assert torch.equal(loaded.weight, models[2].weight)
    assert "transient error" in caplog.text and "refusing" not in caplog.text


def test_503s_while_dcp_reads_the_data_are_retried(s3_bucket: Any,
                                                     s3_fault_proxy: Any) -> None:
    root, models = saved_on_s3(s3_bucket, [1, 2])
    # the verification's read passes; the three reads after it (DCP's) fail
    s3_fault_proxy.faults.script(data_path(s3_bucket, root, 2), [None, "error", "error", "error"])
    options = s3_bucket.storage_options(via=s3_fault_proxy.url)
    loaded = torch.nn.Linear(64, 64)
    with Checkpointer(root, storage_options=options, async_mode="sync") as ckpt:
        assert ckpt.load({"model": loaded}) == 2
    assert s3_fault_proxy.faults.injected["error"] == 3
    assert torch.equal(loaded.weight, models[2].weight)


def test_reads_failing_past_the_retries_raise_instead_of_falling_back(
    s3_bucket: Any, s3_fault_proxy: Any
) -> None:
    root, _ = saved_on_s3(s3_bucket, [1, 2])
    s3_fault_proxy.faults.script(data_path(s3_bucket, root, 2), ["error"] * 100)
    options = s3_bucket.storage_options(via=s3_fault_proxy.url)
    with Checkpointer(root, storage_options=options, async_mode="sync") as ckpt, pytest.raises(
            CheckpointError, match="not known to be damaged"):
        ckpt.load({"model": torch.nn.Linear(64, 64)})


def test_proven_damage_on_s3_falls_back_and_says_why(
    s3_bucket: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root, models = saved_on_s3(s3_bucket, [1, 2])
    key = data_path(s3_bucket, root, 2).split("/", 2)[2]
    body = bytearray(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3_bucket.put(key, bytes(body))
    loaded = torch.nn.Linear(64, 64)
    with caplog.at_level(logging.ERROR, "streamcache.checkpoint"), Checkpointer(
            root, storage_options=s3_bucket.storage_options(), async_mode="sync") as ckpt:
        assert ckpt.load({"model": loaded}) == 1
    assert torch.equal(loaded.weight, models[1].weight)
    assert "is corrupt: checksum" in caplog.text
