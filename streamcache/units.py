"""Sizes and counts as people write and read them: one parser for every size a user types.

``parse_size`` reads every size option of the CLI (``--shard-size``, ``--cache-limit``) and
``size_argument`` adapts it to argparse, so ``10KB`` means the same everywhere.
"""

from __future__ import annotations

import argparse
import re

from .errors import UsageError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mib": 1 << 20,
    "g": 10**9, "gb": 10**9, "gib": 1 << 30,
    "t": 10**12, "tb": 10**12, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``"4096"``, ``"10KB"``, ``"64MB"``, ``"512KiB"``, ``"1.5G"``, ``"2TiB"``.

    KB/MB/GB/TB (and K/M/G/T) are powers of 1000, KiB/MiB/GiB/TiB powers of 1024; case does
    not matter.

    Raises:
        UsageError: (a ValueError) the text is not a size; the message shows how to write one.
    """
    match = _SIZE_RE.match(text.lower())
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise UsageError(f"cannot read the size {text!r}; write e.g. 4096, 10KB, 64MB or 1GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def size_argument(text: str) -> int:
    """:func:`parse_size` for ``argparse`` (``type=size_argument``): a bad size is a usage
    error whose message says how to write one."""
    try:
        return parse_size(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def plural(count: int, noun: str, plural_noun: str | None = None) -> str:
    """``"1 shard"``, ``"2 shards"``, ``"1,000 samples"``."""
    word = noun if count == 1 else (plural_noun or noun + "s")
    return f"{count:,} {word}"


def format_number(value: object) -> str:
    """A counter for people: floats with at most 3 decimals (``1.811``), ints as they are."""
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


__all__ = ["format_number", "parse_size", "plural", "size_argument"]
