"""Hugging Face ``datasets.save_to_disk`` folders (Arrow IPC streams) index and stream as they
are, with the real ``datasets`` library."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from streamcache.cli.main import main as cli_main
from streamcache.errors import SchemaError, SourceError
from streamcache.format.convert import convert
from streamcache.format.index import build_index, load_index
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.dataset_reader import DatasetReader
from streamcache.loading.loader import StreamLoader

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


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


_READ_WITHOUT_DATASETS = """
import sys
from streamcache.format.index import build_index
from streamcache.loading.dataset_reader import DatasetReader
folder = sys.argv[1]
index = build_index(folder)
print({f.name: (f.kind, f.dtype, list(f.shape)) for f in index.schema})
with DatasetReader(folder, local_dir=sys.argv[2]) as reader:
    batch = reader.read_batch([2, 0])
    print(batch["grid"].tolist(), [len(b) for b in batch["image"]])
assert "datasets" not in sys.modules
"""


def test_image_and_array_features(tmp_path: Path) -> None:
    png = _png()
    features = datasets.Features({"image": datasets.Image(), "grid": datasets.Array2D(
        shape=(2, 3), dtype="float32"), "id": datasets.Value("int64")})
    grids = [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(3)]
    datasets.Dataset.from_dict({"image": [{"bytes": png, "path": None}] * 3, "grid": grids,
                                "id": [0, 1, 2]}, features=features).save_to_disk(
        str(tmp_path / "saved"))
    index = build_index(str(tmp_path / "saved"))
    kinds = {f.name: (f.kind, f.dtype, f.shape) for f in index.schema}
    assert kinds["image"] == ("bytes", None, ()) and kinds["grid"] == ("tensor", "float32", (2, 3))
    with DatasetReader(str(tmp_path / "saved"), local_dir=str(tmp_path / "c")) as reader:
        row = reader[1]
        assert row["image"] == png and row["grid"].tolist() == grids[1].tolist()
    # a process that never imports datasets sees the array as plain nested lists + metadata
    result = subprocess.run([sys.executable, "-c", _READ_WITHOUT_DATASETS,
                             str(tmp_path / "saved"), str(tmp_path / "c2")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "'grid': ('tensor', 'float32', [2, 3])" in result.stdout
    assert f"{[grids[2].tolist(), grids[0].tolist()]} {[len(png), len(png)]}" in result.stdout


def test_images_by_path_only_are_refused_with_a_reason(tmp_path: Path) -> None:
    # (save_to_disk embeds image files; a stream written by other tools may not)
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array([{"bytes": b"x", "path": None},
                                         {"bytes": None, "path": "/elsewhere/y.png"}], media),
                      "id": pa.array([0, 1], pa.int64())})
    (tmp_path / "data").mkdir()
    with ipc.new_stream(str(tmp_path / "data" / "part.arrow"), table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(SchemaError, match="refers to 1 files by path only; embed their bytes"):
        build_index(str(tmp_path / "data"))  # (refused when indexed, as nulls are)
    assert build_index(str(tmp_path / "data"), fields=["id"]).num_samples == 2


def test_convert_skips_the_json_side_files(tmp_path: Path) -> None:
    folder = str(tmp_path / "saved")
    _hf(25).save_to_disk(folder, num_shards=2)
    report = convert(folder, str(tmp_path / "out"))
    assert report.samples == 25
    with DatasetReader(str(tmp_path / "out"), local_dir=str(tmp_path / "c")) as reader:
        assert sorted(reader.read_batch(np.arange(25))["id"].tolist()) == list(range(25))


def test_a_data_file_linked_out_of_the_folder_is_neither_indexed_nor_served(
        tmp_path: Path, capsys: Any) -> None:
    # #21 item 8: a save_to_disk folder whose data file is a symbolic link to a file
    # elsewhere (another user's data) was indexed and served: the rule checked names only
    folder, elsewhere = tmp_path / "saved", tmp_path / "elsewhere"
    _hf(40).save_to_disk(str(folder), num_shards=2)
    _hf(40).save_to_disk(str(elsewhere), num_shards=2)
    planted = folder / "data-00001-of-00002.arrow"
    planted.unlink()
    planted.symlink_to(elsewhere / "data-00001-of-00002.arrow")
    assert cli_main(["index", str(folder)]) != 0
    assert "is a link to" in capsys.readouterr().err
    with pytest.raises(SourceError, match="outside the folder being indexed"):
        build_index(str(folder))
    # an index made before the link was planted does not follow it either
    planted.unlink()
    os.link(elsewhere / "data-00001-of-00002.arrow", planted)  # (a real file, for now)
    build_index(str(folder))
    planted.unlink()
    planted.symlink_to(elsewhere / "data-00001-of-00002.arrow")
    dataset = StreamDataset(str(folder), batch_size=8, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"))
    from streamcache.errors import IndexFormatError
    with pytest.raises(IndexFormatError, match="outside the dataset's folder"), \
            StreamLoader(dataset) as loader:
        list(loader)


def test_nulls_in_a_saved_dataset_are_refused_when_indexed(tmp_path: Path,
                                                           capsys: Any) -> None:
    # #27: refused at indexing with the column named (they were refused at the first batch)
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"id": [0, 1, 2, 3], "text": ["a", None, "c", "d"]}) \
        .save_to_disk(str(folder), num_shards=2)
    assert cli_main(["index", str(folder)]) != 0
    error = capsys.readouterr().err
    assert "column 'text' holds 1 nulls" in error and "--fields" in error
    assert not (folder / "index.json").exists()
    assert build_index(str(folder), fields=["id"]).num_samples == 4
