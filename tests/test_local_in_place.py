"""Local datasets read where they lie (cache/copies.py, format/reader.py): what ShardWriter
writes with ``compression=None`` (chunks of 64 KiB, the other defaults) is memory-mapped and
gathered across its chunks, never copied into the node cache; what is compressed (the
defaults) is decoded once into the cache. A shard changed after indexing is an error, never
another sample."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from loader_helpers import ids_of

from streamcache import ShardWriter, StreamDataset, StreamLoader
from streamcache.errors import StreamcacheError

ROWS, TOKENS = 6000, 64  # 256 B of tokens a row: many 64 KiB chunks a shard


def _write(folder: Path, compression: str | None, shard_size: int | None = 1 << 20) -> str:
    """ShardWriter at its defaults but ``compression`` (and ``shard_size`` unless None)."""
    url = str(folder / f"ds-{compression}-{shard_size}")
    rng = np.random.default_rng(1)
    sizes = {} if shard_size is None else {"shard_size": shard_size}
    with ShardWriter(url, compression=compression, **sizes) as writer:
        for i in range(ROWS):
            writer.write({"x": i, "tokens": rng.integers(0, 1000, TOKENS, dtype=np.int32),
                          "blob": bytes([i % 251]) * (i % 300)})
    return url


def _every_sample_once(seen: list[int]) -> None:
    """One epoch at global batch 64: every sample once but the shuffled tail of ROWS % 64."""
    assert len(seen) == len(set(seen)) == ROWS - ROWS % 64
    assert set(seen) <= set(range(ROWS))


def _cache_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file()]


def _read_epoch(url: str, cache: Path, **options: object) -> list[int]:
    dataset = StreamDataset(url, global_batch_size=64, cache_dir=str(cache), seed=3, **options)
    seen: list[int] = []
    with StreamLoader(dataset) as loader:
        for batch in loader:
            ids = ids_of(batch).tolist()
            assert batch["x"].tolist() == ids  # each row is its own sample
            assert [b[0] if b else i % 251 for i, b in zip(ids, batch["blob"], strict=True)] \
                == [i % 251 for i in ids]
            seen.extend(ids)
    return seen


@pytest.mark.parametrize(("workers", "shard_size"), [(0, None), (2, None), (0, 1 << 20)])
def test_uncompressed_shards_are_read_in_place_and_the_cache_gains_no_shard(
        tmp_path: Path, workers: int, shard_size: int | None) -> None:
    """The writer's defaults with compression=None (one 64 MiB shard of 64 KiB chunks here;
    several small shards too): an epoch read where the shards lie."""
    url = _write(tmp_path, None, shard_size)
    shards = sorted(Path(url).glob("*.arrow"))
    assert len(shards) == 1 if shard_size is None else len(shards) > 1
    cache = tmp_path / "cache"
    dataset = StreamDataset(url, global_batch_size=64, cache_dir=str(cache), seed=3)
    assert all((info.chunk_rows or 0) < info.rows for info in dataset.index.shards)  # chunked
    seen = []
    with StreamLoader(dataset, num_workers=workers) as loader:
        for batch in loader:
            ids = ids_of(batch).tolist()
            assert batch["x"].tolist() == ids
            seen.extend(ids)
    _every_sample_once(seen)
    kept = _cache_files(cache)
    assert not [p for p in kept if p.suffix == ".arrow"], kept
    assert sum(p.stat().st_size for p in kept) < 1 << 20  # bookkeeping only


def test_compressed_shards_are_decoded_once_into_the_cache(tmp_path: Path) -> None:
    url = _write(tmp_path, "zstd")
    cache = tmp_path / "cache"
    first = _read_epoch(url, cache)
    _every_sample_once(first)
    installed = [p for p in _cache_files(cache) if p.suffix == ".arrow"]
    assert len(installed) == len(list(Path(url).glob("*.arrow")))
    assert _read_epoch(url, cache) == first  # the same order from the installed copies


@pytest.mark.parametrize("damage", ["flip", "footer", "truncate"])
def test_a_chunked_shard_changed_after_indexing_is_an_error_never_another_sample(
        tmp_path: Path, damage: str) -> None:
    """A flipped byte in a chunk or in the footer, or a truncated file: an error naming the
    file (a damaged footer raised pyarrow's own error before), never another sample."""
    url = _write(tmp_path, None)
    victim = sorted(Path(url).glob("*.arrow"))[0]
    size = victim.stat().st_size
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:
        if damage in ("flip", "footer"):
            at = size // 2 if damage == "flip" else size - 200
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        else:
            f.truncate(size - 100)
    with pytest.raises(StreamcacheError, match=victim.name):
        _read_epoch(url, tmp_path / "cache")


def test_a_slow_mount_can_be_copied_into_the_cache_instead(tmp_path: Path) -> None:
    """local_data="copy": local uncompressed shards are installed as remote ones are (read
    once from the mount, then from the node cache); the samples are the same."""
    url = _write(tmp_path, None)
    in_place = _read_epoch(url, tmp_path / "in-place")
    copied = _read_epoch(url, tmp_path / "copied", local_data="copy")
    assert copied == in_place
    installed = [p for p in _cache_files(tmp_path / "copied") if p.suffix == ".arrow"]
    assert len(installed) == len(list(Path(url).glob("*.arrow")))


def test_local_data_is_checked(tmp_path: Path) -> None:
    from streamcache.errors import ConfigError

    url = _write(tmp_path, None)
    with pytest.raises(ConfigError, match="local_data must be one of 'in_place', 'copy'"):
        StreamDataset(url, global_batch_size=64, cache_dir=str(tmp_path / "c"),
                      local_data="mmap")  # type: ignore[arg-type]
