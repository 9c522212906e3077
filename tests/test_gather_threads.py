"""A thread's limit on how many threads its gathers split over (``set_gather_threads``), and
the loader's rule for its reader threads (``gather_width``): the limit belongs to the thread
that sets it, changes no gathered byte, and a reader thread never splits where the loop and
the readers keep every core busy."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from streamcache import _native
from streamcache.loading import thread_batches

BACKENDS = _native.available_backends()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    with _native.use(request.param):
        yield request.param
        _native.set_gather_threads(0)


def test_the_limit_belongs_to_the_thread_that_sets_it(backend: str) -> None:
    seen: dict[str, int] = {}

    def other() -> None:
        seen["before"] = _native.get_gather_threads()
        _native.set_gather_threads(1)
        seen["after"] = _native.get_gather_threads()

    _native.set_gather_threads(3)
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == {"before": 0, "after": 1}  # a new thread starts at the default
    assert _native.get_gather_threads() == 3  # and its setting does not reach this one


def test_a_negative_limit_is_refused(backend: str) -> None:
    with pytest.raises(ValueError, match="threads must be >= 0"):
        _native.set_gather_threads(-1)
    assert _native.get_gather_threads() == 0


@pytest.mark.parametrize("limit", [0, 1, 2, 64])
def test_large_gathers_give_the_same_bytes_at_any_limit(backend: str, limit: int) -> None:
    """Batches above the size where a gather splits (1 MiB), fixed and variable rows."""
    rng = np.random.default_rng(limit)
    stride = 4096
    sources = [rng.integers(0, 256, 300 * stride, dtype=np.uint8) for _ in range(3)]
    which = rng.integers(0, 3, 700).astype(np.int32)
    rows = rng.integers(0, 300, 700).astype(np.int64)
    expected = np.stack([sources[w][r * stride:(r + 1) * stride] for w, r in
                         zip(which, rows, strict=True)])
    lengths = [rng.integers(0, 9000, 120) for _ in range(3)]
    offsets = [np.concatenate([[0], np.cumsum(n)]).astype(np.int64) for n in lengths]
    values = [rng.integers(0, 256, int(o[-1]), dtype=np.uint8) for o in offsets]
    var_rows = rng.integers(0, 120, 400).astype(np.int64)
    var_which = rng.integers(0, 3, 400).astype(np.int32)
    rows_expected = [values[w][offsets[w][r]:offsets[w][r + 1]].tobytes()
                     for w, r in zip(var_which, var_rows, strict=True)]

    _native.set_gather_threads(limit)
    out = np.empty_like(expected)
    _native.gather_fixed(sources, stride, which, rows, out)
    assert np.array_equal(out, expected)
    got_values, got_offsets = _native.gather_var(values, offsets, 1, var_which, var_rows)
    assert [got_values[a:b].tobytes() for a, b in itertools.pairwise(got_offsets)] \
        == rows_expected
    assert _native.gather_bytes(values, offsets, var_which, var_rows) == rows_expected


@pytest.mark.parametrize(("cores", "readers", "width"), [
    (1, 2, 1), (2, 1, 1), (2, 2, 1), (3, 2, 1), (4, 2, 1), (5, 2, 2), (16, 2, 7), (16, 1, 15),
    (16, 8, 1), (64, 8, 7),
])
def test_reader_threads_split_only_over_the_cores_left_free(
        monkeypatch: pytest.MonkeyPatch, cores: int, readers: int, width: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert thread_batches.gather_width(readers) == width


def test_a_loader_s_reader_threads_carry_the_limit(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Any) -> None:
    """Each reader thread sets its own limit before its first read (the loop's thread keeps
    its own): seen from inside the read."""
    from streamcache import ShardWriter, StreamDataset, StreamLoader
    from streamcache.loading.dataset import StreamDataset as Dataset

    with ShardWriter(str(tmp_path / "data"), compression=None) as writer:
        for i in range(64):
            writer.write({"x": np.full(4, i, np.int32)})
    seen: list[tuple[str, int]] = []
    read_step = Dataset.read_step

    def spy(self: Any, ref: Any, part: Any) -> Any:
        seen.append((threading.current_thread().name, _native.get_gather_threads()))
        return read_step(self, ref, part)

    monkeypatch.setattr(Dataset, "read_step", spy)
    monkeypatch.setattr(thread_batches, "gather_width", lambda readers: 5)
    dataset = StreamDataset(str(tmp_path / "data"), batch_size=8, rank=0, world_size=1,
                            cache_dir=str(tmp_path / "cache"))
    with StreamLoader(dataset) as loader:
        ids = sorted(i for batch in loader for i in batch["__id__"].tolist())
    assert ids == list(range(64))
    assert seen and all(name.startswith("streamcache-loader-") and limit == 5
                        for name, limit in seen)
    assert _native.get_gather_threads() == 0


@pytest.mark.skipif("native" not in BACKENDS or not hasattr(os, "sched_setaffinity"),
                    reason="the native core's pool, on Linux")
def test_the_pool_counts_the_cores_the_process_may_run_on() -> None:
    """A process pinned to one core (a rank given its share of a node, a container's CPU set)
    gets a pool of one thread, not one per core of the machine."""
    def pool_size(pin: bool) -> list[str]:
        script = ("import os\n"
                  + ("os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n" if pin else "")
                  + "from streamcache import _native\n"
                  + "print(_native.backend_name(), _native.get_num_threads())")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True, timeout=120,
                             env={**os.environ, "STREAMCACHE_NATIVE": "1"})
        return out.stdout.split()

    assert pool_size(True) == ["native", "1"]
    assert pool_size(False) == ["native", str(len(os.sched_getaffinity(0)))]
