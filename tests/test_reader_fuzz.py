"""Fuzzed shards: bit flips and truncations of a stored shard (zstd Arrow IPC, as ShardWriter
writes it at the defaults) and of its installed copy (the local layout the reader maps).

Whatever the damage, installing and reading give either rows or one of streamcache's errors
that names the file: never a raw pyarrow error, a crash or a hang. (A flip inside the values
may give other values: that is what the index checksum catches at download; the installed
copy is checked for structure.) The damage is drawn at random; a failure prints how to
replay it (``STREAMCACHE_FUZZ_SEED``).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from seeds import schedule_seed

from streamcache import Field, Schema, ShardWriter
from streamcache.errors import StreamcacheError
from streamcache.format.index import load_index
from streamcache.format.materialize import materialize
from streamcache.format.reader import ShardReader, gather
from streamcache.loading.batching import to_torch

SCHEMA = Schema([Field.tensor("x", np.float32, (3,)), Field.sequence("tokens", np.int32),
                 Field("blob", "bytes"), Field("caption", "str")])
ROWS = 40
CASES = 300  # per form (stored, installed)


def _sample(i: int) -> dict[str, object]:
    return {"x": np.full(3, i, np.float32), "tokens": np.arange(i % 9, dtype=np.int32),
            "blob": bytes([i]) * (i % 6), "caption": "é" * (i % 5)}


@pytest.fixture(scope="module")
def shard_bytes(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """(the stored shard, its installed copy)."""
    root = tmp_path_factory.mktemp("fuzz")
    with ShardWriter(str(root / "ds"), schema=SCHEMA) as writer:
        for i in range(ROWS):
            writer.write(_sample(i))
    index = load_index(str(root / "ds"))
    stored = Path(index.shard_url(0)).read_bytes()
    installed = root / "installed.arrow"
    materialize(stored, "arrow", SCHEMA, str(installed), where="shard 0", expected_rows=ROWS)
    return stored, installed.read_bytes()


def _damaged(data: bytes, chooser: random.Random) -> tuple[bytes, str]:
    """``data`` with a few bits flipped, or cut short; and what was done (for the report)."""
    if chooser.random() < 0.3:
        keep = chooser.randrange(len(data))
        return data[:keep], f"truncated to {keep} bytes"
    damaged = bytearray(data)
    flips = [(chooser.randrange(len(data)), chooser.randrange(8))
             for _ in range(chooser.randint(1, 8))]
    for at, bit in flips:
        damaged[at] ^= 1 << bit
    return bytes(damaged), f"bits flipped (byte, bit): {flips}"


def _read_all(path: str) -> None:
    """What a loader does with an installed shard: map it, gather every row, make tensors."""
    with ShardReader(path, SCHEMA, expected_rows=ROWS) as reader:
        arrays = gather([reader], np.zeros(ROWS, np.int32), np.arange(ROWS, dtype=np.int64),
                        list(SCHEMA))
        to_torch(arrays, {f.name: f for f in SCHEMA})


@pytest.mark.parametrize("form", ["stored", "installed"])
def test_a_damaged_shard_gives_rows_or_a_streamcache_error_naming_it(
        form: str, shard_bytes: tuple[bytes, bytes], tmp_path: Path) -> None:
    stored, installed = shard_bytes
    chooser = random.Random(schedule_seed("STREAMCACHE_FUZZ_SEED"))
    outcomes: dict[str, int] = {}
    for case in range(CASES):
        data, damage = _damaged(stored if form == "stored" else installed, chooser)
        path = str(tmp_path / f"case-{case}.arrow")
        try:
            if form == "stored":
                materialize(data, "arrow", SCHEMA, path, where=f"stored shard {case}",
                            expected_rows=ROWS)
            else:
                Path(path).write_bytes(data)
            _read_all(path)
            outcome = "rows"
        except StreamcacheError as error:
            assert path in str(error) or f"stored shard {case}" in str(error), \
                f"case {case} ({damage}): {error!r} does not name the shard"
            outcome = type(error).__name__
        except Exception as error:  # what this test is for: no error of another family
            pytest.fail(f"case {case} ({damage}): {type(error).__name__}: {error}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(outcomes)
    # the damage was mostly caught, not read through
    assert outcomes.get("ShardCorruptError", 0) > CASES // 2, outcomes
