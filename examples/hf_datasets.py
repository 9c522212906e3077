"""Stream a Hugging Face ``datasets`` folder (``save_to_disk``) without converting it.

    python examples/hf_datasets.py [--workdir DIR] [--rows N]

1. the ``datasets`` library builds a small dataset in memory and saves it with
   ``save_to_disk`` (Arrow IPC stream files, with ``dataset_info.json`` and ``state.json``);
2. ``streamcache index`` indexes that folder as it is (the stream files are read once to
   count their rows; the JSON side files are left alone);
3. a StreamLoader streams one shuffled epoch from it and checks every row against what
   ``datasets`` itself returns for the same index.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import tempfile

import datasets

from streamcache import StreamDataset, StreamLoader, load_index
from streamcache.cli.main import main as streamcache_cli


def build_dataset(rows: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict({
        "id": list(range(rows)),
        "text": [f"review number {i}" for i in range(rows)],
        "label": [i % 3 for i in range(rows)],
        "input_ids": [[101, *range(i % 17), 102] for i in range(rows)],
    })


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="keep the files here (default: a "
                                                        "temporary folder, removed at the end)")
    parser.add_argument("--rows", type=int, default=3000)
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()
    with (contextlib.nullcontext(args.workdir) if args.workdir else
          tempfile.TemporaryDirectory(prefix="streamcache-hf-")) as workdir:
        return run(workdir, args.rows)


def run(workdir: str, rows: int) -> int:
    folder = os.path.join(workdir, "hf-saved")

    original = build_dataset(rows)
    original.save_to_disk(folder, num_shards=3)
    print("save_to_disk wrote", sorted(os.listdir(folder)))

    if streamcache_cli(["index", folder]) != 0:  # the same as `streamcache index FOLDER`
        return 1
    index = load_index(folder)
    print(f"formats {index.shard_table.formats()}, fields "
          f"{[f'{f.name}:{f.kind}' for f in index.schema]}")

    dataset = StreamDataset(folder, batch_size=128, seed=3, tail="split", rank=0, world_size=1,
                            ragged="offsets", cache_dir=os.path.join(workdir, "cache"))
    seen: list[int] = []
    with StreamLoader(dataset) as loader:
        for batch in loader:
            ids = batch["__id__"].tolist()
            expected = original[ids]  # what datasets itself returns for those rows
            assert batch["id"].tolist() == expected["id"] == ids
            assert batch["label"].tolist() == expected["label"]
            assert batch["text"] == expected["text"]
            offsets = batch["input_ids_offsets"].tolist()
            values = batch["input_ids"].tolist()
            assert [values[a:b] for a, b in itertools.pairwise(offsets)] == expected["input_ids"]
            seen.extend(ids)
    assert sorted(seen) == list(range(rows)), "every row exactly once"
    print(f"streamed {len(seen)} rows exactly once, identical to datasets' own rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
