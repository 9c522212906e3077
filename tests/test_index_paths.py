"""Shard paths in an index stay under the dataset's folder: a remote index never names a
local file, ``..`` never climbs out, a symbolic link never leads out (#21 item 8), and files
elsewhere need ``allow_external_paths``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_index_limits import rewrite_index

from streamcache.cli.main import main as cli_main
from streamcache.errors import IndexFormatError, SourceError
from streamcache.format.checksum import checksum_bytes
from streamcache.format.index import build_index, load_index
from streamcache.format.writer import write_dataset
from streamcache.loading.dataset import StreamDataset
from streamcache.loading.dataset_reader import DatasetReader
from streamcache.loading.loader import StreamLoader

SECRET = 7_000_000  # the local file's samples: a remote index must never serve them


def _write(dst: str, start: int, **options: Any) -> None:
    write_dataset(({"x": np.int64(start + i)} for i in range(20)), dst, shard_size=50,
                  compression=None, **options)


@pytest.fixture
def local_secret(tmp_path: Path) -> dict[str, Any]:
    """A local dataset whose first shard a hostile index points at (its entry, full path)."""
    folder = str(tmp_path / "secret")
    _write(folder, SECRET)
    entry = json.loads(Path(folder, "index.json").read_text())["shards"][0]
    entry["path"] = os.path.join(folder, entry["path"])
    return entry


def _point_first_shard(path: str, entry: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def edit(obj: dict[str, Any]) -> None:
        obj["shards"][0] = dict(entry, path=path)
    return edit


def _rewrite_s3_index(bucket: Any, key: str, edit: Callable[[dict[str, Any]], None]) -> None:
    body = bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read()
    obj = json.loads(body)
    edit(obj)
    content = {"version": 1, "schema": obj["schema"],
               "shards": [[s["path"], s["format"], s["rows"], s["bytes"], s["checksum"]]
                          for s in obj["shards"]]}
    obj["fingerprint"] = checksum_bytes(json.dumps(content, sort_keys=True).encode())
    bucket.put(key, json.dumps(obj).encode())


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_remote_index_never_names_a_local_file(s3_bucket: Any, local_secret: dict[str, Any],
                                                 tmp_path: Path, scheme: str) -> None:
    options = s3_bucket.storage_options()
    url = s3_bucket.url(f"index-paths/{scheme.strip(':/') or 'plain'}")
    _write(url, 0, storage_options=options)
    local = scheme + local_secret["path"]
    _rewrite_s3_index(s3_bucket, url.split("/", 3)[3] + "/index.json",
                      _point_first_shard(local, local_secret))
    with pytest.raises(IndexFormatError, match=rf"shard path '{local}' is outside the "
                                               r"dataset's folder .*allow_external_paths=True"):
        load_index(url, options)
    with pytest.raises(IndexFormatError, match=r"is on file://, the index on s3://"):
        load_index(url, options, allow_external_paths=True)
    with pytest.raises(IndexFormatError, match="is on file://"):
        DatasetReader(url, storage_options=options, local_dir=str(tmp_path / "c"),
                      allow_external_paths=True)
    with pytest.raises(IndexFormatError, match="is on file://"):
        StreamDataset(url, batch_size=4, storage_options=options, allow_external_paths=True,
                      cache_dir=str(tmp_path / "cache"), rank=0, world_size=1)


def test_a_remote_index_may_name_its_own_store_only_when_allowed(s3_bucket: Any,
                                                                  tmp_path: Path) -> None:
    options = s3_bucket.storage_options()
    elsewhere, url = s3_bucket.url("index-paths/other"), s3_bucket.url("index-paths/main")
    _write(elsewhere, SECRET, storage_options=options)
    _write(url, 0, storage_options=options)
    other = load_index(elsewhere, options).shards[0]
    entry = dict(other.to_json(), path=f"{elsewhere}/{other.path}")
    _rewrite_s3_index(s3_bucket, "index-paths/main/index.json",
                      _point_first_shard(entry["path"], entry))
    with pytest.raises(IndexFormatError, match="allow_external_paths=True"):
        load_index(url, options)
    with DatasetReader(url, storage_options=options, local_dir=str(tmp_path / "c"),
                       allow_external_paths=True) as reader:
        assert reader[0]["x"] == SECRET


@pytest.mark.parametrize("path", ["../secret/x.arrow", "a/../../secret/x.arrow", ".."])
def test_dotdot_never_leaves_the_folder(tmp_path: Path, local_secret: dict[str, Any],
                                        path: str) -> None:
    folder = str(tmp_path / "ds")
    _write(folder, 0)
    rewrite_index(folder, _point_first_shard(path, local_secret))
    for allowed in (False, True):
        with pytest.raises(IndexFormatError, match=r"leaves the dataset's folder with '\.\.'"):
            load_index(folder, allow_external_paths=allowed)


def test_local_files_elsewhere_need_the_option(tmp_path: Path,
                                               local_secret: dict[str, Any]) -> None:
    folder = str(tmp_path / "ds")
    _write(folder, 0)
    rewrite_index(folder, _point_first_shard(local_secret["path"], local_secret))
    with pytest.raises(IndexFormatError, match="allow_external_paths=True"):
        DatasetReader(folder, local_dir=str(tmp_path / "c"))
    with pytest.raises(IndexFormatError, match="allow_external_paths=True"):
        StreamDataset(folder, batch_size=4, cache_dir=str(tmp_path / "cache"), rank=0,
                      world_size=1)
    dataset = StreamDataset(folder, batch_size=4, shuffle=False, allow_external_paths=True,
                            cache_dir=str(tmp_path / "cache"), rank=0, world_size=1)
    with StreamLoader(dataset) as loader:
        values = [x for batch in loader for x in batch["x"].tolist()]
    assert values[:1] == [SECRET] and len(values) == 20


def test_paths_that_stay_inside_need_no_option(tmp_path: Path) -> None:
    folder = str(tmp_path / "ds")
    _write(folder, 0)
    names = [s.path for s in load_index(folder).shards]
    os.makedirs(os.path.join(folder, "sub"))

    def edit(obj: dict[str, Any]) -> None:
        obj["shards"][0]["path"] = os.path.join(folder, names[0])  # absolute, inside
        obj["shards"][1]["path"] = "file://" + os.path.join(folder, names[1])
        obj["shards"][2]["path"] = f"sub/../{names[2]}"
    rewrite_index(folder, edit)
    with DatasetReader(folder, local_dir=str(tmp_path / "c")) as reader:
        assert reader.read_batch(np.arange(20))["x"].tolist() == list(range(20))


def test_an_index_is_not_written_where_it_could_not_name_its_files(tmp_path: Path,
                                                                   capsys: Any) -> None:
    folder = str(tmp_path / "ds")
    _write(folder, 0)
    os.remove(os.path.join(folder, "index.json"))
    with pytest.raises(SourceError, match=r"could not name files on file://"):
        build_index(folder, output="memory://index-paths/elsewhere")
    assert cli_main(["index", folder, "--output", str(tmp_path / "idx")]) == 0
    assert "read it with allow_external_paths=True" in capsys.readouterr().out
    assert load_index(str(tmp_path / "idx"), allow_external_paths=True).num_samples == 20


# ---------------------------------------------------------------- links out of the folder


def test_a_shard_that_links_out_of_the_folder_is_not_served(tmp_path: Path,
                                                            local_secret: dict[str, Any]
                                                            ) -> None:
    # Uncompressed local shards are read in place: a link planted in the dataset's folder
    # in place of a shard would serve whatever it points to. Names are inside; links are
    # resolved when the shard is opened.
    folder = tmp_path / "ds"
    _write(str(folder), 0)
    name = load_index(str(folder)).shards[0].path
    (folder / name).unlink()
    (folder / name).symlink_to(local_secret["path"])
    rewrite_index(str(folder), lambda obj: obj["shards"][0].update(
        bytes=local_secret["bytes"], checksum=local_secret["checksum"],
        rows=local_secret["rows"]))
    dataset = StreamDataset(str(folder), batch_size=4, shuffle=False, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"))
    with pytest.raises(IndexFormatError, match=r"is a link to .*outside the dataset's "
                                               r"folder"), StreamLoader(dataset) as loader:
        list(loader)
    with DatasetReader(str(folder), local_dir=str(tmp_path / "c")) as reader, \
            pytest.raises(IndexFormatError, match="allow_external_paths=True"):
        reader.read_batch(np.arange(4))
    # the user may choose to follow links
    with DatasetReader(str(folder), local_dir=str(tmp_path / "c2"),
                       allow_external_paths=True) as reader:
        assert reader.read_batch(np.arange(1))["x"].tolist() == [SECRET]


def test_links_that_stay_inside_the_folder_are_followed(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    _write(str(folder), 0)
    name = load_index(str(folder)).shards[1].path
    (folder / "real").mkdir()
    os.rename(folder / name, folder / "real" / name)
    (folder / name).symlink_to(Path("real") / name)
    with DatasetReader(str(folder), local_dir=str(tmp_path / "c")) as reader:
        assert reader.read_batch(np.arange(20))["x"].tolist() == list(range(20))
    linked = tmp_path / "linked-root"
    linked.symlink_to(folder)  # the dataset's folder itself may be a link
    with DatasetReader(str(linked), local_dir=str(tmp_path / "c2")) as reader:
        assert reader.read_batch(np.arange(20))["x"].tolist() == list(range(20))


def test_a_folder_with_a_link_out_is_not_indexed(tmp_path: Path,
                                                 local_secret: dict[str, Any],
                                                 capsys: Any) -> None:
    folder = tmp_path / "files"
    _write(str(folder), 0)
    os.remove(folder / "index.json")
    (folder / "planted.arrow").symlink_to(local_secret["path"])
    with pytest.raises(SourceError, match=r"planted\.arrow is a link to .*outside the folder "
                                          r"being indexed"):
        build_index(str(folder))
    assert cli_main(["index", str(folder)]) != 0
    assert "is a link to" in capsys.readouterr().err
    assert not (folder / "index.json").exists()
