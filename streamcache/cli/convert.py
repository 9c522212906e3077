"""``streamcache convert``: existing data into streamcache shards (a thin adapter over
:func:`~streamcache.format.convert.convert`)."""

from __future__ import annotations

import argparse
import sys

from ..format.convert import FORMATS, convert
from ..units import size_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="file, folder or glob (any fsspec URL)")
    parser.add_argument("dst", help="destination folder (any fsspec URL)")
    parser.add_argument("--format", choices=FORMATS, help="source format (default: detect)")
    parser.add_argument("--fields", help="comma-separated fields to keep (default: all)")
    parser.add_argument("--shard-size", default="64MB", type=size_argument,
                        help="target uncompressed bytes per shard (default 64MB)")
    parser.add_argument("--compression", default="zstd", choices=["zstd", "lz4", "none"])
    parser.add_argument("--overwrite", action="store_true", help="replace a dataset at DST")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    fields = [f.strip() for f in args.fields.split(",")] if args.fields else None
    report = convert(args.src, args.dst, format=args.format, fields=fields,
                     shard_size=args.shard_size,
                     compression=None if args.compression == "none" else args.compression,
                     overwrite=args.overwrite, progress=None if args.quiet else sys.stderr)
    print(report.summary())
    return 0
