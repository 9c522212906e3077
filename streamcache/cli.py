"""The ``streamcache`` command: a thin adapter over typed library functions.

Each subcommand lives in the module of the part it belongs to, which provides
``add_arguments(parser)`` and ``run(args) -> int``. Only the chosen subcommand's module is
imported, so ``streamcache inspect`` does not pay for importing torch. A
:class:`~streamcache.errors.StreamcacheError` prints one line and exits 1; bad usage exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .errors import StreamcacheError

# name -> (module providing add_arguments/run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("streamcache.convert", "convert Parquet/Arrow/JSONL/images/numpy into shards"),
    "index": ("streamcache.index", "build index.json for existing Parquet or Arrow IPC files"),
    "inspect": ("streamcache.inspect", "show a dataset's schema, shards, sizes and samples"),
    "bench": ("streamcache.bench", "stream a dataset and report throughput and waiting"),
    "checkpoints": ("streamcache.checkpoint", "list checkpoints under a root, or verify one"),
    "goodput": ("streamcache.goodput", "checkpoint interval and expected goodput"),
}


def _build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamcache",
        description="Fast, exactly-once, resumable data streaming for PyTorch training.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"streamcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_list if not a.startswith("-")), None)
    parser = _build_parser(chosen if chosen in SUBCOMMANDS else None)
    args = parser.parse_args(args_list)
    try:
        return int(args._run(args))
    except StreamcacheError as exc:
        print(f"streamcache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"streamcache {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
