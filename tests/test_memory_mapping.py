"""The memory tier's mapped slots and the native SIGBUS guard under them: what a second process
of the user that truncates a slot file (between snapshots, during a snapshot's copy, during its
checksums) can do, and what the job gets; and that the guard leaves every other SIGBUS alone
(the process still dies of it, through the handler that was there before).

The truncations inside a snapshot are placed by wrapping the tier's copy and hash steps so the
file is cut right before they touch it: the fault, the guard and the recovery are all real.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from streamcache import _native
from streamcache.checkpoint import memory, memory_write
from streamcache.checkpoint.guards import UpdateGuard
from streamcache.checkpoint.memory import MemoryOptions, MemoryTier
from streamcache.checkpoint.memory_format import HEADER_SIZE
from streamcache.errors import NativeError

ROOT = "file:///ckpt/run"
ROOT_ID = "0123456789abcdef" * 2
MIB = 1 << 20


def _tier(tmp_path: Path) -> MemoryTier:
    return MemoryTier(MemoryOptions(directory=str(tmp_path)), ROOT, 0, 1)


def _entries(value: float) -> dict[str, tuple[str, Any]]:
    # 6 MiB: more than one digested piece, and a copy with non-temporal stores
    return {"w": ("stateful", {"a": torch.full((3 * MIB // 2,), value), "b": torch.ones(7)}),
            "g": ("global", {"position": int(value)})}


def _snapshot(tier: MemoryTier, step: int, later: tuple[str, ...] = ()) -> tuple[bool, bool]:
    """(write's answer, whether the snapshot was then kept whole); ``later``: the entries the
    tier's thread copies (a background copy)."""
    taken = tier.write(step, _entries(float(step)), {}, timeline="", started=None,
                       committed=None, root_id=ROOT_ID, later=later)
    return taken, tier.wait() and taken


def _whole_steps(tmp_path: Path) -> list[int]:
    """Steps a fresh tier (a restart) scans and verifies, each holding its own values."""
    tier = _tier(tmp_path)
    steps = []
    for slot, summary in tier.scan():
        prepared = tier.prepare(slot, summary)
        if prepared is not None:
            assert torch.equal(prepared.trees["w"][1]["a"],
                               torch.full((3 * MIB // 2,), float(summary.step)))
            steps.append(summary.step)
    tier.close()
    return sorted(steps)


def _slot_file(tier: MemoryTier, slot: int) -> Path:
    return Path(tier.folder) / tier.slot_name(slot)


# ---------------------------------------------------------------------------- the guard


@pytest.fixture
def truncated_map(tmp_path: Path) -> Any:
    """A 8 MiB shared mapping of a file then cut to 1 MiB (its tail now faults)."""
    path = tmp_path / "mapped"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 8 * MIB)
    mapped = mmap.mmap(fd, 8 * MIB)
    array = np.frombuffer(mapped, dtype=np.uint8)
    os.ftruncate(fd, MIB)
    yield array
    os.close(fd)  # the mapping goes with the last view of it


@pytest.mark.parametrize("threads", [1, 2])
def test_a_guarded_copy_into_a_truncated_mapping_raises_and_the_process_lives(
        truncated_map: np.ndarray, threads: int) -> None:
    source = np.arange(8 * MIB, dtype=np.uint64).view(np.uint8)[: 8 * MIB]
    with _native.use("native"), pytest.raises(NativeError, match="cut short"):
        _native.stream_copy(source, truncated_map, threads=threads, guard=True)
    with _native.use("native"):  # the part still inside the file is copied as asked
        _native.stream_copy(source[:MIB], truncated_map[:MIB], guard=True)
    assert truncated_map[:MIB].tobytes() == source[:MIB].tobytes()


def test_a_guarded_hash_of_a_truncated_mapping_raises(truncated_map: np.ndarray) -> None:
    with _native.use("native"), pytest.raises(NativeError, match="cut short"):
        _native.xxh64_pieces(truncated_map, 4 * MIB, guard=True)
    with _native.use("native"):
        assert _native.xxh64_pieces(truncated_map[:MIB], 4 * MIB, guard=True) == [
            _native.xxh64(truncated_map[:MIB].copy())]


@pytest.mark.parametrize("name", _native.available_backends())
def test_piece_digests_are_the_pieces_xxh64(name: str) -> None:
    data = np.random.default_rng(3).integers(0, 256, 9 * MIB + 5, dtype=np.uint8)
    with _native.use(name):
        for piece in (4 * MIB, 1, 9 * MIB + 5, 10 * MIB):
            sample = data if piece > 1 else data[:1000]
            expected = [_native.xxh64(sample[i:i + piece])
                        for i in range(0, len(sample), piece)]
            assert _native.xxh64_pieces(sample, piece, guard=True) == expected
        assert _native.xxh64_pieces(data[:0], 4 * MIB) == []
        with pytest.raises(NativeError, match="piece must be positive"):
            _native.xxh64_pieces(data, 0)
        with pytest.raises(NativeError, match="uint8"):
            _native.xxh64_pieces(data[:64].view(np.uint16), 64)


_OTHER_SIGBUS = textwrap.dedent("""
    import faulthandler, mmap, os, sys
    import numpy as np
    from streamcache import _native
    if sys.argv[1] == "faulthandler":
        faulthandler.enable()
    fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 1 << 16)
    array = np.frombuffer(mmap.mmap(fd, 1 << 16), dtype=np.uint8)
    _native.stream_copy(np.ones(1 << 16, np.uint8), array, guard=True)  # the handler is in
    os.ftruncate(fd, 0)
    print("touching", flush=True)
    array[-1] = 1  # an unguarded store past the end: SIGBUS, as without the guard
    print("survived", flush=True)
""")


@pytest.mark.parametrize("before", ["default", "faulthandler"])
def test_a_sigbus_outside_guarded_calls_still_ends_the_process(before: str,
                                                               tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", _OTHER_SIGBUS, before, str(tmp_path / "f")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr)
    assert "touching" in result.stdout and "survived" not in result.stdout
    if before == "faulthandler":  # the handler installed before the guard's still runs
        assert "Bus error" in result.stderr


# ---------------------------------------------------------------------------- the tier


def test_a_slot_truncated_between_snapshots_is_allocated_again(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    assert _snapshot(tier, 1) == (True, True)
    assert _snapshot(tier, 2) == (True, True)
    for slot in range(2):  # another process cuts both files; the mappings stay
        os.truncate(_slot_file(tier, slot), 0)
    assert _whole_steps(tmp_path) == []
    assert _snapshot(tier, 3) == (True, True)
    assert _snapshot(tier, 4) == (True, True)
    assert _whole_steps(tmp_path) == [3, 4]
    tier.close()


@pytest.mark.parametrize("where", ["copy", "background copy", "hash"])
def test_a_slot_truncated_inside_a_snapshot_costs_that_snapshot_only(
        tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    tier = _tier(tmp_path)
    assert _snapshot(tier, 1) == (True, True)
    assert _snapshot(tier, 2) == (True, True)
    target = _slot_file(tier, 0)  # holds step 1, the older: the next snapshot's
    module, name = {"copy": (memory, "copy_tensor"),
                    "background copy": (memory_write, "copy_tensor"),
                    "hash": (memory_write, "piece_digests")}[where]
    real = getattr(module, name)

    def cut_first(*args: Any, **kwargs: Any) -> Any:
        os.truncate(target, HEADER_SIZE)  # another process, right before the tier touches it
        monkeypatch.setattr(module, name, real)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, cut_first)
    guard = UpdateGuard()
    model = torch.nn.Linear(2, 2)
    entry = SimpleNamespace(model=model, optimizers=[torch.optim.SGD(model.parameters())])
    with _native.use("native"), caplog.at_level(logging.WARNING, "streamcache.checkpoint"):
        taken = tier.write(3, _entries(3.0), {}, timeline="", started=None, committed=None,
                           root_id=ROOT_ID, later=("w",) if where == "background copy" else (),
                           hold=guard.hold([entry]))
        kept = tier.wait() and taken
    assert not guard.held  # the hold is released whatever happened
    assert not kept and taken == (where != "copy")  # the call's copy fault is known at once
    assert "cut short" in caplog.text and "not kept" in caplog.text
    assert _whole_steps(tmp_path) == [2]  # the newer slot is whole; the cut one is not used
    assert _snapshot(tier, 4) == (True, True)  # and the next snapshot repairs the file
    assert _whole_steps(tmp_path) == [2, 4]
    tier.close()


def test_a_replaced_slot_file_is_mapped_anew(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    assert _snapshot(tier, 1) == (True, True)
    assert _snapshot(tier, 2) == (True, True)
    older = _slot_file(tier, 0)
    os.unlink(older)          # another process replaces the file: the old mapping is stale
    older.write_bytes(b"x" * 100)
    older.chmod(0o600)
    assert _snapshot(tier, 3) == (True, True)
    assert _whole_steps(tmp_path) == [2, 3]
    tier.close()


def test_the_training_may_change_the_tensors_once_write_returns(tmp_path: Path) -> None:
    """The copy is made before write returns; the finishing thread reads only the slot."""
    tier = _tier(tmp_path)
    entries = _entries(5.0)
    assert tier.write(5, entries, {}, timeline="", started=None, committed=None,
                      root_id=ROOT_ID)
    entries["w"][1]["a"].fill_(-1.0)  # the next optimizer step, at once
    assert tier.wait()
    assert _whole_steps(tmp_path) == [5]
    tier.close()


def test_an_io_error_while_finishing_is_reported_and_the_previous_snapshot_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    tier = _tier(tmp_path)
    assert _snapshot(tier, 1) == (True, True)

    def failing(*args: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(memory_write, "pwrite_all", failing)  # the manifest's write, on the thread
    with caplog.at_level(logging.WARNING, "streamcache.checkpoint"):
        assert _snapshot(tier, 2) == (True, False)
    assert "writing" in caplog.text and "Input/output error" in caplog.text
    monkeypatch.undo()
    assert _whole_steps(tmp_path) == [1]
    assert _snapshot(tier, 3) == (True, True)
    assert _whole_steps(tmp_path) == [1, 3]
    tier.close()


_REPLACED = textwrap.dedent("""
    import mmap, os, signal, sys
    import numpy as np
    from streamcache import _native
    from streamcache.errors import NativeError
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 1 << 20)
    array = np.frombuffer(mmap.mmap(fd, 1 << 20), dtype=np.uint8)
    _native.stream_copy(np.ones(1 << 20, np.uint8), array, guard=True)  # the handler is in
    signal.signal(signal.SIGBUS, signal.SIG_DFL)  # a library resets SIGBUS behind its back
    os.ftruncate(fd, 0)
    try:
        _native.stream_copy(np.ones(1 << 20, np.uint8), array, guard=True)
    except NativeError as exc:
        print("caught:", exc, flush=True)
""")


def test_the_guard_holds_after_something_resets_the_sigbus_handler(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", _REPLACED, str(tmp_path / "f")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert "caught: the destination's mapped file was cut short" in result.stdout
