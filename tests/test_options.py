"""The options surface: every StreamDataset and StreamLoader option is a typed keyword,
checked when the object is made, and nested fetch/prefetch options reach the parts that use
them."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from loader_helpers import make_dataset

import streamcache
from streamcache import ConfigError, FetchOptions, PrefetchOptions, StreamDataset, StreamLoader
from streamcache.cache.prefetch import DEFAULT_LOOKAHEAD_SHARDS, Prefetcher
from streamcache.loading.options import TAIL_MODES, WINDOW_UNITS, StreamOptions
from streamcache.plan import TailPolicy
from streamcache.plan.shuffle import WINDOW_UNITS as PLAN_WINDOW_UNITS


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = str(tmp_path_factory.mktemp("options"))
    return make_dataset(folder, [30, 30, 40]), folder + "/cache"


def test_the_keywords_are_the_options_fields() -> None:
    """One list of options: the dataset's keyword-only arguments are StreamOptions' fields,
    with the same defaults, so that neither can gain an option the other lacks."""
    parameters = inspect.signature(StreamDataset.__init__).parameters
    keywords = {name: p.default for name, p in parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    defaults = {f.name: f.default for f in dataclasses.fields(StreamOptions)}
    assert keywords == defaults


def test_the_literal_modes_are_the_plans_modes() -> None:
    assert set(TAIL_MODES) == {policy.value for policy in TailPolicy}
    assert WINDOW_UNITS == PLAN_WINDOW_UNITS


def test_a_misspelt_keyword_is_a_type_error(data: tuple[str, str]) -> None:
    url, cache = data
    with pytest.raises(TypeError, match="shufle"):
        StreamDataset(url, batch_size=4, cache_dir=cache, shufle=False)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="prefetch_workers"):  # replaced by prefetch=
        StreamDataset(url, batch_size=4, prefetch_workers=2)  # type: ignore[call-arg]
    dataset = StreamDataset(url, batch_size=4, cache_dir=cache)
    with pytest.raises(TypeError, match="num_worker"):
        StreamLoader(dataset, num_worker=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="retrys"):
        FetchOptions(retrys=2)  # type: ignore[call-arg]


@pytest.mark.parametrize(("options", "names"), [
    ({"batch_size": None}, ["exactly one", "batch_size", "global_batch_size"]),
    ({"global_batch_size": 8}, ["exactly one", "batch_size", "global_batch_size"]),
    ({"batch_size": 0}, ["batch_size", ">= 1"]),
    ({"batch_size": -4}, ["batch_size", ">= 1"]),
    ({"batch_size": 2.5}, ["batch_size", "integer"]),
    ({"tail": "dorp"}, ["tail", "'drop', 'pad', 'split'"]),
    ({"ragged": "jagged"}, ["ragged", "'padded', 'offsets'"]),
    ({"shuffle_window_unit": "rows"}, ["shuffle_window_unit", "'samples', 'shards'"]),
    ({"shuffle_window": 0}, ["shuffle_window", ">= 1"]),
    ({"shuffle": "yes"}, ["shuffle", "True or False"]),
    ({"seed": -1}, ["seed", ">= 0"]),
    ({"seed": 1 << 64}, ["seed", "2**64"]),
    ({"cache_limit": -1}, ["cache_limit", ">= 0"]),
    ({"rank": -1}, ["rank", ">= 0"]),
    ({"world_size": 0}, ["world_size", ">= 1"]),
    ({"fields": "x"}, ["fields", "fields=['x']"]),
    ({"transform": 3}, ["transform", "callable"]),
    ({"transform": dict, "batch_transform": dict}, ["transform", "batch_transform"]),
    ({"collate_fn": list}, ["collate_fn", "transform="]),
    ({"fetch": {"retries": 2}}, ["fetch", "FetchOptions"]),
    ({"prefetch": 4}, ["prefetch", "PrefetchOptions"]),
    ({"pad_value": "x"}, ["pad_value", "number"]),  # was refused only at the first batch
    ({"pad_value": True}, ["pad_value", "number"]),
])
def test_each_invalid_value_is_a_config_error_naming_the_option(
        data: tuple[str, str], options: dict[str, Any], names: list[str]) -> None:
    url, cache = data
    with pytest.raises(ConfigError) as caught:
        StreamDataset(url, cache_dir=cache, **{"batch_size": 4, **options})
    for name in names:
        assert name in str(caught.value)
    assert isinstance(caught.value, ValueError)  # as before: a ValueError


@pytest.mark.parametrize(("options", "names"), [
    ({"num_workers": -1}, ["num_workers", ">= 0"]),
    ({"prefetch": 0}, ["prefetch", ">= 1"]),
    ({"threads": 0}, ["threads", ">= 1"]),
    ({"worker_mode": "fork"}, ["worker_mode", "'auto', 'process', 'thread'"]),
    ({"timeout": -1.0}, ["timeout", ">= 0"]),
    ({"pin_memory": "yes"}, ["pin_memory", "True or False"]),  # was accepted
])
def test_each_invalid_loader_value_is_a_config_error(
        data: tuple[str, str], options: dict[str, Any], names: list[str]) -> None:
    url, cache = data
    dataset = StreamDataset(url, batch_size=4, cache_dir=cache)
    with pytest.raises(ConfigError) as caught:
        StreamLoader(dataset, **options)
    for name in names:
        assert name in str(caught.value)


@pytest.mark.parametrize(("make", "names"), [
    (lambda: FetchOptions(retries=-1), ["retries", ">= 0"]),
    (lambda: FetchOptions(max_concurrency=0), ["max_concurrency", ">= 1"]),
    (lambda: FetchOptions(timeout_s=0), ["timeout_s", "> 0"]),
    (lambda: PrefetchOptions(workers=0), ["workers", ">= 1"]),
    (lambda: PrefetchOptions(lookahead_shards=0), ["lookahead_shards", ">= 1"]),
    (lambda: PrefetchOptions(poll_s=0), ["poll_s", "> 0"]),
])
def test_invalid_nested_options_are_config_errors(make: Any, names: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        make()
    for name in names:
        assert name in str(caught.value)


def test_nested_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        FetchOptions().retries = 9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PrefetchOptions().workers = 9  # type: ignore[misc]


def test_nested_options_reach_the_fetcher_and_the_prefetcher(data: tuple[str, str]) -> None:
    url, cache = data
    fetch = FetchOptions(retries=1, timeout_s=3.0, max_concurrency=2)
    prefetch = PrefetchOptions(workers=1, lookahead_shards=2, inflight_bytes=1 << 20)
    dataset = StreamDataset(url, batch_size=4, cache_dir=cache, shuffle=False, fetch=fetch,
                            prefetch=prefetch)
    try:
        store = dataset.reader.store
        assert isinstance(store, Prefetcher)
        assert store.options == prefetch
        fetcher = store.cache.fetcher
        assert (fetcher.options.retries, fetcher.options.timeout_s,
                fetcher.options.max_concurrency) == (1, 3.0, 2)
        assert len(next(iter(dataset))["x"]) == 4  # and the dataset reads with them
    finally:
        dataset.close()


def test_the_default_lookahead_is_the_working_set_plus_a_margin(data: tuple[str, str]) -> None:
    url, cache = data
    for prefetch in (None, PrefetchOptions(workers=2)):
        dataset = StreamDataset(url, batch_size=4, cache_dir=cache, prefetch=prefetch)
        try:
            store = dataset.reader.store
            assert isinstance(store, Prefetcher)
            working_set = dataset.advice(dataset.cursor.epoch).working_set_shards()
            assert store.options.lookahead_shards == working_set + DEFAULT_LOOKAHEAD_SHARDS
            assert store.options.workers == (prefetch or PrefetchOptions()).workers
        finally:
            dataset.close()


def test_options_are_exported_and_keep_their_values(data: tuple[str, str]) -> None:
    url, cache = data
    assert {"ConfigError", "FetchOptions", "PrefetchOptions", "StreamOptions"} <= set(
        streamcache.__all__)
    dataset = StreamDataset(url, global_batch_size=8, cache_dir=Path(cache), tail="pad",
                            ragged="offsets", fields=["x"], shuffle_window_unit="shards",
                            shuffle_window=1)
    assert dataset.options.fields == ("x",)
    assert dataset.tail is TailPolicy.PAD
    assert dataset.shuffle.window_unit == "shards"


def test_a_type_checker_reports_a_misspelt_option(tmp_path: Path) -> None:
    """The promise to IDE users: mypy names a misspelt keyword and a mode that does not
    exist. Third-party packages are skipped so that the check takes seconds."""
    pytest.importorskip("mypy")
    (tmp_path / "mypy.ini").write_text(textwrap.dedent("""\
        [mypy]
        follow_imports = silent
        ignore_missing_imports = True
        [mypy-torch.*,numpy.*,fsspec.*,aiohttp.*,pyarrow.*]
        follow_imports = skip
        """))
    (tmp_path / "uses.py").write_text(textwrap.dedent("""\
        from streamcache import FetchOptions, PrefetchOptions, StreamDataset, StreamLoader

        good = StreamDataset("ds", global_batch_size=8, tail="pad", ragged="offsets",
                             fetch=FetchOptions(retries=1),
                             prefetch=PrefetchOptions(workers=1))
        StreamLoader(good, num_workers=2, worker_mode="thread")
        StreamDataset("ds", batch_size=2, shufle=False)
        StreamDataset("ds", batch_size=2, tail="dorp")
        StreamDataset("ds", batch_size=2, fetch=FetchOptions(retrys=2))
        StreamLoader(good, worker_mode="fork")
        """))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir",
         str(tmp_path / "cache"), "--no-error-summary", "uses.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "MYPYPATH": str(Path(streamcache.__file__).parents[1])})
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["7", "8", "9", "10"], result.stdout
    assert '"shufle"' in errors[0] and "retrys" in errors[2]
    assert "Literal['drop', 'pad', 'split']" in errors[1]
    assert "Literal['auto', 'process', 'thread']" in errors[3]


@pytest.mark.parametrize("below", ["", "sub/dir"])
def test_a_cache_dir_at_or_under_a_file_is_a_config_error(data: tuple[str, str], tmp_path: Path,
                                                          below: str) -> None:
    """It was a raw NotADirectoryError (or FileExistsError) at the first batch."""
    url, _ = data
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    with pytest.raises(ConfigError, match=f"cache_dir must be a folder, but {a_file} is a file"):
        StreamDataset(url, batch_size=4, cache_dir=str(a_file / below) if below else a_file)
    StreamDataset(url, batch_size=4, cache_dir=tmp_path / "new" / "cache")  # made later: fine
