"""Stream a Parquet dataset written by pandas, without converting it.

    python examples/parquet_stream.py [--workdir DIR]

1. pandas writes a folder of Parquet files (as an existing pipeline would);
2. `streamcache index` reads their footers and writes index.json beside them;
3. a StreamLoader streams one shuffled epoch from them, exactly once, and stops halfway to
   show that its state resumes the rest of the epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

import numpy as np
import pandas as pd

from streamcache import StreamDataset, StreamLoader, build_index


def write_with_pandas(folder: str, files: int = 4, rows: int = 2500) -> None:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for k in range(files):
        ids = np.arange(k * rows, (k + 1) * rows)
        frame = pd.DataFrame({
            "id": ids,
            "text": [f"document {i}" for i in ids],
            "score": rng.random(rows).astype(np.float32),
            "tokens": [rng.integers(0, 1000, int(n)).astype(np.int32)
                       for n in rng.integers(5, 50, rows)],
        })
        frame.to_parquet(os.path.join(folder, f"part-{k:03d}.parquet"), index=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="keep the files here (default: a "
                                                        "temporary folder, removed)")
    args = parser.parse_args(argv)
    with (contextlib.nullcontext(args.workdir) if args.workdir else
          tempfile.TemporaryDirectory(prefix="streamcache-parquet-")) as workdir:
        return run(workdir)


def run(workdir: str) -> int:
    data = os.path.join(workdir, "pandas-parquet")
    write_with_pandas(data)
    index = build_index(data)  # footers only: the files stay as pandas wrote them
    print(f"indexed {len(index.shards)} Parquet files, {index.num_samples} rows, fields "
          f"{[f'{f.name}:{f.kind}' for f in index.schema]}")

    def make_loader() -> StreamLoader:
        dataset = StreamDataset(data, batch_size=256, seed=1, rank=0, world_size=1,
                                cache_dir=os.path.join(workdir, "cache"))
        return StreamLoader(dataset)

    seen: list[int] = []
    with make_loader() as loader:
        for step, batch in enumerate(loader):
            seen.extend(batch["id"].tolist())
            assert batch["id"].tolist() == batch["__id__"].tolist()
            if step == len(loader) // 2:
                state = loader.state_dict()  # save it with the model in a real job
                break
    with make_loader() as resumed:
        resumed.load_state_dict(state)
        for batch in resumed:
            seen.extend(batch["id"].tolist())
        print("first resumed batch's texts:", batch["text"][:2], "... tokens padded to",
              tuple(batch["tokens"].shape))
    expected = index.num_samples // 256 * 256
    assert len(seen) == len(set(seen)) == expected, "every row once (the partial tail dropped)"
    print(f"streamed {len(seen)} rows exactly once across an interruption")
    return 0


if __name__ == "__main__":
    sys.exit(main())
