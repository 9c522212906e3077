"""One shard's install: the CPU a cold start pays to turn a stored shard into the local layout.

Run:  python benchmarks/bench_install.py [--repeats 10] [--baseline SRC]

The shards (made once under benchmarks/out/install-data with ``ShardWriter`` at its defaults:
zstd, 64 KiB chunks, 64 MB shards):

  tokens   65,536 rows of 256 int32 (1 KB, a fixed-shape tensor), the peers' token data
  seqs     65,536 rows of 64-448 int32 tokens (a variable-length sequence)

(An uncompressed shard already in the local layout is not decoded at all: its download is
renamed into place, cache/install.py; so no case here.)

Each case installs the first shard's bytes (held in memory, as a verified download is) into a
fresh file with ``format.materialize.materialize``, in a fresh child process per repetition
(a process that just started, as a cold start's is: its memory not yet faulted in), and
reports the install's CPU time (``time.process_time``) and wall time; medians over repetitions.
``--baseline SRC`` runs the same children with ``SRC`` first on ``sys.path`` (an export of
another version, see bench_open.py), alternating with this tree's in every repetition, and
prints the ratio of the medians.

Last result (2026-12-06 18:49 UTC, ``--repeats 6``, the 2-core machine otherwise quiet, load
average 0.79 before, 0.99 after; this VM's speed drifts: the same code read 123 / 228 ms an
hour earlier):

  case    code           stored MB  local MB   cpu ms  wall ms
  tokens  this                42.0      67.1    159.2    159.2
  seqs    this                42.2      67.6    262.0    261.9

A variable-length field costs ~1.7x a fixed one: its shard is decoded twice (offsets first,
then values: format/chunk_install.py). Writing the layout with holes where the values go,
instead of zeros that the chunks overwrite, was tried: 141.5 -> 119.2 ms in one process,
and 123.7 against 121.1 ms in fresh processes, 8 repeats alternating with ``--baseline``;
but until 2026-12-06 ``--baseline`` measured this tree twice (the editable install's import
finder comes before ``sys.path``, so the export was never imported; the child now drops
that finder for an export, as bench_open.py's does), so that second comparison says nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "out", "install-data")
OUT = os.path.join(HERE, "out", "bench_install.json")
CASES = ("tokens", "seqs")


def make(case: str) -> str:
    """The dataset folder of ``case`` (written once)."""
    import pyarrow as pa

    from streamcache import Field, Schema, ShardWriter
    from streamcache.format.columns import build_column

    folder = os.path.join(DATA, case)
    if os.path.exists(os.path.join(folder, "index.json")):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(7)
    if case == "tokens":
        schema = Schema([Field.tensor("tokens", "int32", (256,))])
        with ShardWriter(folder, schema=schema) as writer:
            tokens = rng.integers(0, 50_000, size=(65_536, 256), dtype=np.int32)
            for start in range(0, len(tokens), 4096):
                column = build_column(schema["tokens"], tokens[start:start + 4096])
                writer.write_batch(pa.table({"tokens": column}))
        return folder
    with ShardWriter(folder) as writer:  # (the schema inferred: a sequence)
        for _ in range(65_536):
            writer.write({"tokens": rng.integers(0, 50_000, size=int(rng.integers(64, 449)),
                                                 dtype=np.int32)})
    return folder


CHILD = r"""
import json, os, sys, time
if sys.argv[1]:  # another version: the editable install's finder comes before sys.path
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not type(f).__module__.startswith("_editable_skbc_streamcache")]
    sys.path.insert(0, sys.argv[1])
from streamcache import load_index
from streamcache.format.materialize import materialize
folder, out = sys.argv[2], sys.argv[3]
index = load_index(folder)
shard = index.shards[0]
data = open(os.path.join(folder, shard.path), "rb").read()
cpu, wall = time.process_time(), time.perf_counter()
materialize(data, shard.format, index.schema, out, where=shard.path, expected_rows=shard.rows)
print(json.dumps({"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall,
                  "raw_mb": os.path.getsize(out) / 1e6, "stored_mb": len(data) / 1e6}))
"""


def one(source: str, folder: str) -> dict[str, float]:
    scratch = tempfile.mkdtemp(prefix="bench-install-")
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, source, folder,
                              os.path.join(scratch, "shard.arrow")],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--baseline", help="an export of another version to compare against")
    args = parser.parse_args()
    sources = {"this": ""}  # (this tree: the editable install, built extension and all)
    if args.baseline:
        sources["baseline"] = os.path.abspath(args.baseline)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for case in args.cases.split(","):
        folder = make(case)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
        for repeat in range(args.repeats):
            order = list(sources) if repeat % 2 == 0 else list(reversed(sources))
            for name in order:
                runs[name].append(one(sources[name], folder))
        for name, results in runs.items():
            cpu = statistics.median(r["cpu"] for r in results)
            wall = statistics.median(r["wall"] for r in results)
            rows.append((case, name, results[0]["stored_mb"], results[0]["raw_mb"], cpu, wall))
            if name == "baseline":
                base = cpu
                this = statistics.median(r["cpu"] for r in runs["this"])
                rows.append((case, "this/baseline", 0.0, 0.0, this / base, 0.0))
    print(f"{'case':7} {'code':14} {'stored MB':>9} {'local MB':>9} {'cpu ms':>8} {'wall ms':>8}")
    for case, name, stored, raw, cpu, wall in rows:
        if name == "this/baseline":
            print(f"{case:7} {name:14} {'':>9} {'':>9} {cpu:7.2f}x")
        else:
            print(f"{case:7} {name:14} {stored:9.1f} {raw:9.1f} {cpu * 1e3:8.1f} {wall * 1e3:8.1f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.repeats} repeats)")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({"args": vars(args), "rows": [
            {"case": c, "code": n, "stored_mb": st, "local_mb": r, "cpu_s": cpu, "wall_s": w}
            for c, n, st, r, cpu, w in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
