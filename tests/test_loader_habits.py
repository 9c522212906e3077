"""What a training loop does with a loader besides iterating it: count epochs across a
resume, roll back mid-loop, leave an iterator behind at exit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from loader_helpers import ids_of, loader, make_dataset

STEPS_PER_EPOCH = 156
GLOBAL_BATCH = 2  # 313 samples: 156 steps an epoch, the last sample dropped


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = str(tmp_path_factory.mktemp("habits"))
    return make_dataset(folder, [100, 113, 100], seq=False), folder + "/cache"


def test_a_resume_at_step_154_of_156_trains_ten_epochs_in_all(data: tuple[str, str]) -> None:
    url, cache = data
    with loader(url, cache, global_batch_size=GLOBAL_BATCH, seed=3) as first:
        assert len(first) == STEPS_PER_EPOCH and first.epoch == 0
        stream = iter(first)
        for _ in range(154):
            next(stream)
        state = first.state_dict()
        assert first.epoch == 0

    with loader(url, cache, global_batch_size=GLOBAL_BATCH, seed=3) as resumed:
        resumed.load_state_dict(state)
        assert resumed.epoch == 0
        steps_per_epoch: dict[int, int] = {}
        for epoch in range(resumed.epoch, 10):  # the loop the README writes
            for _ in resumed:
                steps_per_epoch[epoch] = steps_per_epoch.get(epoch, 0) + 1
        assert steps_per_epoch == {0: 2, **{e: STEPS_PER_EPOCH for e in range(1, 10)}}
        assert 154 + sum(steps_per_epoch.values()) == 10 * STEPS_PER_EPOCH
        assert resumed.epoch == 10


def test_a_state_taken_after_an_epochs_last_batch_is_in_the_next_epoch(
        data: tuple[str, str]) -> None:
    url, cache = data
    with loader(url, cache, global_batch_size=GLOBAL_BATCH, seed=3) as first:
        stream = iter(first)
        for _ in range(STEPS_PER_EPOCH):
            next(stream)
        assert first.epoch == 1  # the last batch is received: the next one is epoch 1's
        state = first.state_dict()
    with loader(url, cache, global_batch_size=GLOBAL_BATCH, seed=3) as resumed:
        resumed.load_state_dict(state)
        assert resumed.epoch == 1
        assert len(list(resumed)) == STEPS_PER_EPOCH


@pytest.mark.parametrize("workers", [0, 2])
def test_load_state_dict_during_a_loop_continues_that_loop_from_the_loaded_state(
        data: tuple[str, str], workers: int) -> None:
    """A rollback inside ``for batch in loader``: the loop goes on, from the loaded position
    (it used to end silently after the current batch)."""
    url, cache = data
    with loader(url, cache, global_batch_size=8, seed=1, workers=workers) as it:
        reference = [ids_of(b).tolist() for b in it]  # epoch 0 whole
    with loader(url, cache, global_batch_size=8, seed=1, workers=workers) as it:
        seen, rolled_back = [], False
        for batch in it:
            seen.append(ids_of(batch).tolist())
            if len(seen) == 3:
                saved = it.state_dict()
            if len(seen) == 7 and not rolled_back:
                it.load_state_dict(saved)  # back to step 3
                rolled_back = True
        assert seen == reference[:7] + reference[3:]
        assert it.epoch == 1


def test_an_iterator_freed_at_interpreter_exit_prints_nothing(data: tuple[str, str]) -> None:
    """At exit Python sets module globals to None before it frees what they held: an
    iterator freed then used to print ``AttributeError: 'NoneType' object has no attribute
    'suppress'`` from its ``__del__``. The script does what the interpreter does (the loader
    module's globals set to None, then the iterator freed) and exits at once."""
    url, cache = data
    script = (
        "import os, sys; sys.path.insert(0, sys.argv[1])\n"
        "from loader_helpers import loader\n"
        "import streamcache.loading.loader as module\n"
        "it = loader(sys.argv[2], sys.argv[3], global_batch_size=8)\n"
        "stream = iter(it)\n"
        "next(stream)\n"
        "it._active = None\n"
        "for name in [n for n in vars(module) if not n.startswith('__')]:\n"
        "    setattr(module, name, None)\n"
        "del stream\n"
        "print('ok', flush=True)\n"
        "sys.stderr.flush()\n"
        "os._exit(0)\n"
    )
    tests = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, "-c", script, tests, url, cache],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "Exception ignored" not in result.stderr, result.stderr


