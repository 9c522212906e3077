"""One destination, one writer; replacing a dataset without ever destroying it first.

Two writers to one destination (threads, real processes, a SIGKILLed one), on a local
folder and on the loopback S3 server; ``overwrite=True`` that publishes the new version last
and removes the old one after; a failed overwrite that leaves the old dataset as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from servers import S3Bucket

from streamcache.errors import DestinationError, ShardNotFoundError
from streamcache.format.index import load_index
from streamcache.format.lease import LEASE_NAME
from streamcache.format.writer import ShardWriter, write_dataset
from streamcache.loading.dataset_reader import DatasetReader


@pytest.fixture(params=["local", "s3"])
def destination(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """(URL, storage_options) of a fresh destination on a local folder or loopback S3."""
    if request.param == "local":
        yield str(tmp_path / "ds"), None
    else:
        bucket: S3Bucket = request.getfixturevalue("s3_bucket")
        yield bucket.url(f"writer-{uuid.uuid4().hex[:8]}/ds"), bucket.storage_options()


def _ids(url: str, options: Any) -> list[int]:
    with DatasetReader(url, storage_options=options) as reader:
        return [int(reader[i]["x"]) for i in range(len(reader))]


def _files(url: str, options: Any) -> set[str]:
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.invalidate_cache()
    return {p.rsplit("/", 1)[1] for p in fs.find(root)}


# ------------------------------------------------------------------ two writers


def test_a_second_writer_is_refused(destination: tuple[str, Any]) -> None:
    url, options = destination
    first = ShardWriter(url, shard_size=64, storage_options=options)
    for i in range(50):
        first.write({"x": i})
    with pytest.raises(DestinationError, match="is being written by writer") as caught:
        ShardWriter(url, shard_size=64, storage_options=options)
    assert first.token in str(caught.value) and LEASE_NAME in str(caught.value)
    first.close()
    assert _ids(url, options) == list(range(50))
    assert LEASE_NAME not in _files(url, options)  # given back after publishing
    with ShardWriter(url, overwrite=True, storage_options=options) as again:
        again.write({"x": 7})  # free again once the first is done
    assert _ids(url, options) == [7]


def test_a_writer_whose_lease_was_taken_over_publishes_nothing(
    destination: tuple[str, Any],
) -> None:
    url, options = destination
    first = ShardWriter(url, shard_size=64, storage_options=options)
    for i in range(30):
        first.write({"x": i})
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.rm_file(f"{root}/{LEASE_NAME}")  # an operator removed it, believing the writer dead
    with ShardWriter(url, shard_size=64, storage_options=options) as second:
        for i in range(20):
            second.write({"x": 100 + i})
    with pytest.raises(DestinationError, match="no longer holds the lease"):
        first.close()
    assert _ids(url, options) == list(range(100, 120))  # the second's, whole, not a mix
    assert not [f for f in _files(url, options) if first.token in f]


_WRITER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from streamcache.errors import DestinationError
    from streamcache.format.writer import ShardWriter
    url, options, base, flags = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        writer = ShardWriter(url, shard_size=64, storage_options=options or None)
    except DestinationError as error:
        print(error)
        sys.exit(3)
    for i in range(40):
        writer.write({"x": base + i})
    writer.cut()
    Path(flags, f"ready-{base}").touch()
    while not Path(flags, f"go-{base}").exists():
        time.sleep(0.02)
    writer.close()
""")


def _start_writer(url: str, options: Any, base: int, flags: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _WRITER, url, json.dumps(options), str(base),
                             str(flags)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for(path: Path, process: subprocess.Popen[str]) -> None:
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(process.communicate())
        time.sleep(0.02)


def test_two_writer_processes_one_destination(destination: tuple[str, Any],
                                              tmp_path: Path) -> None:
    url, options = destination
    first = _start_writer(url, options, 0, tmp_path)
    _wait_for(tmp_path / "ready-0", first)
    second = _start_writer(url, options, 1000, tmp_path)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 3, err
    assert "is being written by writer" in out and f"process {first.pid}" in out
    (tmp_path / "go-0").touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert _ids(url, options) == list(range(40))


def test_of_two_writer_processes_started_together_exactly_one_writes(
    destination: tuple[str, Any], tmp_path: Path
) -> None:
    url, options = destination
    writers = {base: _start_writer(url, options, base, tmp_path) for base in (0, 1000)}
    refused: list[int] = []
    deadline = time.monotonic() + 120  # (a safety net against a hang, not a measurement)
    while not refused:  # the loser exits at once; the winner waits for its go
        refused = [base for base, process in writers.items() if process.poll() is not None]
        if time.monotonic() > deadline:
            for process in writers.values():
                process.kill()
                process.communicate()
            raise AssertionError("both writers are running: neither was refused")
        time.sleep(0.02)
    [loser] = refused
    [winner] = [base for base in writers if base != loser]
    out, err = writers[loser].communicate(timeout=60)
    assert writers[loser].returncode == 3, err
    assert "is being written by writer" in out
    _wait_for(tmp_path / f"ready-{winner}", writers[winner])
    (tmp_path / f"go-{winner}").touch()
    _, err = writers[winner].communicate(timeout=120)
    assert writers[winner].returncode == 0, err
    assert _ids(url, options) == list(range(winner, winner + 40))


def test_a_lease_left_by_a_killed_writer_is_taken_over(destination: tuple[str, Any],
                                                       tmp_path: Path) -> None:
    url, options = destination
    victim = _start_writer(url, options, 0, tmp_path)
    _wait_for(tmp_path / "ready-0", victim)
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=60)
    assert LEASE_NAME in _files(url, options)  # it died holding the lease
    with ShardWriter(url, storage_options=options) as writer:  # same host, dead process
        writer.write({"x": 5})
    assert _ids(url, options) == [5]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_lease_of_a_killed_writer_not_yet_reaped_is_taken_over(tmp_path: Path) -> None:
    """A killed process stays a zombie until its parent reaps it (a launcher that has not
    noticed yet); its pid still exists, but it holds nothing."""
    url = str(tmp_path / "ds")
    victim = _start_writer(url, None, 0, tmp_path)
    _wait_for(tmp_path / "ready-0", victim)
    victim.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _state(victim.pid) != "Z":  # not reaped: poll() or communicate() would reap it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        with ShardWriter(url) as writer:
            writer.write({"x": 5})
        assert _ids(url, None) == [5]
    finally:
        victim.communicate(timeout=60)


