"""StreamLoader vs a plain DataLoader and the page-cache gather, over the same local data, warm.

Run:  python benchmarks/bench_loader.py [--repeats 3] [--mb 256] [--data tokens,images]
                                        [--python PYTHON]

Data (built once under benchmarks/out/loader-data, uncompressed local shards read in place;
the baselines read the same bytes from numpy memmaps):
  tokens  1 KB samples: int32[256] token rows                 (--mb MB in all), batch 256
  blobs   100 KB samples: uint8[100000] tensors               (--mb MB in all), batch 32
  images  80-120 KB samples of varying size: a bytes field,
          as encoded images are (values + offsets .npy)       (--mb MB in all), batch 32
  seqs    token                      sequences  written    with      the    writer'sdefaults
          (write({"tokens": row}): a sequence field, zstd, so
          read from the cache's installed copy): 256 int32
          tokens each (values + offsets .npy)                 (--mb MB in all), batch 256
  varseqs the same with 128-384 tokens a row (1 KB on average) (--mb MB in all), batch 256
Cases (each in a fresh process, interleaved, --repeats times; shuffled, one epoch):
  dataloader-wN   torch DataLoader(map-style memmap Dataset, shuffle=True, num_workers=N);
                  for images each sample is its bytes (default_collate keeps the list)
                  for seqs and varseqs each sample is its tokens, padded by pad_sequence
  streamcache-wN  StreamLoader(StreamDataset(...), num_workers=N), every other option at
                  its default (before 2026-12-06: prefetch=4); images as lists of bytes
                  (ragged="padded"), sequences padded; streamcache-offsets-w0: one tensor
                  plus offsets
  gather-limit    one process copies the same shuffled (sorted) batches from the memmap into
                  one reused buffer: the page-cache limit of a per-sample gather (numpy take
                  of [B, 256] rows for tokens and seqs; a concatenation of the rows for
                  images and varseqs)
  tf-*            the same with light_transform per sample (worker processes with w2)
  open            import streamcache (torch already imported), construct, first batch
  resume-0/-90    first batch of an opened loader at 0% / after load_state_dict at 90%
Rates are steady state (first batch to end of epoch); "1st batch s" includes importing
streamcache (0.5-0.7 s of it here). "vs DL-w0": ratio to the DataLoader w0 of the same data
(and transform); "vs limit": to gather-limit of the same data; both from this run.

Last result (2026-12-07 14:48-14:56 UTC, ``--mb 1000 --repeats 3`` at fab7028, nothing else
running, load average 0.24 before, 1.24 after: the benchmark's own processes; medians; the
page-cache gather's rate fell within the run again (tokens 2.20M, 1.49M, 1.18M by repeat);
benchmarks/RESULTS.md has the runs beside it):

  data    case                       samples/s vs DL-w0 vs DL-wN vs limit 1st batch s  RSS MB
  tokens  gather-limit               1,487,763     5.08    5.08     1.00      0.0722    1188
  tokens  dataloader-w0                292,812     1.00    1.00     0.20      0.0523    1227
  tokens  streamcache-w0             1,964,027     6.71    6.71     1.32      0.3815    1261
  tokens  dataloader-w2                165,033     0.56    1.00     0.11      0.0864    1397
  tokens  streamcache-w2             2,075,853     7.09   12.58     1.40      0.3956    1259
  tokens  resume-0                       6,706     0.02    0.02     0.00      0.0233     363
  tokens  resume-90                     10,023     0.03    0.03     0.01      0.0163     365
  tokens  tf-dataloader-w0             175,869     1.00    1.00     0.12      0.0559    1229
  tokens  tf-streamcache-w0            201,170     1.14    1.14     0.14      0.4468    1265
  tokens  tf-dataloader-w2             129,337     0.74    1.00     0.09      0.0918    1399
  tokens  tf-streamcache-w2            195,370     1.11    1.51     0.13      0.4246    1441
  tokens  open                    import 0.363 s, construct 0.0024 s, first batch 0.0234 s
  blobs   gather-limit                  53,212     2.45    2.45     1.00      0.0291    1187
  blobs   dataloader-w0                 21,746     1.00    1.00     0.41      0.0081    1194
  blobs   streamcache-w0                84,939     3.91    3.91     1.60      0.5061    1247
  blobs   dataloader-w2                  8,612     0.40    1.00     0.16      0.0422    1276
  blobs   streamcache-w2                67,293     3.09    7.81     1.26      0.4613    1247
  blobs   resume-0                         317     0.01    0.01     0.01      0.0735     868
  blobs   resume-90                        302     0.01    0.01     0.01      0.0798     910
  images  gather-limit                  82,251     1.03    1.03     1.00      0.0258    1184
  images  dataloader-w0                 79,904     1.00    1.00     0.97      0.0082    1188
  images  streamcache-w0                98,221     1.23    1.23     1.19      0.5003    1251
  images  streamcache-offsets-w0        93,646     1.17    1.17     1.14      0.4325    1252
  images  dataloader-w2                  6,010     0.08    1.00     0.07      0.0526    1080
  images  streamcache-w2                94,578     1.18   15.74     1.15      0.4725    1251
  seqs    gather-limit               1,962,308    12.16   12.16     1.00      0.0756    1188
  seqs    dataloader-w0                161,353     1.00    1.00     0.08      0.0576    1236
  seqs    streamcache-w0             1,691,663    10.48   10.48     0.86      0.3989    1262
  seqs    streamcache-offsets-w0     2,630,852    16.30   16.30     1.34      0.3673    1265
  seqs    streamcache-w2             2,249,675    13.94     nan     1.15      0.3643    1266
  varseqs gather-limit                 653,358     4.20    4.20     1.00      0.1408    1195
  varseqs dataloader-w0                155,387     1.00    1.00     0.24      0.0593    1239
  varseqs streamcache-w0               991,613     6.38    6.38     1.52      0.4010    1278
  varseqs streamcache-offsets-w0     1,728,694    11.13   11.13     2.65      0.4180    1264
  varseqs streamcache-w2             1,186,811     7.64     nan     1.82      0.3754    1277
  jpegs   dataloader-w0                    443     1.00    1.00      nan      0.2122     339
  jpegs   streamcache-w0                   462     1.04    1.04      nan      0.5240     401
  jpegs   dataloader-w2                    806     1.82    1.00      nan      0.2417     487
  jpegs   streamcache-w2                   838     1.89    1.04      nan      0.5315     602
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "out", "loader-data")
CACHE = os.path.join(HERE, "out", "loader-cache")  # the node cache of the streamcache cases
FORMAT = 2  # of the built data: the library's defaults (zstd, 64 MB shards, 64 KB chunks)
JPEG_COUNT = 1024
SHAPES = {"tokens": ((256,), np.int32, 256), "blobs": ((100_000,), np.uint8, 32)}
# images: a bytes field of 80-120 KB per sample (as encoded images are), batch 32
IMAGE_SIZES = (80_000, 120_000)
IMAGE_BATCH = 32
# seqs / varseqs: token sequences as an LLM dataset holds them, written with the writer's
# defaults (``ShardWriter(path).write({"tokens": row})``: a ``sequence`` field, zstd, so the
# warm cache holds the installed copy): every row 256 tokens, or 128-384 (1 KB on average)
SEQ_LENGTHS = {"seqs": (256, 256), "varseqs": (128, 384)}
BATCH = {"tokens": 256, "blobs": 32, "images": IMAGE_BATCH, "jpegs": 32, "seqs": 256,
         "varseqs": 256}
# Epochs a rate is measured over: an epoch of 100 KB samples is 79 steps (about 0.1-0.3 s),
# short beside what a loader starts in the background after its first batch
EPOCHS = {"tokens": 1, "blobs": 4, "images": 4, "jpegs": 1, "seqs": 1, "varseqs": 1}


def build(mb: int) -> None:
    from streamcache import Field, Schema, ShardWriter

    os.makedirs(DATA, exist_ok=True)
    for name, (shape, dtype, _) in SHAPES.items():
        row_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        n = mb * 1_000_000 // row_bytes
        marker = os.path.join(DATA, f"{name}.done")
        if _built(marker, {"n": n, "format": FORMAT}):
            continue
        rng = np.random.default_rng(0)
        array = np.lib.format.open_memmap(os.path.join(DATA, f"{name}.npy"), mode="w+",
                                          dtype=dtype, shape=(n, *shape))
        for start in range(0, n, 4096):
            stop = min(n, start + 4096)
            array[start:stop] = rng.integers(0, 255, (stop - start, *shape), dtype=dtype)
        array.flush()
        schema = Schema([Field.tensor("data", dtype, shape)])
        with ShardWriter(os.path.join(DATA, name), schema=schema, overwrite=True) as writer:
            for start in range(0, n, 4096):
                import pyarrow as pa

                from streamcache.format.columns import build_column

                column = build_column(schema.fields[0], np.asarray(array[start:start + 4096]))
                writer.write_batch(pa.table({"data": column}))
        with open(marker, "w") as f:
            json.dump({"n": n, "format": FORMAT}, f)
    build_images(mb)
    build_jpegs(JPEG_COUNT)
    for name in SEQ_LENGTHS:
        build_sequences(name, mb)


def warm_baselines(data: str) -> None:
    """Read the baselines' .npy files of ``data`` once into the page cache (a fresh build's
    files are not all there: the gather limit, the first case of a repeat, read them from
    disk at a third of its rate in a run of 2026-12-07)."""
    for name in sorted(os.listdir(DATA)):
        if name.endswith(".npy") and name.split(".")[0].split("-")[0] == data:
            with open(os.path.join(DATA, name), "rb") as f:
                while f.read(16 << 20):
                    pass


def _built(marker: str, want: dict[str, Any]) -> bool:
    """Whether ``marker`` says the data was built as ``want`` says."""
    if not os.path.exists(marker):
        return False
    with open(marker) as f:
        return bool(json.load(f) == want)


def build_images(mb: int) -> None:
    """A bytes field of 80-120 KB samples: shards, and values.npy + offsets.npy for the
    baselines."""
    from streamcache import Field, Schema, ShardWriter

    marker = os.path.join(DATA, "images.done")
    if _built(marker, {"mb": mb, "format": FORMAT}):
        return
    rng = np.random.default_rng(1)
    sizes: list[int] = []
    while sum(sizes) < mb * 1_000_000:
        sizes.append(int(rng.integers(IMAGE_SIZES[0], IMAGE_SIZES[1] + 1)))
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    values = np.lib.format.open_memmap(os.path.join(DATA, "images-values.npy"), mode="w+",
                                       dtype=np.uint8, shape=(int(offsets[-1]),))
    schema = Schema([Field("data", "bytes")])
    with ShardWriter(os.path.join(DATA, "images"), schema=schema, overwrite=True) as writer:
        for start in range(0, len(sizes), 256):
            import pyarrow as pa

            rows = []
            for i in range(start, min(len(sizes), start + 256)):
                row = rng.integers(0, 255, sizes[i], dtype=np.uint8)
                values[offsets[i]:offsets[i + 1]] = row
                rows.append(row.tobytes())
            writer.write_batch(pa.table({"data": pa.array(rows, type=pa.large_binary())}))
    values.flush()
    np.save(os.path.join(DATA, "images-offsets.npy"), offsets)
    with open(marker, "w") as f:
        json.dump({"mb": mb, "format": FORMAT}, f)


def build_sequences(name: str, mb: int) -> None:
    """int32 token rows (vocabulary 50,000) of SEQ_LENGTHS[name] tokens, written with the
    writer's defaults, and values.npy + offsets.npy for the baselines."""
    from streamcache import ShardWriter

    marker = os.path.join(DATA, f"{name}.done")
    if _built(marker, {"mb": mb, "format": FORMAT}):
        return
    rng = np.random.default_rng(3)
    low, high = SEQ_LENGTHS[name]
    lengths = rng.integers(low, high + 1, mb * 1_000_000 // (2 * (low + high)))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.lib.format.open_memmap(os.path.join(DATA, f"{name}-values.npy"), mode="w+",
                                       dtype=np.int32, shape=(int(offsets[-1]),))
    with ShardWriter(os.path.join(DATA, name), overwrite=True) as writer:
        for start in range(0, len(lengths), 4096):
            stop = min(len(lengths), start + 4096)
            block = rng.integers(0, 50_000, int(offsets[stop] - offsets[start]),
                                 dtype=np.int32)
            values[offsets[start]:offsets[stop]] = block
            for i in range(start, stop):
                writer.write({"tokens": block[offsets[i] - offsets[start]:
                                              offsets[i + 1] - offsets[start]]})
    values.flush()
    np.save(os.path.join(DATA, f"{name}-offsets.npy"), offsets)
    with open(marker, "w") as f:
        json.dump({"mb": mb, "format": FORMAT}, f)


