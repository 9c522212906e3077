"""Copies of the live state made in the background (guards.py): memory-tier snapshots
(``MemoryOptions(background_copy=True)``, memory_write.py) and saves with
``background_staging`` (staging.py). A snapshot holds the state of its call whatever the loop
does meanwhile, or is given up, and a save holds it or fails (never a torn one kept or
published); guarded updates wait, and nothing the copy can meet (a failure, a refused value,
a forked child) leaves the loop blocked.

The copy is held back by wrapping the copy function the background thread calls, so the
loop's operations land before, during or after it: the copy, the guards and the checks are
real.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from dist import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from streamcache.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    ModelState,
    memory_write,
    staging,
)
from streamcache.checkpoint.guards import UpdateGuard, VersionCheck
from streamcache.checkpoint.memory import MemoryOptions, MemoryTier

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _ckpt(folder: Path, background: bool = True) -> Checkpointer:
    (folder / "shm").mkdir(exist_ok=True)
    return Checkpointer(folder / "root", memory=MemoryOptions(directory=str(folder / "shm"),
                                                              background_copy=background))


def _model(buffers: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, 16)]
    if buffers:
        layers.append(torch.nn.BatchNorm1d(16))
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _forward_backward(model)
    optimizer.step()  # the optimizer has its state from here on
    return model, optimizer


def _forward_backward(model: torch.nn.Module) -> None:
    model(torch.randn(8, 16)).square().mean().backward()


def _values(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    values = [v.detach().clone() for v in model.state_dict().values()]
    for per_param in optimizer.state.values():
        values += [v.clone() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return values


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _restored(make: Callable[[Path], Checkpointer], folder: Path, step: int,
              buffers: bool = False) -> list[torch.Tensor]:
    """What a restart (a new Checkpointer, fresh model and optimizer) loads: step ``step``."""
    model, optimizer = _model(buffers)
    with make(folder) as ckpt:
        assert ckpt.load({"train": ModelState(model, optimizer)}) == step
    return _values(model, optimizer)


def _step_does_not_hang(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A training step whose optimizer.step() must not wait (on a thread: a hang fails)."""
    _forward_backward(model)
    stepped = threading.Thread(target=optimizer.step, daemon=True)
    stepped.start()
    stepped.join(20)
    assert not stepped.is_alive(), "optimizer.step() still waits for a copy that failed"


def _whole(ckpt: Checkpointer) -> dict[int, Any]:
    """{step: prepared snapshot} of the slots that scan and verify whole."""
    tier = ckpt._memory
    assert tier is not None
    found = {}
    for slot, summary in tier.scan():
        prepared = tier.prepare(slot, summary)
        if prepared is not None:
            found[summary.step] = prepared
    return found


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """While clear, the tier's thread waits before its background copy."""
    opened = threading.Event()
    real = memory_write.copy_tensor

    def gated(*args: Any, **kwargs: Any) -> None:
        assert opened.wait(30), "the test never opened the gate"
        real(*args, **kwargs)

    monkeypatch.setattr(memory_write, "copy_tensor", gated)
    yield opened
    opened.set()


def test_guarded_updates_wait_and_the_snapshot_holds_the_call(
        tmp_path: Path, gate: threading.Event) -> None:
    model, optimizer = _model(buffers=True)
    state = {"train": ModelState(model, optimizer)}
    _forward_backward(model)
    optimizer.step()
    with _ckpt(tmp_path) as ckpt:
        expected = _values(model, optimizer)
        started = time.perf_counter()
        assert ckpt.snapshot(1, state)
        returned = time.perf_counter() - started
        threading.Timer(0.3, gate.set).start()
        _forward_backward(model)  # BatchNorm's statistics: the forward waits for the copy
        optimizer.step()
        waited = time.perf_counter() - started
        ckpt.wait()
        assert returned < 0.25 < waited
        assert not _same(_values(model, optimizer), expected)  # the step did happen
        assert set(_whole(ckpt)) == {1}
        ckpt._close(finished=False)  # as a kill would leave it
    assert _same(_restored(_ckpt, tmp_path, 1, buffers=True), expected)


