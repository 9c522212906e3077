"""Hugging Face ``datasets.save_to_disk`` folders (Arrow IPC streams) index and stream as they
are, with the real ``datasets`` library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest

from streamcache.cli import main as cli_main
from streamcache.dataset import StreamDataset
from streamcache.dataset_reader import DatasetReader
from streamcache.errors import SourceError
from streamcache.index import build_index, load_index
from streamcache.loader import StreamLoader

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_datasets.py"


@pytest.fixture(autouse=True)
def _quiet() -> None:
    datasets.disable_progress_bars()


def _hf(rows: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict({
        "id": list(range(rows)),
        "text": [f"t{i}" for i in range(rows)],
        "tokens": [list(range(i % 5)) for i in range(rows)],
        "score": [i / 4 for i in range(rows)],
    })


def test_save_to_disk_folder_is_indexed_and_read(tmp_path: Path, capsys: Any) -> None:
    folder = str(tmp_path / "saved")
    original = _hf(50)
    original.save_to_disk(folder, num_shards=3)
    assert cli_main(["index", folder]) == 0
    assert "indexed 3 files, 50 rows" in capsys.readouterr().out
    index = load_index(folder)
    assert [s.path for s in index.shards] == [f"data-0000{k}-of-00003.arrow" for k in range(3)]
    assert {s.format for s in index.shards} == {"arrow_stream"}
    assert [s.bytes for s in index.shards] == [
        os.path.getsize(os.path.join(folder, s.path)) for s in index.shards]
    assert all(s.raw_bytes for s in index.shards)
    kinds = {f.name: f.kind for f in index.schema}
    assert kinds == {"id": "tensor", "text": "str", "tokens": "sequence", "score": "tensor"}
    with DatasetReader(folder, local_dir=str(tmp_path / "c")) as reader:
        for i in (0, 17, 49):
            row = reader[i]
            assert row["id"] == i and row["text"] == f"t{i}" and row["score"] == i / 4
            assert row["tokens"].tolist() == original[i]["tokens"]


def test_streamed_with_the_node_cache_exactly_once(tmp_path: Path) -> None:
    folder = str(tmp_path / "saved")
    _hf(40).save_to_disk(folder, num_shards=2)
    build_index(folder)
    dataset = StreamDataset(folder, batch_size=8, seed=2, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"))
    with StreamLoader(dataset) as loader:
        batches = list(loader)
    ids = np.concatenate([b["id"].numpy() for b in batches])
    assert sorted(ids.tolist()) == list(range(40))
    assert all(b["id"].tolist() == b["__id__"].tolist() for b in batches)


def test_a_dataset_dict_folder_names_its_splits(tmp_path: Path) -> None:
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": _hf(10), "test": _hf(4)}).save_to_disk(str(folder))
    with pytest.raises(SourceError, match=r"DatasetDict \(splits \['test', 'train'\]\): index "
                                          r"one split"):
        build_index(str(folder))
    assert build_index(str(folder / "train")).num_samples == 10


def test_state_json_decides_the_files(tmp_path: Path) -> None:
    folder = tmp_path / "saved"
    _hf(12).save_to_disk(str(folder))
    (folder / "cache-1234.arrow").write_bytes(b"a datasets cache file, not part of the data")
    assert build_index(str(folder)).num_samples == 12
    (folder / "state.json").write_text('{"_data_files": [{"filename": "../x.arrow"}]}')
    with pytest.raises(SourceError, match=r"lists '\.\./x\.arrow', not an Arrow file beside it"):
        build_index(str(folder))


def test_a_stream_file_on_s3(s3_bucket: Any, tmp_path: Path) -> None:
    folder = tmp_path / "saved"
    _hf(30).save_to_disk(str(folder), num_shards=2)
    for name in os.listdir(folder):
        s3_bucket.put(f"hf-stream/{name}", (folder / name).read_bytes())
    options = s3_bucket.storage_options()
    index = build_index(s3_bucket.url("hf-stream"), storage_options=options)
    assert index.num_samples == 30 and len(index.shards) == 2
    with DatasetReader(s3_bucket.url("hf-stream"), local_dir=str(tmp_path / "c"),
                       storage_options=options) as reader:
        assert reader.read_batch(np.arange(30))["id"].tolist() == list(range(30))


def test_example_runs(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLE), "--workdir", str(tmp_path),
                             "--rows", "600"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "streamed 600 rows exactly once, identical to datasets' own rows" in result.stdout