def test_reading_the_rank_before_the_process_group_says_what_is_fine(
        data: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's second process before Trainer.fit made the group: LOCAL_RANK=1,
    WORLD_SIZE=2, no RANK, no group. Making the loader there is fine; reading its rank is
    refused, and the message says which is which (it said a loader made in __init__ is
    fine, and nothing of the rank read that raised it)."""
    from streamcache import PlanError, StreamDataset, StreamLoader

    url, cache = data
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = StreamLoader(StreamDataset(url, global_batch_size=8, cache_dir=cache))
    assert len(loader) == 39  # the global batch needs no rank
    with pytest.raises(PlanError) as caught:
        loader.dataset.rank  # noqa: B018
    message = str(caught.value)
    assert "dataset.rank" in message and "setup()" in message
    assert "Making the dataset and loader before the group exists is fine" in message


def test_worker_processes_under_a_too_long_tmpdir_are_refused_not_hung(
        data: tuple[str, str], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker hands its shared memory over a Unix socket in TMPDIR; a path too long for
    one failed only in the worker's queue thread and the loop waited forever (a TMPDIR deep
    in a job's scratch folder did it). Now: a ConfigError that says what to do, at iter()."""
    import tempfile

    from streamcache.errors import ConfigError

    url, cache = data
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    with loader(url, cache, global_batch_size=8, seed=1, workers=2) as it, \
            pytest.raises(ConfigError, match="set TMPDIR to a shorter folder"):
        iter(it)
    with loader(url, cache, global_batch_size=8, seed=1, workers=0) as it:
        assert len(list(it)) == STEPS_PER_EPOCH // 4  # reader threads need no socket
    monkeypatch.undo()  # the session's own temp folder again
    with loader(url, cache, global_batch_size=8, seed=1, workers=2) as it:
        assert len(list(it)) == STEPS_PER_EPOCH // 4


_ABANDON_SCRIPT = """
import gc, sys, threading, time
sys.path.insert(0, sys.argv[1])
from loader_helpers import loader
url, cache, count = sys.argv[2], sys.argv[3], int(sys.argv[4])
gc.set_threshold(20, 1, 1)  # collections everywhere: on reader and fsspec threads too
for i in range(count):
    it = loader(url, f"{cache}/{i % 2}", global_batch_size=8)
    stream = iter(it)
    next(stream)
    cycle = [it, stream]
    cycle.append(cycle)  # only the cyclic collector frees them, on whatever thread it runs
    del it, stream, cycle
gc.set_threshold(700, 10, 10)
deadline = time.monotonic() + 30
while time.monotonic() < deadline and any(
        t.name.startswith("streamcache-") for t in threading.enumerate()):
    gc.collect()  # (a dataset is freed once the readers that held it have ended)
    time.sleep(0.05)
left = [t.name for t in threading.enumerate() if t.name.startswith("streamcache-")]
print("left", len(left), sorted(set(left))[:5], flush=True)
"""


def test_loaders_abandoned_mid_epoch_under_frequent_gc_neither_deadlock_nor_leave_threads(
        data: tuple[str, str], tmp_path) -> None:
    """Loaders dropped mid-iteration inside reference cycles, collected while reader threads
    and fsspec's I/O thread run (the collector runs on whichever thread allocates): the
    process finishes (a join inside a finalizer could wait on the very thread it ran on) and
    every reader and prefetch thread of theirs ends once they are collected."""
    from servers import FaultServer

    url, _ = data
    folder = os.path.dirname(url)
    tests = os.path.dirname(os.path.abspath(__file__))
    with FaultServer(root=folder) as server:
        remote = server.url_for(os.path.basename(url))
        result = subprocess.run(
            [sys.executable, "-c", _ABANDON_SCRIPT, tests, remote, str(tmp_path), "60"],
            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith("left 0 "), (result.stdout, result.stderr[-3000:])


_COLLECT_ON_FSSPEC_THREAD = """
import gc, os, sys, threading
import fsspec.asyn
sys.path.insert(0, sys.argv[1])
from loader_helpers import loader
it = loader(sys.argv[2], sys.argv[3], global_batch_size=8)
stream = iter(it)
next(stream)
cycle = [it, stream]
cycle.append(cycle)
del it, stream, cycle  # garbage now, in a cycle: freed only by the collector
done = threading.Event()
def collect():
    gc.collect()
    done.set()
fsspec.asyn.get_loop().call_soon_threadsafe(collect)  # reads ahead wait on this thread now
print("collected" if done.wait(60) else "stuck", flush=True)
os._exit(0)
"""


def test_an_iteration_collected_on_fsspecs_thread_while_its_reads_wait_there_does_not_hang(
        tmp_path) -> None:
    """The collector frees an abandoned iteration on fsspec's I/O thread while the iteration's
    reader threads wait for reads that only that thread can finish: freeing it must not wait
    for them (it hung the process for good when the iterator's finalizer joined them)."""
    from servers import FaultServer, StoreModel

    url = make_dataset(str(tmp_path), [10] * 40, seq=False)
    tests = os.path.dirname(os.path.abspath(__file__))
    with FaultServer(root=tmp_path, store=StoreModel(latency_s=0.5)) as server:
        result = subprocess.run(
            [sys.executable, "-c", _COLLECT_ON_FSSPEC_THREAD, tests,
             server.url_for(os.path.relpath(url, tmp_path)), str(tmp_path / "cache")],
            capture_output=True, text=True, timeout=240)
    assert result.stdout.strip() == "collected", (result.stdout, result.stderr[-3000:])


_LOADERS_LEFT_AT_EXIT = """
import sys
sys.path.insert(0, sys.argv[1])
from loader_helpers import loader
from streamcache import StreamDataset, StreamLoader
url, cache = sys.argv[2], sys.argv[3]

def main():
    with loader(url, cache + "/closed") as closed:
        for _ in closed:
            pass
    dropped = loader(url, cache + "/dropped")
    next(iter(dropped))
    del dropped
    global abandoned, stream
    abandoned = loader(url, cache + "/abandoned")  # alive at exit, mid-iteration
    stream = iter(abandoned)
    next(stream)
    for _ in loader(url, cache + "/break"):
        break
    for context in ("spawn", "fork"):
        dataset = StreamDataset(url, global_batch_size=8, cache_dir=cache + "/" + context)
        workers = StreamLoader(dataset, num_workers=2, worker_mode="process",
                               multiprocessing_context=context)
        for step, _ in enumerate(workers):
            if step == 3:
                break
    # an epoch read whole, then iter() again: the next epoch's reads start and are still
    # running at exit (chunked shards: each reader holds its chunks' native views)
    global following
    looped = [StreamLoader(StreamDataset(sys.argv[4], global_batch_size=8,
                                         cache_dir=f"{cache}/next-{i}")) for i in range(4)]
    for each in looped:
        for _ in each:
            pass
    following = [iter(each) for each in looped]
    print("done", flush=True)

if __name__ == "__main__":
    main()
"""


def test_loaders_closed_dropped_or_abandoned_print_nothing_at_exit(data: tuple[str, str],
                                                                   tmp_path) -> None:
    """Every process that made loaders (closed, dropped, abandoned mid-iteration, alive at
    exit, with spawned and forked worker processes, the next epoch's reads running at exit)
    exits without a word on stderr (the extension reported the native objects still alive at
    exit as leaks: a user reads that as a memory bug)."""
    import numpy as np

    from streamcache import ShardWriter

    url, _ = data
    chunked = str(tmp_path / "chunked")
    rng = np.random.default_rng(0)
    with ShardWriter(chunked) as writer:  # the defaults: zstd, 64 KiB chunks (~47 here)
        for i in range(3000):
            writer.write({"x": i, "data": rng.integers(0, 255, 1000, dtype=np.uint8).tobytes()})
    script = tmp_path / "loaders_at_exit.py"
    script.write_text(_LOADERS_LEFT_AT_EXIT)
    tests = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, str(script), tests, url, str(tmp_path / "cache"),
                             chunked],
                            capture_output=True, text=True, timeout=240,
                            env={**os.environ, "TMPDIR": "/tmp"})
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-3000:]
    assert result.stderr == "", result.stderr[-3000:]


