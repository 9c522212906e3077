"""streamcache convert / inspect / index, as library functions and as CLI commands."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import zstandard
from fsspec.implementations.local import LocalFileSystem

from streamcache.cli.inspection import inspect_dataset
from streamcache.cli.main import main
from streamcache.errors import EmptyDatasetError, SchemaError, SourceError
from streamcache.format.convert import Progress, convert, detect_format, parse_size
from streamcache.format.index import build_index, load_index
from streamcache.loading.dataset_reader import DatasetReader


def _read_all(url: str) -> list[dict]:
    with DatasetReader(url) as reader:
        return [reader[i] for i in range(len(reader))]


def test_parquet_folder_to_shards(tmp_path) -> None:
    (tmp_path / "src").mkdir()
    for k in range(3):
        ids = np.arange(k * 100, (k + 1) * 100)
        pq.write_table(pa.table({"id": ids, "text": [f"r{i}" for i in ids]}),
                       tmp_path / "src" / f"{k}.parquet", row_group_size=30)
    report = convert(str(tmp_path / "src"), str(tmp_path / "out"), shard_size=1500)
    assert report.samples == 300 and report.shards > 1
    rows = _read_all(str(tmp_path / "out"))
    assert [r["id"] for r in rows] == list(range(300))
    assert rows[123]["text"] == "r123"


def test_arrow_file_and_stream(tmp_path) -> None:
    table = pa.table({"x": pa.array(np.arange(10, dtype=np.int16))})
    with ipc.new_file(tmp_path / "a.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=3)
    with ipc.new_stream(tmp_path / "b.arrows", table.schema) as w:
        w.write_table(table)
    for name in ("a.arrow", "b.arrows"):
        convert(str(tmp_path / name), str(tmp_path / f"out-{name}"))
        assert [r["x"] for r in _read_all(str(tmp_path / f"out-{name}"))] == list(range(10))


@pytest.mark.parametrize("compressed", [False, True])
def test_jsonl(tmp_path, compressed: bool) -> None:
    text = "\n".join(json.dumps({"text": f"t{i}", "tokens": list(range(i % 4)), "score": i / 4})
                     for i in range(50)).encode()
    path = tmp_path / ("d.jsonl.zst" if compressed else "d.jsonl")
    path.write_bytes(zstandard.ZstdCompressor().compress(text) if compressed else text)
    convert(str(path), str(tmp_path / "out"), fields=["text", "tokens"])
    rows = _read_all(str(tmp_path / "out"))
    assert rows[6]["text"] == "t6" and rows[6]["tokens"].tolist() == [0, 1]
    assert "score" not in rows[6]


def test_image_folder(tmp_path) -> None:
    for label, name in enumerate(["cat", "dog"]):
        (tmp_path / "img" / name).mkdir(parents=True)
        for i in range(4):
            (tmp_path / "img" / name / f"{i}.jpg").write_bytes(bytes([label, i]) * 7)
    convert(str(tmp_path / "img"), str(tmp_path / "out"))
    rows = _read_all(str(tmp_path / "out"))
    assert [(r["label"], r["path"]) for r in rows[3:5]] == [(0, "cat/3.jpg"), (1, "dog/0.jpg")]
    assert rows[5]["image"] == bytes([1, 1]) * 7


def test_numpy_arrays(tmp_path) -> None:
    images = np.random.default_rng(0).integers(0, 255, (30, 2, 4, 4), dtype=np.uint8)
    np.savez(tmp_path / "d.npz", image=images, label=np.arange(30))
    convert(str(tmp_path / "d.npz"), str(tmp_path / "out"), shard_size=500)
    rows = _read_all(str(tmp_path / "out"))
    assert all(np.array_equal(rows[i]["image"], images[i]) for i in range(30))
    assert rows[29]["label"] == 29
    np.save(tmp_path / "bad.npy", np.zeros(3))
    np.savez(tmp_path / "mixed.npz", a=np.zeros(3), b=np.zeros(4))
    with pytest.raises(SourceError, match="share their first"):
        convert(str(tmp_path / "mixed.npz"), str(tmp_path / "out2"))


def test_bad_sources(tmp_path) -> None:
    with pytest.raises(SourceError, match="nothing at"):
        convert(str(tmp_path / "missing"), str(tmp_path / "out"))
    (tmp_path / "odd.xyz").write_text("?")
    with pytest.raises(SourceError, match="cannot tell the format"):
        convert(str(tmp_path / "odd.xyz"), str(tmp_path / "out"))
    (tmp_path / "broken.jsonl").write_text('{"a": 1}\n{"a": ')
    with pytest.raises(SourceError, match="cannot read"):
        convert(str(tmp_path / "broken.jsonl"), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "index.json").exists()
    (tmp_path / "nested.jsonl").write_text('{"a": {"b": 1}}\n')
    with pytest.raises(SchemaError, match="column 'a'"):
        convert(str(tmp_path / "nested.jsonl"), str(tmp_path / "out3"))
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "empty.parquet")
    with pytest.raises(EmptyDatasetError):
        convert(str(tmp_path / "empty.parquet"), str(tmp_path / "out4"))


def test_progress_reports_at_most_once_a_second() -> None:
    stream = io.StringIO()
    progress = Progress(stream)
    progress.update(10, 1000)
    progress.update(20, 2000)  # within the same second: not printed
    assert stream.getvalue().count("converting:") == 1
    progress._last -= 2
    progress.update(30, 3000)
    progress.done()
    assert stream.getvalue().count("converting:") == 2 and stream.getvalue().endswith("\n")


def test_parse_size() -> None:
    assert parse_size("64MB") == 64_000_000
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="64MB"):
        parse_size("lots")


def test_inspect(tmp_path) -> None:
    np.savez(tmp_path / "d.npz", x=np.arange(40, dtype=np.float32).reshape(10, 4))
    convert(str(tmp_path / "d.npz"), str(tmp_path / "out"), shard_size=64)
    info = inspect_dataset(str(tmp_path / "out"), samples=2)
    assert info["samples"] == 10 and info["shards"] == 3
    assert info["compression_ratio"] is not None and info["raw_bytes"] == 160
    assert info["samples_preview"][1]["x"].startswith("float32[4] [4., 5., 6., 7.]")


def test_cli_end_to_end(tmp_path, capsys) -> None:
    pq.write_table(pa.table({"v": [1, 2, 3]}), tmp_path / "a.parquet")
    assert main(["index", str(tmp_path)]) == 0
    assert "indexed 1 file, 3 rows" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "a.parquet"), str(tmp_path / "out"), "--quiet"]) == 0
    assert "converted 3 samples" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 3
    assert load_index(str(tmp_path / "out")).num_samples == 3


def test_cli_errors_are_one_line_and_nonzero(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "streamcache", "inspect", str(tmp_path)],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "streamcache inspect: error: no index.json" in (
        result.stderr)
    assert "Traceback" not in result.stderr
    usage = subprocess.run([sys.executable, "-m", "streamcache", "convert"],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_an_indexed_folder_converts_as_its_index_describes(tmp_path) -> None:
    src = tmp_path / "src"
    (src / "part=a").mkdir(parents=True)
    for k in range(2):
        ids = np.arange(k * 50, (k + 1) * 50)
        pq.write_table(pa.table({"id": ids, "text": [f"r{i}" for i in ids],
                                 "extra": ids * 2.0}),
                       src / "part=a" / f"{k}.parquet")
    build_index(str(src), fields=["id", "text"])  # index.json beside the files, 2 fields
    (src / "notes.json").write_text('{"not": "data"}\n')  # a side file the index leaves out
    report = convert(str(src), str(tmp_path / "out"))
    assert report.samples == 100
    assert load_index(str(tmp_path / "out")).schema.names == ["id", "text"]
    assert [r["id"] for r in _read_all(str(tmp_path / "out"))] == list(range(100))
    # the index.json file itself names the same dataset
    convert(str(src / "index.json"), str(tmp_path / "out2"), fields=["id"])
    assert [r["id"] for r in _read_all(str(tmp_path / "out2"))] == list(range(100))
    assert load_index(str(tmp_path / "out2")).schema.names == ["id"]


def test_side_files_are_not_taken_as_data(tmp_path) -> None:
    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"v": [1, 2, 3]}), tmp_path / "src" / "a.parquet")
    (tmp_path / "src" / "_SUCCESS").write_text("")
    assert detect_format(LocalFileSystem(), str(tmp_path / "src")) == "parquet"


def test_cli_converts_a_folder_it_has_indexed(tmp_path, capsys) -> None:
    (tmp_path / "src").mkdir()
    for k in range(2):
        pq.write_table(pa.table({"v": [k * 10 + i for i in range(10)]}),
                       tmp_path / "src" / f"{k}.parquet")
    assert main(["index", str(tmp_path / "src")]) == 0
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--quiet"]) == 0
    assert "converted 20 samples" in capsys.readouterr().out
    assert [r["v"] for r in _read_all(str(tmp_path / "out"))] == list(range(20))
