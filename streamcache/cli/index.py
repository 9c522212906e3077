"""``streamcache index``: build index.json for existing Parquet or Arrow IPC files (a thin
adapter over :func:`~streamcache.format.index.build_index`)."""

from __future__ import annotations

import argparse
import time

from ..format.index import build_index
from ..remote import storage
from ..units import plural


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="folder or glob of Parquet / Arrow IPC files (any fsspec URL)")
    parser.add_argument("--fields", help="comma-separated columns to include (default: all)")
    parser.add_argument("--checksum", action="store_true",
                        help="read every file whole to record checksums (default: footers only)")
    parser.add_argument("--output", help="where to write index.json (default: the files' folder)")
    parser.add_argument("--threads", type=int, default=16, help="parallel footer reads")


def run(args: argparse.Namespace) -> int:
    fields = [f.strip() for f in args.fields.split(",")] if args.fields else None
    started = time.perf_counter()
    index = build_index(args.url, fields=fields, checksums=args.checksum, output=args.output,
                        threads=args.threads)
    elapsed = time.perf_counter() - started
    print(f"indexed {plural(len(index.shards), 'file')}, {plural(index.num_samples, 'row')}, "
          f"{index.total_bytes / 1e6:.1f} MB in {elapsed:.2f} s -> {index.url}")
    if any(storage.is_absolute_url(s.path) for s in index.shards):
        print("its files lie outside the index's folder: read it with "
              "allow_external_paths=True (StreamDataset, DatasetReader, load_index)")
    return 0