class SequenceDataset:
    """The baseline for seqs / varseqs: sample i is its tokens, a tensor over a numpy memmap
    (:func:`pad_collate` batches them as a user pads sequences of several lengths)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.offsets = np.load(os.path.join(DATA, f"{name}-offsets.npy"))
        self.values: Any = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Any:
        import torch

        if self.values is None:
            self.values = np.load(os.path.join(DATA, f"{self.name}-values.npy"),
                                  mmap_mode="r")
        return torch.from_numpy(np.array(self.values[self.offsets[i]:self.offsets[i + 1]]))


def pad_collate(rows: list[Any]) -> dict[str, Any]:
    """Sequences of several lengths as ``[B, L]`` padded with 0, plus their lengths (what
    streamcache's ``ragged="padded"`` hands out)."""
    import torch

    return {"tokens": torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
            "tokens_lengths": torch.tensor([len(row) for row in rows])}


def build_jpegs(count: int) -> None:
    """``count`` JPEG photos-alike (Pillow, quality 90, 400-640 x 300-480 pixels, 60-110 KB:
    a smooth random picture with noise) with a label: shards, and values.npy + offsets.npy
    + labels.npy for the DataLoader."""
    import io

    import pyarrow as pa
    from PIL import Image

    from streamcache import Field, Schema, ShardWriter

    marker = os.path.join(DATA, "jpegs.done")
    if _built(marker, {"count": count, "format": FORMAT}):
        return
    rng = np.random.default_rng(2)
    encoded: list[bytes] = []
    for _ in range(count):
        width, height = int(rng.integers(400, 640)), int(rng.integers(300, 480))
        coarse = rng.integers(0, 255, (height // 16, width // 16, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC))
        noisy = smooth.astype(np.int16) + rng.normal(0, 12, smooth.shape).astype(np.int16)
        out = io.BytesIO()
        Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
        encoded.append(out.getvalue())
    labels = rng.integers(0, 1000, count).astype(np.int64)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    np.save(os.path.join(DATA, "jpegs-values.npy"), np.frombuffer(b"".join(encoded), np.uint8))
    np.save(os.path.join(DATA, "jpegs-offsets.npy"), offsets)
    np.save(os.path.join(DATA, "jpegs-labels.npy"), labels)
    schema = Schema([Field("jpeg", "bytes"), Field.tensor("label", np.int64)])
    with ShardWriter(os.path.join(DATA, "jpegs"), schema=schema, overwrite=True) as writer:
        for start in range(0, count, 256):
            stop = min(count, start + 256)
            writer.write_batch(pa.table({
                "jpeg": pa.array(encoded[start:stop], type=pa.large_binary()),
                "label": pa.array(labels[start:stop])}))
    with open(marker, "w") as f:
        json.dump({"count": count, "format": FORMAT}, f)


def image_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """The image pipeline of the img-* cases: decode the JPEG (Pillow), a random resized crop
    to 224 x 224 (area 8-100%, aspect 3/4-4/3, as torchvision's RandomResizedCrop) and a
    random horizontal flip, drawing from torch's global generator as torchvision's
    transforms do; a uint8 CHW tensor. (torchvision from PyPI does not import beside this
    torch, so the same steps are written here with Pillow and numpy.)"""
    import io
    import math

    import torch
    from PIL import Image

    image = Image.open(io.BytesIO(sample["jpeg"])).convert("RGB")
    width, height = image.size
    box = (0, 0, width, height)
    for _ in range(10):
        area = width * height * float(torch.empty(1).uniform_(0.08, 1.0))
        ratio = math.exp(float(torch.empty(1).uniform_(math.log(3 / 4), math.log(4 / 3))))
        crop_w, crop_h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = int(torch.randint(0, height - crop_h + 1, (1,)))
            left = int(torch.randint(0, width - crop_w + 1, (1,)))
            box = (left, top, left + crop_w, top + crop_h)
            break
    image = image.resize((224, 224), Image.BILINEAR, box=box)
    if float(torch.rand(1)) < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)
    return {"image": pixels, "label": int(sample["label"])}


class JpegDataset:
    """The baseline for the image pipeline: sample i is its JPEG bytes (from a numpy memmap)
    and label, through :func:`image_transform`."""

    def __init__(self) -> None:
        self.offsets = np.load(os.path.join(DATA, "jpegs-offsets.npy"))
        self.labels = np.load(os.path.join(DATA, "jpegs-labels.npy"))
        self.values: Any = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.values is None:
            self.values = np.load(os.path.join(DATA, "jpegs-values.npy"), mmap_mode="r")
        jpeg = bytes(self.values[self.offsets[i]:self.offsets[i + 1]])
        return image_transform({"jpeg": jpeg, "label": int(self.labels[i])})


def light_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """The light per-sample Python transform of the tf-* cases (a cast, as a tokenizer's
    output is cast for an embedding lookup)."""
    import torch

    return {"data": torch.from_numpy(sample["data"]).long()}


class ImagesDataset:
    """The baseline for images: sample i is its bytes, read from a numpy memmap."""

    def __init__(self) -> None:
        self.offsets = np.load(os.path.join(DATA, "images-offsets.npy"))
        self.values: Any = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> bytes:
        if self.values is None:
            self.values = np.load(os.path.join(DATA, "images-values.npy"), mmap_mode="r")
        return bytes(self.values[self.offsets[i]:self.offsets[i + 1]])


class MemmapDataset:
    """The baseline: a map-style Dataset over a numpy memmap."""

    def __init__(self, path: str, transform: Any = None) -> None:
        self.path = path
        self.array: Any = None
        self.length = int(np.load(path, mmap_mode="r").shape[0])
        self.transform = transform

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        import torch

        if self.array is None:
            self.array = np.load(self.path, mmap_mode="r")
        if self.transform is not None:
            return self.transform({"data": np.array(self.array[i])})
        return torch.from_numpy(np.array(self.array[i]))


def run_case(case: str, data: str) -> dict[str, Any]:
    import torch

    # One intra-op thread, as in DataLoader workers: on a busy 2-core machine torch's
    # OpenMP threads made default_collate's torch.stack of 32 x 100 KB rows take 10-200 ms,
    # which would flatter streamcache against the num_workers=0 baseline.
    torch.set_num_threads(1)

    batch = BATCH[data]
    started = time.perf_counter()
    samples = 0
    first_batch = None
    extra: dict[str, Any] = {}
    transform = image_transform if data == "jpegs" else \
        light_transform if case.startswith("tf-") else None
    workers = int(case.rsplit("w", 1)[1]) if case[-2:-1] == "w" else 0
    if "dataloader" in case:
        dataset: Any = ImagesDataset() if data == "images" else JpegDataset() \
            if data == "jpegs" else SequenceDataset(data) if data in SEQ_LENGTHS else \
            MemmapDataset(os.path.join(DATA, f"{data}.npy"), transform)
        collate = pad_collate if data in SEQ_LENGTHS else None
        loader: Any = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True,
                                                  num_workers=workers, drop_last=True,
                                                  collate_fn=collate)
        for _ in range(EPOCHS[data]):
            for out in loader:
                first_batch = first_batch or time.perf_counter() - started
                samples += _rows(out)
    elif "streamcache" in case or case == "warm":
        from streamcache import StreamDataset, StreamLoader

        ragged = "offsets" if "-offsets" in case else "padded"
        dataset = StreamDataset(os.path.join(DATA, data), batch_size=batch, rank=0,
                                world_size=1, seed=int(time.time()), transform=transform,
                                ragged=ragged, cache_dir=CACHE)  # type: ignore[arg-type]
        with StreamLoader(dataset, num_workers=workers) as loader:  # the defaults
            for _ in range(EPOCHS[data] if case != "warm" else 1):
                for out in loader:  # (iterating again continues with the next epoch)
                    first_batch = first_batch or time.perf_counter() - started
                    samples += _rows(out)
    elif case == "gather-limit":
        if data == "images" or data == "varseqs":
            offsets = np.load(os.path.join(DATA, f"{data}-offsets.npy"))
            # a plain ndarray over the mapping: np.memmap slices cost microseconds each
            values = np.load(os.path.join(DATA, f"{data}-values.npy"),
                             mmap_mode="r").view(np.ndarray)
            order = np.concatenate([np.random.default_rng().permutation(len(offsets) - 1)
                                    for _ in range(EPOCHS[data])])
            # one output buffer, reused: a fresh one per batch would add a page fault per
            # 4 KB written, which is the allocator's cost, not the page cache's
            out = np.empty(batch * (IMAGE_SIZES[1] if data == "images" else
                                    SEQ_LENGTHS[data][1]), dtype=values.dtype)
            for start in range(0, len(order) - batch + 1, batch):
                ids = np.sort(order[start:start + batch])
                total = int((offsets[ids + 1] - offsets[ids]).sum())
                np.concatenate([values[offsets[i]:offsets[i + 1]] for i in ids], out=out[:total])
                first_batch = first_batch or time.perf_counter() - started
                samples += len(ids)
        else:
            array = np.load(os.path.join(DATA, f"{data}-values.npy" if data == "seqs" else
                                         f"{data}.npy"), mmap_mode="r").view(np.ndarray)
            if data == "seqs":
                array = array.reshape(-1, SEQ_LENGTHS[data][0])
            order = np.concatenate([np.random.default_rng().permutation(len(array))
                                    for _ in range(EPOCHS[data])])
            out = np.empty((batch, *array.shape[1:]), dtype=array.dtype)  # reused, as above
            for start in range(0, len(order) - batch + 1, batch):
                np.take(array, np.sort(order[start:start + batch]), axis=0, out=out)
                first_batch = first_batch or time.perf_counter() - started
                samples += len(out)
    elif case.startswith("resume"):
        from streamcache import StreamDataset, StreamLoader

        dataset = StreamDataset(os.path.join(DATA, data), batch_size=batch, rank=0,
                                world_size=1, seed=5, cache_dir=CACHE)
        loader = StreamLoader(dataset)
        if case == "resume-90":
            state = loader.state_dict()
            state["cursor"]["samples_consumed"] = int(dataset.index.num_samples * 0.9)
            loader.load_state_dict(state)
        started = time.perf_counter()
        out = next(iter(loader))
        first_batch = time.perf_counter() - started
        samples = len(out["__id__"])
        loader.close()
    elif case == "open":
        # torch is imported (above); then: import streamcache, construct, first batch
        import_started = time.perf_counter()
        from streamcache import StreamDataset, StreamLoader

        constructed = time.perf_counter()
        dataset = StreamDataset(os.path.join(DATA, data), batch_size=batch, rank=0,
                                world_size=1, seed=int(time.time()), cache_dir=CACHE)
        loader = StreamLoader(dataset)
        iterated = time.perf_counter()
        out = next(iter(loader))
        first_batch = time.perf_counter() - constructed
        samples = len(out["__id__"])
        extra = {"import_s": constructed - import_started,
                 "construct_s": iterated - constructed,
                 "first_s": time.perf_counter() - iterated}
        loader.close()
    elapsed = time.perf_counter() - started
    steady_case = "dataloader" in case or "streamcache" in case
    # steady state: from the first batch on (start-up is reported as first_batch_s)
    steady = elapsed - (first_batch or 0.0) if steady_case else elapsed
    counted = samples - batch if steady_case else samples
    row_bytes = (sum(IMAGE_SIZES) // 2 if data in ("images", "jpegs") else
                 sum(SEQ_LENGTHS[data]) * 2 if data in SEQ_LENGTHS else
                 int(np.prod(SHAPES[data][0])) * np.dtype(SHAPES[data][1]).itemsize)
    return {"case": case, "data": data, "seconds": elapsed, "samples": samples,
            "samples_per_s": counted / steady, "mb_per_s": counted * row_bytes / 1e6 / steady,
            "first_batch_s": first_batch, "peak_rss_mb": peak_rss_mb(), **extra}


def _rows(batch: Any) -> int:
    """Samples in a batch: its ``__id__`` (streamcache), else its first column or itself."""
    if isinstance(batch, dict):
        return len(batch["__id__"] if "__id__" in batch else next(iter(batch.values())))
    return len(batch)


def peak_rss_mb() -> float:
    """Peak RSS of this process (VmHWM, reset at exec) plus its largest child's."""
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return (hwm_kb + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


CASES = ["gather-limit", "dataloader-w0", "streamcache-w0", "dataloader-w2", "streamcache-w2",
         "resume-0", "resume-90"]
# (data, cases): tf-* run light_transform per sample (worker processes with num_workers=2)
PLAN: list[tuple[str, list[str]]] = [
    ("tokens", [*CASES, "tf-dataloader-w0", "tf-streamcache-w0", "tf-dataloader-w2",
                "tf-streamcache-w2", "open"]),
    ("blobs", CASES),
    ("images", ["gather-limit", "dataloader-w0", "streamcache-w0", "streamcache-offsets-w0",
                "dataloader-w2", "streamcache-w2"]),
    # token sequences written with the writer's defaults, padded or as values + offsets
    ("seqs", ["gather-limit", "dataloader-w0", "streamcache-w0", "streamcache-offsets-w0",
              "streamcache-w2"]),
    ("varseqs", ["gather-limit", "dataloader-w0", "streamcache-w0", "streamcache-offsets-w0",
                 "streamcache-w2"]),
    # JPEG decode, random resized crop, flip: image_transform per sample
    ("jpegs", ["dataloader-w0", "streamcache-w0", "dataloader-w2", "streamcache-w2"]),
]


def table(runs: list[dict[str, Any]]) -> str:
    """Medians per case; ratios to the plain DataLoader (w0, with the same transform) and to
    the page-cache gather of the same run."""
    lines = [f"{'data':<8}{'case':<24}{'samples/s':>12}{'MB/s':>9}{'vs DL-w0':>9}"
             f"{'vs DL-wN':>9}{'vs limit':>9}{'1st batch s':>12}{'peak RSS MB':>12}"]
    for data, cases in PLAN:
        def rate(case: str, data: str = data) -> float:
            rates = [r["samples_per_s"] for r in runs if r["data"] == data and r["case"] == case]
            return statistics.median(rates) if rates else float("nan")

        for case in cases:
            mine = [r for r in runs if r["data"] == data and r["case"] == case]
            if not mine:
                continue
            prefix = "tf-" if case.startswith("tf-") else ""
            workers = case[-2:] if case[-2:-1] == "w" else "w0"
            base = rate(f"{prefix}dataloader-w0")
            same = rate(f"{prefix}dataloader-{workers}")  # the same worker count
            median = statistics.median
            lines.append(
                f"{data:<8}{case:<24}{rate(case):>12,.0f}"
                f"{median(r['mb_per_s'] for r in mine):>9,.0f}{rate(case) / base:>9.2f}"
                f"{rate(case) / same:>9.2f}{rate(case) / rate('gather-limit'):>9.2f}"
                f"{median(r['first_batch_s'] for r in mine):>12.4f}"
                f"{max(r['peak_rss_mb'] for r in mine):>12.0f}")
            if case == "open":
                lines[-1] = (f"{data:<8}{case:<24}import {median(r['import_s'] for r in mine):.3f}"
                             f" s, construct {median(r['construct_s'] for r in mine):.4f} s, "
                             f"first batch {median(r['first_s'] for r in mine):.4f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--case")
    parser.add_argument("--data", help="with --case: its data; else: only these (a,b)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter that runs each case")
    parser.add_argument("--out", default=os.path.join(HERE, "out", "bench_loader.json"))
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.data)))
        return 0
    build(args.mb)
    wanted = set(args.data.split(",")) if args.data else {data for data, _ in PLAN}
    for data in sorted(wanted):  # install the shards in the cache: every case reads warm
        subprocess.run([args.python, __file__, "--case", "warm", "--data", data],
                       capture_output=True, text=True, check=True)
        warm_baselines(data)
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for data, cases in PLAN:
            for case in cases if data in wanted else []:
                result = subprocess.run([args.python, __file__, "--case", case, "--data",
                                         data], capture_output=True, text=True, check=True)
                runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    print(table(runs))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
