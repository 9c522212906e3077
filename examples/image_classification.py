"""Image classification with a seeded augmentation that does not depend on who reads.

    python examples/image_classification.py [--workdir DIR] [--steps 30]

1. makes a small ImageFolder (images/CLASS/FILE.png) and converts it to shards;
2. trains a tiny CNN for a few steps with StreamLoader; the transform decodes the PNG and
   draws a random crop and flip from the sample's own seed (``__seed__``);
3. checks that a sample's augmentation is identical whether one rank or two ranks (and
   worker processes) read it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from typing import Any

import numpy as np
import torch
from PIL import Image

from streamcache import StreamDataset, StreamLoader, convert

CLASSES = ("dark", "light")


def make_image_folder(root: str, per_class: int = 200) -> None:
    rng = np.random.default_rng(0)
    for label, name in enumerate(CLASSES):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for i in range(per_class):
            base = 60 + 120 * label
            pixels = np.clip(rng.normal(base, 30, (40, 40, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, name, f"{i:04d}.png"))


def augment(sample: dict[str, Any]) -> dict[str, Any]:
    """Decode, random 32x32 crop and horizontal flip, from the sample's own seed."""
    rng = np.random.default_rng(sample["__seed__"])
    image = np.asarray(Image.open(io.BytesIO(sample["image"])).convert("RGB"))
    top, left = rng.integers(0, image.shape[0] - 32 + 1, 2)
    crop = image[top:top + 32, left:left + 32]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    tensor = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).float() / 255
    return {"image": tensor, "label": sample["label"], "__id__": sample["__id__"]}


def loader_for(url: str, cache: str, rank: int, world: int, workers: int) -> StreamLoader:
    dataset = StreamDataset(url, global_batch_size=32, seed=3, rank=rank, world_size=world,
                            cache_dir=cache, transform=augment)
    return StreamLoader(dataset, num_workers=workers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="keep the files here (default: a "
                                                        "temporary folder, removed)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    with (contextlib.nullcontext(args.workdir) if args.workdir else
          tempfile.TemporaryDirectory(prefix="streamcache-images-")) as workdir:
        return run(workdir, args.steps)


def run(workdir: str, steps: int) -> int:
    images, shards, cache = (os.path.join(workdir, d) for d in ("images", "shards", "cache"))
    make_image_folder(images)
    print(convert(images, shards, overwrite=True).summary())

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(8, len(CLASSES)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    dataset = StreamDataset(shards, global_batch_size=32, seed=3, rank=0, world_size=1,
                            cache_dir=cache, transform=augment, infinite=True)
    with StreamLoader(dataset) as loader:
        for step, batch in enumerate(loader):
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 10 == 0 or step == steps - 1:
                print(f"step {step:3d}  loss {loss.item():.4f}")
            if step == steps - 1:
                break

    def first_step_images(world: int, workers: int) -> dict[int, torch.Tensor]:
        found = {}
        for rank in range(world):
            with loader_for(shards, cache, rank, world, workers) as one:
                batch = next(iter(one))
                found.update(zip(batch["__id__"].tolist(), batch["image"], strict=True))
        return found

    single, split = first_step_images(1, 0), first_step_images(2, 2)
    assert single.keys() == split.keys()
    assert all(torch.equal(single[i], split[i]) for i in single)
    print(f"the {len(single)} samples of the first global batch were augmented identically "
          "by 1 rank and by 2 ranks with 2 worker processes each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
