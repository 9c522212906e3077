"""``streamcache checkpoints ROOT``: list checkpoints, or verify one fully."""

from __future__ import annotations

import argparse
import datetime

from . import layout
from .errors import CheckpointCorruptError, CheckpointNotFoundError
from .tiers import Location


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="checkpoint root: a local path or an fsspec URL")
    parser.add_argument(
        "--verify",
        metavar="STEP",
        help="verify every file's checksum of STEP's newest complete checkpoint "
        "('latest' for the newest complete one)",
    )


def run(args: argparse.Namespace) -> int:
    """List (or verify) the checkpoints of ``args.root``; 0 on success.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist, or holds no such checkpoint.
        CheckpointCorruptError: the verified checkpoint is damaged.
    """
    root = Location(args.root)
    if not root.exists():
        raise CheckpointNotFoundError(f"{root.url}: no such checkpoint root (nothing there)")
    if args.verify is not None:
        return verify(root, args.verify)
    infos = layout.list_checkpoints(root)
    timelines = layout.read_timelines(root)
    print(f"{'step':>10}  {'time (UTC)':19}  {'size':>10}  {'ranks':>5}  status  name")
    for info in infos:
        when = (datetime.datetime.fromtimestamp(info.time, datetime.timezone.utc)
                .strftime("%Y-%m-%d %H:%M:%S") if info.time else "-")
        size = _human(info.size) if info.size is not None else "-"
        status = f"partial ({info.problem})"
        if info.complete:
            status = ("complete" if layout.in_history(info, timelines)
                      else "complete, abandoned by a rollback (loaded only by its step)")
        print(f"{info.step:>10}  {when:19}  {size:>10}  {info.world_size or '-':>5}  "
              f"{status}  {info.name}")
    newest = next((i for i in reversed(infos)
                   if i.complete and layout.in_history(i, timelines)), None)
    print(f"latest complete: {newest.step if newest else 'none'}")
    return 0


def verify(root: Location, which: str) -> int:
    """Check every file of one checkpoint against its marker; 0 if intact."""
    step = None if which == "latest" else int(which)
    candidates = layout.complete_newest_first(root, step)
    if not candidates:
        raise CheckpointNotFoundError(f"no complete checkpoint {which} under {root.url}")
    info = candidates[0]
    assert info.marker is not None
    location = root.child(info.name)
    for name, entry in sorted(info.marker.files.items()):
        actual = location.checksum(name)
        if actual != entry.checksum:
            raise CheckpointCorruptError(
                f"{info.url}/{name}: checksum {actual}, the commit marker says "
                f"{entry.checksum}; this checkpoint is damaged, load an older step"
            )
    print(f"step {info.step}: {len(info.marker.files)} files, {_human(info.marker.total_bytes)} "
          f"verified ({info.name})")
    return 0


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
