"""``streamcache inspect``: what a dataset holds, from its index and a few samples."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..format.index import DatasetIndex, load_index
from ..loading.dataset_reader import DatasetReader
from ..units import plural


def describe(index: DatasetIndex) -> dict[str, Any]:
    """A JSON-able summary: schema, shard count, rows, bytes, compression ratio."""
    raw = [s.raw_bytes for s in index.shards]
    raw_total = sum(r for r in raw if r is not None) if all(r is not None for r in raw) else None
    rows = index.shard_rows
    return {
        "url": index.url,
        "fingerprint": index.fingerprint,
        "fields": index.schema.to_json(),
        "shards": len(index.shards),
        "formats": sorted({s.format for s in index.shards}),
        "compression": sorted({str(s.compression) for s in index.shards}),
        "samples": index.num_samples,
        "rows_per_shard": {"min": int(rows.min()), "max": int(rows.max()),
                           "mean": float(rows.mean())},
        "bytes": index.total_bytes,
        "raw_bytes": raw_total,
        "compression_ratio": (raw_total / index.total_bytes
                              if raw_total and index.total_bytes else None),
        "checksums": sum(1 for s in index.shards if s.checksum),
    }


def preview(value: Any, width: int = 60) -> str:
    """A short, readable rendering of one field value."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes: {value[:12].hex()}{'...' if len(value) > 12 else ''}>"
    if isinstance(value, str):
        return repr(value if len(value) <= width else value[:width] + "...")
    if isinstance(value, np.ndarray):
        flat = value.reshape(-1)
        head = np.array2string(flat[:8], separator=", ", threshold=8)
        more = "..." if flat.size > 8 else ""
        return f"{value.dtype}{list(value.shape)} {head}{more}"
    return repr(value)


def inspect_dataset(url: str, *, samples: int = 3,
                    storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The summary of :func:`describe` plus the first ``samples`` samples, previewed."""
    index = load_index(url, storage_options)
    info = describe(index)
    shown = []
    if samples > 0:
        with tempfile.TemporaryDirectory(prefix="streamcache-inspect-") as tmp, DatasetReader(
            index, local_dir=tmp, storage_options=storage_options
        ) as reader:
            for i in range(min(samples, index.num_samples)):
                shown.append({k: preview(v) for k, v in reader[i].items()})
    info["samples_preview"] = shown
    return info


def format_report(info: Mapping[str, Any]) -> str:
    lines = [
        f"dataset      {info['url']}",
        f"fingerprint  {info['fingerprint']}",
        f"samples      {info['samples']:,}",
        f"shards       {info['shards']} ({', '.join(info['formats'])}; rows per shard "
        f"{info['rows_per_shard']['min']}-{info['rows_per_shard']['max']})",
        f"stored       {info['bytes'] / 1e6:,.2f} MB, compression {', '.join(info['compression'])}",
    ]
    if info["raw_bytes"] is not None:
        lines.append(f"raw          {info['raw_bytes'] / 1e6:,.2f} MB "
                     f"(ratio {info['compression_ratio']:.2f}x)")
    lines.append(f"checksums    {info['checksums']} of {plural(info['shards'], 'shard')}")
    lines.append("fields:")
    for f in info["fields"]:
        detail = f.get("dtype", "")
        if f["kind"] == "tensor":
            detail += str(f["shape"])
        lines.append(f"  {f['name']:<20} {f['kind']:<9} {detail}")
    for i, sample in enumerate(info["samples_preview"]):
        lines.append(f"sample {i}:")
        lines.extend(f"  {name:<20} {text}" for name, text in sample.items())
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="dataset folder or index.json (any fsspec URL)")
    parser.add_argument("--samples", type=int, default=3, help="samples to show (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    info = inspect_dataset(args.url, samples=args.samples)
    print(json.dumps(info, indent=1) if args.json else format_report(info))
    return 0