def test_the_exit_hook_ends_the_reader_threads_of_iterations_still_alive(
        data: tuple[str, str]) -> None:
    """What the interpreter's exit runs for iterations the program still holds (one parked
    mid-epoch, one whose next epoch has just started): their reader threads end, so none is
    left holding shard readers when the extension is torn down."""
    import threading

    from streamcache.loading import thread_batches

    url, cache = data
    before = {t for t in threading.enumerate() if t.name.startswith("streamcache-loader")}
    parked, following = loader(url, cache + "/parked"), loader(url, cache + "/following")
    stream = iter(parked)
    next(stream)
    for _ in following:
        pass
    started = iter(following)
    ours = {t for t in threading.enumerate()
            if t.name.startswith("streamcache-loader")} - before
    assert len(ours) == 4 and all(t.is_alive() for t in ours)
    thread_batches._end_at_exit()
    assert not any(t.is_alive() for t in ours)
    del stream, started
    parked.close()
    following.close()


def test_a_dataset_folder_given_as_a_path_reads_as_its_string(data: tuple[str, str]) -> None:
    from pathlib import Path

    from streamcache import Source, StreamDataset

    url, cache = data
    as_path = StreamDataset(Path(url), batch_size=4, cache_dir=Path(cache), seed=3)
    as_str = StreamDataset(url, batch_size=4, cache_dir=cache, seed=3)
    assert as_path.index.fingerprint == as_str.index.fingerprint
    assert Source(Path(url)).url == url
