"""The CLI's promise: a failure is one clear line and exit 1, whatever layer it comes from."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from loader_helpers import make_dataset
from servers import free_port

from streamcache import UnknownProtocolError, build_index
from streamcache.cli.main import main
from streamcache.remote.storage import filesystem


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamcache", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def _offline_s3_env(**extra: str) -> dict[str, str]:
    """An environment whose S3 endpoint is a closed port on loopback (nothing leaves the
    machine), with no credentials anywhere unless ``extra`` gives some."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_EC2_METADATA_DISABLED="true",
               AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull,
               AWS_MAX_ATTEMPTS="1", **extra)
    return env


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_unknown_protocol_is_a_streamcache_error_and_one_line(capsys) -> None:
    with pytest.raises(UnknownProtocolError, match="s4"):
        filesystem("s4://bucket/data")
    assert main(["inspect", "s4://bucket/data"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "s4://" in err[0] and "protocol" in err[0], err


def test_s3_without_credentials_is_one_line() -> None:
    line = _one_line(_run_cli("inspect", "s3://bucket/data", env=_offline_s3_env()))
    assert "s3://bucket/data" in line and "credentials" in line, line
    assert "AWS_ACCESS_KEY_ID" in line, line  # what to do


def test_unreachable_store_is_one_line() -> None:
    env = _offline_s3_env(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    line = _one_line(_run_cli("inspect", "s3://bucket/data", env=env))
    assert "s3://bucket/data" in line and "cannot be reached" in line, line
    assert "check the network" in line, line  # what to do


def test_corrupt_parquet_page_is_one_line(tmp_path) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    path = folder / "a.parquet"
    table = pa.table({"x": np.arange(50_000), "y": np.random.default_rng(0).random(50_000)})
    pq.write_table(table, path, compression="snappy", row_group_size=10_000)
    build_index(str(folder))
    offset = pq.ParquetFile(path).metadata.row_group(2).column(1).data_page_offset
    data = bytearray(path.read_bytes())
    for i in range(offset + 30, offset + 2000):  # garble a page header and its data
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    line = _one_line(_run_cli("bench", str(folder), "--cache-dir", str(tmp_path / "c")))
    assert "corrupt" in line and "a.parquet" in line, line


def test_inspect_json_into_a_closed_pipe_exits_quietly(tmp_path) -> None:
    url = make_dataset(str(tmp_path), [20])
    with subprocess.Popen([sys.executable, "-m", "streamcache", "inspect", url, "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # like `| head` that has read enough
        stderr = process.stderr.read().decode()
        process.wait(timeout=120)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert process.returncode != 0


def test_cache_limit_and_shard_size_read_sizes_alike(tmp_path, capsys) -> None:
    url = make_dataset(str(tmp_path), [30], seq=False)
    assert main(["bench", url, "--cache-limit", "10MB", "--batch-size", "10", "--json",
                 "--cache-dir", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", url, "--cache-limit", "10 parsecs"])
    assert exit_info.value.code == 2
    assert "10KB" in capsys.readouterr().err  # the message shows how to write a size
    from streamcache.format.convert import parse_size as convert_parse_size
    from streamcache.units import parse_size

    assert convert_parse_size is parse_size


def test_bench_without_a_url_is_one_line(capsys) -> None:
    assert main(["bench"]) == 1
    assert "--demo" in capsys.readouterr().err


def test_counts_are_singular_for_one(tmp_path, capsys) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"x": np.arange(1)}), folder / "a.parquet")
    assert main(["index", str(folder)]) == 0
    assert "indexed 1 file, 1 row," in capsys.readouterr().out
    assert main(["convert", str(folder), str(tmp_path / "out"), "--quiet"]) == 0
    assert "converted 1 sample into 1 shard at" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "usage", "typo"), [
    (["goodput", "--failures-per-day", "3", "--intervl", "2h"], "usage: streamcache goodput",
     "--intervl"),
    (["bench", "--demo", "--stpes", "5"], "usage: streamcache bench", "--stpes"),
    (["inspect", "x", "--jsn"], "usage: streamcache inspect", "--jsn"),
])
def test_a_mistyped_flag_prints_the_subcommands_usage(argv: list[str], usage: str, typo: str,
                                                      capsys) -> None:
    with pytest.raises(SystemExit) as exited:  # it printed the top-level usage
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith(usage) and "unrecognized arguments: " + typo in err


# What pynvml 13 installs (``_pynvml_redirector.pth``; nvidia-resiliency-ext, the
# ``resilience`` extra, depends on it): a finder that warns when pynvml is imported, as torch
# does on ``import torch``.
_WITH_PYNVML_13 = """
import importlib.abc, sys, warnings

class PynvmlFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "pynvml":
            warnings.warn("The pynvml package is deprecated. Please install nvidia-ml-py "
                          "instead.", FutureWarning, stacklevel=2)
        return None

sys.meta_path.insert(0, PynvmlFinder())
from streamcache.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["checkpoints", "bench"])
def test_an_error_is_one_line_with_the_resilience_extra_installed(tmp_path,
                                                                  command: str) -> None:
    """pynvml 13's deprecation warning (on torch's import of it) added two lines to every
    error of a command that imports torch."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    result = subprocess.run([sys.executable, "-c", _WITH_PYNVML_13, command,
                             str(tmp_path / "nothing")], capture_output=True, text=True,
                            timeout=120, env=env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"streamcache {command}: error:")
