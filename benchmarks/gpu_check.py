"""The GPU feed, checked on a machine with CUDA: one command, a line per check.

Run:  python benchmarks/gpu_check.py [--device cuda|cpu] [--mb 256] [--batches 200]

Checks (each prints ok / FAIL and what it measured):
  pinned-gather   StreamLoader(pin_memory=True): every tensor of a batch is page-locked, and
                  the data tensor lies in a buffer of the gather's pinned pool (gathered
                  straight into pinned memory: no copy after the gather).
  h2d-overlap     each batch copied to the device with non_blocking=True on a side stream
                  while the default stream runs matrix products: host-to-device GB/s of the
                  loader's batches against torch's own pinned-memory copies of the same size
                  (torch.cuda memcpy), and how much of the copy time the compute hid.
  rng-roundtrip   Checkpointer.save, draws, Checkpointer.load: the CUDA (and CPU) generators
                  draw again exactly what they drew after the save.
  dcp-cuda        a model and optimizer on the device saved through DCP (the same save) and
                  loaded into a fresh model: equal, on the device.
Without CUDA (and no --device) it says so and exits 0. ``--device cpu`` runs the same code on
the CPU (pinning is not available there and is reported as skipped): the test suite runs it
that way (tests/test_gpu_check.py). Exit status 1 if a check fails.

Data: 100 KB uint8 samples (--mb MB in all), batch 32, written at the library's defaults into
a temporary folder under benchmarks/out/, read warm.

Last result: no machine with CUDA was available to this project yet; see RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROW = 100_000
BATCH = 32


@dataclass
class Check:
    name: str
    ok: bool | None  # None: skipped
    detail: str


class Device:
    """The few things the checks need from a device, on CUDA or (same code) on the CPU."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cuda = name.startswith("cuda")

    def stream(self) -> Any:
        return torch.cuda.Stream() if self.cuda else None

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the device, copied asynchronously where the device allows."""
        if self.cuda:
            return tensor.to(self.name, non_blocking=True)
        return torch.empty_like(tensor).copy_(tensor, non_blocking=True)

    def timed(self, work: Callable[[], Any]) -> float:
        """Seconds ``work`` takes on the device (CUDA events; wall time on the CPU)."""
        if not self.cuda:
            started = time.perf_counter()
            work()
            return time.perf_counter() - started
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        work()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000


def build(folder: str, mb: int) -> str:
    """A dataset of 100 KB uint8 samples at the library's defaults; returns its URL."""
    import pyarrow as pa

    from streamcache import Field, Schema, ShardWriter
    from streamcache.format.columns import build_column

    schema = Schema([Field.tensor("data", np.uint8, (ROW,))])
    rows = max(BATCH * 2, mb * 1_000_000 // ROW)
    rng = np.random.default_rng(0)
    url = os.path.join(folder, "blobs")
    with ShardWriter(url, schema=schema) as writer:
        for start in range(0, rows, 256):
            block = rng.integers(0, 255, (min(256, rows - start), ROW), dtype=np.uint8)
            writer.write_batch(pa.table({"data": build_column(schema.fields[0], block)}))
    return url


@contextlib.contextmanager
def loader(url: str, folder: str, *, pin: bool) -> Iterator[Any]:
    import warnings

    from streamcache import StreamDataset, StreamLoader

    dataset = StreamDataset(url, batch_size=BATCH, rank=0, world_size=1, seed=1,
                            cache_dir=os.path.join(folder, "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without CUDA: said once, by the check
        made = StreamLoader(dataset, pin_memory=pin, prefetch=4)
    with made:
        yield made


def check_pinned_gather(device: Device, url: str, folder: str) -> Check:
    from streamcache.loading.pinning import pinned_pool

    if not device.cuda:
        return Check("pinned-gather", None, "skipped: page-locked memory needs CUDA")
    pinned_in_place = unpinned = batches = 0
    with loader(url, folder, pin=True) as feed:
        for batch in feed:
            batches += 1
            tensors = [t for t in batch.values() if isinstance(t, torch.Tensor)]
            unpinned += sum(not t.is_pinned() for t in tensors)
            pinned_in_place += _in_pool(batch["data"], pinned_pool())
            if batches == 50:
                break
    ok = unpinned == 0 and pinned_in_place == batches
    return Check("pinned-gather", ok, f"{batches} batches: {unpinned} tensors not pinned, "
                 f"{pinned_in_place} data tensors gathered straight into the pinned pool")


def _in_pool(tensor: torch.Tensor, pool: Any) -> bool:
    pointer = tensor.data_ptr()
    return any(b.ctypes.data <= pointer < b.ctypes.data + b.nbytes for b in pool._buffers)


def check_overlap(device: Device, url: str, folder: str, batches: int) -> Check:
    side = device.stream()
    weights = torch.randn(1024 if device.cuda else 128, 1024 if device.cuda else 128,
                          device=device.name)

    def compute() -> None:
        for _ in range(4):
            torch.mm(weights, weights)

    nbytes = BATCH * ROW
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.cuda)
    memcpy_s = device.timed(lambda: [device.copy(source) for _ in range(20)]) / 20
    compute_s = device.timed(compute)
    copy_s = both_s = 0.0
    moved = 0
    with loader(url, folder, pin=device.cuda) as feed:
        started = time.perf_counter()
        for count, batch in enumerate(feed):
            data = batch["data"]
            copy_s += device.timed(lambda data=data: device.copy(data))

            def overlapped(data: torch.Tensor = data) -> None:
                with device.on(side):
                    device.copy(data)
                compute()

            both_s += device.timed(overlapped)
            moved += data.numel()
            if count + 1 == batches:
                break
        feed_s = time.perf_counter() - started
    count = max(1, count + 1)
    hidden = (copy_s + compute_s * count - both_s) / max(copy_s, 1e-12)
    loader_gbps = moved / copy_s / 1e9
    memcpy_gbps = nbytes / memcpy_s / 1e9
    hidden_text = f"{min(max(hidden, 0.0), 1.0):.0%}" if device.cuda else "n/a (one CPU stream)"
    detail = (f"host-to-device {loader_gbps:.1f} GB/s from the loader's batches, "
              f"{memcpy_gbps:.1f} GB/s torch memcpy of pinned memory "
              f"({loader_gbps / memcpy_gbps:.2f}x); copy hidden behind compute {hidden_text}; "
              f"feed {moved / feed_s / 1e9:.2f} GB/s end to end")
    return Check("h2d-overlap", loader_gbps > 0 and count > 0, detail)


def check_checkpoint(device: Device, folder: str) -> list[Check]:
    """One save and load through DCP (the Checkpointer): a model and optimizer on the
    device, and the generators' states (CUDA's when the device is CUDA)."""
    from streamcache import Checkpointer

    torch.manual_seed(3)
    if device.cuda:
        torch.cuda.manual_seed_all(2)
    model = torch.nn.Linear(256, 256).to(device.name)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device=device.name)).sum().backward()
    optimizer.step()
    fresh = torch.nn.Linear(256, 256).to(device.name)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    checkpointer = Checkpointer(os.path.join(folder, "checkpoints"), async_mode="sync")
    try:
        checkpointer.save(1, {"model": model, "optimizer": optimizer})
        expected = torch.rand(8, device=device.name), torch.rand(8)
        torch.rand(1000, device=device.name)
        torch.rand(1000)
        checkpointer.load({"model": fresh, "optimizer": fresh_optimizer})
        drawn = torch.rand(8, device=device.name), torch.rand(8)
    finally:
        checkpointer.close()
    same_draws = all(torch.equal(a, b) for a, b in zip(drawn, expected, strict=True))
    which = "CUDA and CPU generators" if device.cuda else "CPU generator"
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  fresh.state_dict().values(), strict=True))
    where = {p.device.type for p in fresh.parameters()}
    return [Check("rng-roundtrip", same_draws,
                  f"{which} draw the same after load as after save: {same_draws}"),
            Check("dcp-cuda" if device.cuda else "dcp-cpu",
                  same and where == {torch.device(device.name).type},
                  f"model and optimizer saved and loaded: equal {same}, on {sorted(where)}")]


def run_checks(device: Device, folder: str, mb: int, batches: int) -> list[Check]:
    url = build(folder, mb)
    with loader(url, folder, pin=False) as warm:  # install the shards: the checks read warm
        for _ in warm:
            pass
    return [check_pinned_gather(device, url, folder),
            check_overlap(device, url, folder, batches),
            *check_checkpoint(device, folder)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args(argv)
    name = args.device or ("cuda" if torch.cuda.is_available() else None)
    if name is None:
        print("no CUDA device on this machine: nothing to check here. Run this on a machine "
              "with a GPU (the CPU path of the same code: --device cpu).")
        return 0
    if name == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available")
        return 1
    device = Device(name)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    folder = tempfile.mkdtemp(prefix="gpu-check-", dir=os.path.join(HERE, "out"))
    try:
        checks = run_checks(device, folder, args.mb, args.batches)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    label = torch.cuda.get_device_name() if device.cuda else "CPU"
    print(f"gpu_check on {label} (torch {torch.__version__})")
    for check in checks:
        verdict = "skipped" if check.ok is None else "ok" if check.ok else "FAIL"
        print(f"  {check.name:<14} {verdict:<8} {check.detail}")
    return 0 if all(check.ok is not False for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