def test_an_unguarded_write_during_the_copy_gives_the_snapshot_up(
        tmp_path: Path, gate: threading.Event, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    with _ckpt(tmp_path) as ckpt:
        gate.set()
        assert ckpt.snapshot(1, state)
        kept = _values(model, optimizer)
        ckpt.wait()
        gate.clear()
        _forward_backward(model)
        optimizer.step()
        assert ckpt.snapshot(2, state)
        with torch.no_grad():  # an EMA-like write the guards cannot see
            model[0].weight.mul_(0.5)
        gate.set()
        with caplog.at_level(logging.WARNING, "streamcache.checkpoint"):
            ckpt.wait()
        assert "changed while they were copied in the background" in caplog.text
        assert "'train'" in caplog.text and "wait_staged" in caplog.text
        assert set(_whole(ckpt)) == {1}  # step 2 is given up, step 1 stays whole
        ckpt._close(finished=False)
    assert _same(_restored(_ckpt, tmp_path, 1), kept)


def test_a_torn_snapshot_is_warned_of_after_a_warning_of_another_kind(
        tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import errno

    from streamcache.checkpoint import memory

    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with _ckpt(tmp_path) as ckpt, caplog.at_level(logging.WARNING, "streamcache.checkpoint"):
        with monkeypatch.context() as patch:
            patch.setattr(memory, "open_for_write", full)
            assert not ckpt.snapshot(1, state)  # warned: not kept, no space
        assert "No space left" in caplog.text
        assert ckpt.snapshot(2, state)
        with torch.no_grad():
            model[0].weight.mul_(0.5)
        gate.set()
        ckpt.wait()
        assert "changed while they were copied in the background" in caplog.text


def test_a_failed_background_copy_releases_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    real = memory_write.copy_tensor

    def failing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the device went away")

    with _ckpt(tmp_path) as ckpt:
        monkeypatch.setattr(memory_write, "copy_tensor", failing)
        with caplog.at_level(logging.WARNING, "streamcache.checkpoint"):
            assert ckpt.snapshot(1, state)
            _step_does_not_hang(model, optimizer)
            ckpt.wait()
        assert "the device went away" in caplog.text
        assert _whole(ckpt) == {}
        monkeypatch.setattr(memory_write, "copy_tensor", real)
        assert ckpt.snapshot(2, state)
        ckpt.wait()
        assert set(_whole(ckpt)) == {2}


def test_a_snapshot_refused_in_its_call_holds_nothing(tmp_path: Path) -> None:
    model, optimizer = _model()
    with _ckpt(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match="cannot be kept in the memory tier"):
            ckpt.snapshot(1, {"train": ModelState(model, optimizer), "bad": object()})
        assert not ckpt._guard.held
        _forward_backward(model)
        optimizer.step()  # does not wait: nothing is held


def test_a_forked_child_does_not_wait_for_the_parents_copy(
        tmp_path: Path, gate: threading.Event) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.snapshot(1, state)  # held: the copy waits at the gate
        assert ckpt._guard.held
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(20)  # (a child waiting for the parent's copy: killed here)
                ckpt._guard.wait()  # what a guarded update in the child runs; no torch kernel
                code = 0 if not ckpt._guard.held else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert ckpt._guard.held  # the parent's hold is still the parent's
        gate.set()
        ckpt.wait()
        assert set(_whole(ckpt)) == {1}


def test_the_default_copies_in_the_call(tmp_path: Path, gate: threading.Event) -> None:
    model, optimizer = _model()
    with _ckpt(tmp_path, background=False) as ckpt:
        assert ckpt.snapshot(1, {"train": ModelState(model, optimizer)})
        assert not ckpt._guard.held  # nothing deferred: the gate is never reached
        with torch.no_grad():
            model[0].weight.mul_(0.5)
        ckpt.wait()
        assert set(_whole(ckpt)) == {1}


def test_a_hold_released_twice_counts_once() -> None:
    guard = UpdateGuard()
    model = torch.nn.Linear(2, 2)
    entry = SimpleNamespace(model=model, optimizers=[torch.optim.SGD(model.parameters())])
    first, second = guard.hold([entry]), guard.hold([entry])
    first.release()
    first.release()
    assert guard.held
    second.release()
    assert not guard.held
    guard.close()


def test_a_snapshot_with_no_step_after_it_is_whole_without_the_training_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the last snapshot of a script that then ends (or evaluates) without another guarded
    # update or wait: the tier's thread checks the counters itself after a while, so the
    # snapshot becomes whole and the interpreter's exit does not wait on that thread forever
    monkeypatch.setattr(VersionCheck, "SELF_CHECK_AFTER_S", 0.2)
    model, optimizer = _model()
    ckpt = _ckpt(tmp_path)
    assert ckpt.snapshot(1, {"train": ModelState(model, optimizer)})
    tier = ckpt._memory
    assert tier is not None
    reader = MemoryTier(tier.options, tier.root_url, 0, 1)  # another view of the slots
    assert reader.folder == tier.folder
    deadline = time.monotonic() + 20
    while not any(s.step == 1 for _, s in reader.scan()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(s.step == 1 for _, s in reader.scan())
    reader.close()
    ckpt.close()


# ---------------------------------------------------------------------------- saves


@pytest.fixture
def staging_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """While clear, the writer thread waits before staging the model/optimizer entries."""
    opened = threading.Event()
    real = staging.Staging.stage_later

    def gated(self: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        assert opened.wait(30), "the test never opened the gate"
        return real(self, state_dict)

    monkeypatch.setattr(staging.Staging, "stage_later", gated)
    yield opened
    opened.set()


def _saver(folder: Path) -> Checkpointer:
    return Checkpointer(folder, async_mode="thread", background_staging=True)


def test_an_unguarded_write_during_background_staging_fails_the_save(
        tmp_path: Path, staging_gate: threading.Event) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    with _saver(tmp_path) as ckpt:
        staging_gate.set()
        ckpt.save(1, state)
        committed = _values(model, optimizer)
        ckpt.wait()
        staging_gate.clear()
        ckpt.save(2, state)
        with torch.no_grad():  # an EMA-like write the guards cannot see
            model[0].weight.mul_(0.5)
        staging_gate.set()
        with pytest.raises(CheckpointWriteError, match="changed while they were staged") as err:
            ckpt.wait()
        assert "'train'" in str(err.value) and "wait_staged" in str(err.value)
        assert [c.step for c in ckpt.list() if c.complete] == [1]  # nothing for step 2
    assert _same(_restored(_saver, tmp_path, 1), committed)


@pytest.mark.parametrize("kind", ["snapshot", "save"])
def test_wait_staged_before_an_unguarded_write_keeps_the_copy(
        tmp_path: Path, kind: str, gate: threading.Event,
        staging_gate: threading.Event) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    make = _ckpt if kind == "snapshot" else _saver
    with make(tmp_path) as ckpt:
        (ckpt.snapshot if kind == "snapshot" else ckpt.save)(1, state)
        expected = _values(model, optimizer)
        threading.Timer(0.1, (gate if kind == "snapshot" else staging_gate).set).start()
        ckpt.wait_staged()  # the copy is done and checked: later writes do not reach it
        with torch.no_grad():
            model[0].weight.mul_(0.5)
        _forward_backward(model)
        optimizer.step()
        ckpt.wait()
        ckpt._close(finished=False)  # (the memory tier's slots stay for the restart)
    assert _same(_restored(make, tmp_path, 1), expected)


def test_a_save_that_fails_before_staging_releases_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}

    def failing(self: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("the device went away")

    monkeypatch.setattr(staging.Staging, "to_host", failing)  # the writer's step before
    with _saver(tmp_path) as ckpt:
        ckpt.save(1, state)
        _step_does_not_hang(model, optimizer)
        with pytest.raises(CheckpointWriteError, match="the device went away"):
            ckpt.wait()


def test_a_save_whose_copy_now_fails_releases_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}

    def failing(self: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        raise MemoryError("no host memory for the staging buffers")

    with _saver(tmp_path) as ckpt:
        with monkeypatch.context() as patch:
            patch.setattr(staging.Staging, "stage_now", failing)
            with pytest.raises(MemoryError):
                ckpt.save(1, state)
        assert not ckpt._guard.held
        _forward_backward(model)
        optimizer.step()  # does not wait: nothing is held
        ckpt.save(2, state)
        ckpt.wait()
        assert [c.step for c in ckpt.list() if c.complete] == [2]


# ---------------------------------------------------------------------------- property

_OPS = st.lists(st.sampled_from(["snapshot", "step", "write", "wait_staged", "wait"]),
                min_size=1, max_size=14)


@settings(max_examples=40, deadline=None)
@given(ops=_OPS, delays=st.lists(st.sampled_from([0.0, 0.0, 0.002, 0.01]), min_size=14,
                                 max_size=14))
def test_kept_snapshots_hold_their_call_and_only_unverified_writes_give_one_up(
        ops: list[str], delays: list[float]) -> None:
    # Whatever the copy's timing, a snapshot is given up exactly when an unguarded write
    # comes between its call and the next point where the training thread checks it (a
    # guarded update, wait_staged, wait, the next snapshot); every whole slot holds the values
    # of its call, and the newest kept snapshot is whole.
    real = memory_write.copy_tensor
    timing = iter(delays * 20)

    def late(*args: Any, **kwargs: Any) -> None:
        time.sleep(next(timing, 0.0))
        real(*args, **kwargs)

    memory_write.copy_tensor = late  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _run_schedule(Path(tmp), ops)
    finally:
        memory_write.copy_tensor = real  # type: ignore[assignment]


def _loop_op(op: str, ckpt: Checkpointer, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer) -> None:
    """A schedule's training-loop operation: a step, an unguarded write, or a wait."""
    if op == "step":
        _forward_backward(model)
        optimizer.step()
    elif op == "write":
        with torch.no_grad():
            model[0].bias.add_(1.0)
    elif op == "wait_staged":
        ckpt.wait_staged()
    else:
        ckpt.wait()


def _run_schedule(folder: Path, ops: list[str]) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    expected: dict[int, list[torch.Tensor]] = {}
    kept: dict[int, bool] = {}
    pending: int | None = None  # the snapshot not yet checked
    with _ckpt(folder) as ckpt:
        for op in [*ops, "wait"]:
            if op in ("step", "wait_staged", "wait", "snapshot"):
                pending = None  # each is a point where the check runs
            if op == "snapshot":
                step = len(expected) + 1
                expected[step] = _values(model, optimizer)
                assert ckpt.snapshot(step, state)
                kept[step], pending = True, step
            else:
                if op == "write" and pending is not None:
                    kept[pending] = False
                _loop_op(op, ckpt, model, optimizer)
        whole = _whole(ckpt)
    for step, prepared in whole.items():
        assert kept[step], f"snapshot {step} is whole though a write came before its check"
        tree = prepared.trees["train"][1]
        assert torch.equal(tree["model"]["0.bias"], expected[step][1]), step
        assert torch.equal(tree["model"]["0.weight"], expected[step][0]), step
    newest_kept = max((s for s, k in kept.items() if k), default=None)
    if newest_kept is not None:
        assert newest_kept in whole, f"snapshot {newest_kept} was kept but is not whole"


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.sampled_from(["save", "step", "write", "wait_staged", "wait"]),
                    min_size=1, max_size=12),
       delays=st.lists(st.sampled_from([0.0, 0.0, 0.002, 0.01]), min_size=12, max_size=12))
def test_published_saves_hold_their_call_and_only_unverified_writes_fail_one(
        ops: list[str], delays: list[float]) -> None:
    # The same for saves with background staging: a save fails (nothing published, the next
    # save or wait raises) exactly when an unguarded write comes between its call and the
    # training thread's next check; every published checkpoint holds its call's values.
    real = staging.Staging.stage_later
    timing = iter(delays * 20)

    def late(self: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        time.sleep(next(timing, 0.0))
        return real(self, state_dict)

    staging.Staging.stage_later = late  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _run_saves(Path(tmp), ops)
    finally:
        staging.Staging.stage_later = real  # type: ignore[method-assign]


def _run_saves(folder: Path, ops: list[str]) -> None:
    import torch.distributed.checkpoint as dcp

    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    expected: dict[int, list[torch.Tensor]] = {}
    published: set[int] = set()
    pending: int | None = None  # the save not yet checked
    failed = False  # the last save failed: the next save or wait raises
    with Checkpointer(folder, async_mode="thread", background_staging=True,
                      keep_last=100) as ckpt:
        for op in [*ops, "wait"]:
            if op in ("step", "wait_staged", "wait", "save"):
                pending = None
            if op in ("save", "wait") and failed:
                failed = False
                with pytest.raises(CheckpointWriteError, match="changed while they were"):
                    ckpt.save(len(expected) + 1, state) if op == "save" else ckpt.wait()
                continue  # (a save that raises was not started)
            if op == "save":
                step = len(expected) + 1
                expected[step] = _values(model, optimizer)
                ckpt.save(step, state)
                published.add(step)
                pending = step
            else:
                if op == "write" and pending is not None:
                    published.discard(pending)
                    failed, pending = True, None
                _loop_op(op, ckpt, model, optimizer)
        complete = {c.step: c for c in ckpt.list() if c.complete}
    assert set(complete) == published
    for step, info in complete.items():
        model2, optimizer2 = _model()
        dcp.load({"train": ModelState(model2, optimizer2)}, checkpoint_id=info.url,
                 no_dist=True)
        assert _same(_values(model2, optimizer2), expected[step]), step


# ---------------------------------------------------------------------------- real ranks


def _ddp_background(rank: int, world: int, tmp: str) -> tuple[int | None, bool, int | None]:
    """Two gloo ranks under DDP, both background copies on: a save at step 10 and snapshots
    every other step, killed at step 15; restored: (step loaded, values equal, newest save)."""
    torch.manual_seed(rank)
    model, optimizer = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = {"train": ModelState(model, optimizer)}

    def checkpointer() -> Checkpointer:
        return Checkpointer(f"{tmp}/root", job_id="job", background_staging=True,
                            memory=MemoryOptions(directory=f"{tmp}/shm", background_copy=True))

    expected: list[torch.Tensor] = []
    with checkpointer() as ckpt:
        for step in range(1, 16):
            ddp(torch.randn(8, 16)).square().mean().backward()
            optimizer.step()  # waits for the copy in flight, on each rank
            optimizer.zero_grad()
            if step == 10:
                ckpt.save(step, state)
            elif step % 2 == 0:
                ckpt.snapshot(step, state)
                expected = _values(model, optimizer)
        ckpt.wait()
        latest = ckpt.latest()
        ckpt._close(finished=False)  # as a kill would leave it
    torch.manual_seed(100 + rank)
    model2, optimizer2 = _model()
    with checkpointer() as ckpt:
        loaded = ckpt.load({"train": ModelState(model2, optimizer2)})
    return loaded, _same(_values(model2, optimizer2), expected), \
        None if latest is None else latest.step


def test_both_background_copies_under_ddp_restore_the_newest_snapshot_on_every_rank(
        tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    results = run_ranks(_ddp_background, 2, str(tmp_path))
    assert [r.value for r in results] == [(14, True, 10), (14, True, 10)]