def test_a_lease_whose_pid_was_reused_is_taken_over(tmp_path: Path) -> None:
    """The lease names its process by start time too: a live process that merely has the
    holder's pid (reused after a crash) does not keep the destination locked."""
    url = str(tmp_path / "ds")
    with ShardWriter(url) as writer:
        writer.write({"x": 1})
        lease = tmp_path / "ds" / LEASE_NAME
        holder = json.loads(lease.read_text())
        boot, namespace, pid, _start = holder["process"].split("-")
        assert int(pid) == holder["pid"]
        reused = {**holder, "token": "crashedwriter", "process": f"{boot}-{namespace}-{pid}-1"}
        alive = {**holder, "token": "livewriter"}
    for stale, taken in ((reused, True), (alive, False)):
        lease.write_text(json.dumps(stale))
        if taken:
            with ShardWriter(url, overwrite=True) as writer:
                writer.write({"x": 2})
            assert _ids(url, None) == [2]
        else:
            with pytest.raises(DestinationError, match="is being written by writer livewriter"):
                ShardWriter(url, overwrite=True)


# ------------------------------------------------------------------ overwrite


def _old_version(url: str, options: Any) -> None:
    write_dataset(({"x": i} for i in range(60)), url, shard_size=64,
                  storage_options=options)


def test_overwrite_keeps_the_old_dataset_until_the_new_one_is_published(
    destination: tuple[str, Any],
) -> None:
    url, options = destination
    _old_version(url, options)
    old = load_index(url, options)
    old_files = {s.path for s in old.shards}
    with ShardWriter(url, shard_size=64, overwrite=True, storage_options=options) as writer:
        for i in range(45):
            writer.write({"x": 1000 + i})
        writer.cut()
        # new shards are stored under new names; the old version is untouched and readable
        assert load_index(url, options).fingerprint == old.fingerprint
        assert _ids(url, options) == list(range(60))
    new = load_index(url, options)
    assert not old_files & {s.path for s in new.shards}
    assert _ids(url, options) == list(range(1000, 1045))
    assert not old_files & _files(url, options)  # removed after the new index was published


def test_a_failed_overwrite_leaves_the_old_dataset_intact(destination: tuple[str, Any]) -> None:
    url, options = destination
    _old_version(url, options)
    before = _files(url, options)
    with pytest.raises(RuntimeError, match="producer"), ShardWriter(
        url, shard_size=64, overwrite=True, storage_options=options
    ) as writer:
        for i in range(45):
            writer.write({"x": 1000 + i})
        raise RuntimeError("the producer failed")
    assert _ids(url, options) == list(range(60))
    assert _files(url, options) == before  # its own shards and lease are gone again


def test_a_reader_of_the_old_version_never_gets_new_rows(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    for compression in ("zstd", None):
        write_dataset(({"x": i} for i in range(60)), url, shard_size=64, overwrite=True,
                      compression=compression)
        with DatasetReader(url, local_dir=str(tmp_path / "copies")) as reader:
            assert int(reader[0]["x"]) == 0  # the first shard is open; the others are not
            write_dataset(({"x": 1000 + i} for i in range(60)), url, shard_size=64,
                          overwrite=True, compression=compression)
            errors = 0
            for i in range(60):
                try:
                    value = int(reader[i]["x"])
                except ShardNotFoundError as error:
                    assert "replaced or removed" in str(error) and url in str(error)
                    errors += 1
                    continue  # a clear error is fine; a row of the new version is not
                assert value == i
            assert errors > 0  # the old version's shards are gone once the new is published


def test_overwrite_never_removes_files_the_writer_did_not_make(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streamcache.format.index import build_index

    folder = tmp_path / "data"
    folder.mkdir()
    pq.write_table(pa.table({"x": list(range(10))}), folder / "part-0.parquet")
    build_index(str(folder))
    write_dataset(({"x": i} for i in range(5)), str(folder), overwrite=True)
    assert (folder / "part-0.parquet").exists()
    assert _ids(str(folder), None) == list(range(5))


def test_a_store_without_credentials_is_one_clear_error(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    # #27: ShardWriter("s3://...") without credentials raised botocore's NoCredentialsError
    # (59 lines of traceback); the endpoint is a closed port on loopback: nothing leaves
    # the machine, and the error comes before any connection
    from servers import free_port
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
               "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(DestinationError) as caught:
        ShardWriter("s3://no-credentials/ds", storage_options=options)
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    assert "s3://no-credentials/ds" in message and "NoCredentialsError" in message
    assert "AWS_ACCESS_KEY_ID" in message  # what to do
