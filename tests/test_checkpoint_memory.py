"""The Checkpointer's memory tier (checkpoint/memory.py): round trips, the choice between tiers,
its files as untrusted input, and SIGKILL at random moments inside snapshots.

The crash test forks its snapshotting children from the test process (torch is already
imported there), so each kill-and-restore round costs milliseconds, not an interpreter start.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist import run_ranks
from seeds import schedule_seed

from streamcache.checkpoint import Checkpointer, CheckpointError, ModelState
from streamcache.checkpoint.memory import MemoryOptions, MemoryTier
from streamcache.checkpoint.memory_format import (
    HEADER_SIZE,
    PIECE_BYTES,
    RootView,
    SlotSummary,
    choose,
    decode_tree,
    encode_tree,
)

ROOT = "file:///ckpt/run"
ROOT_ID = "0123456789abcdef" * 2
# a single-process DCP save warns that there is no process group
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, optimizer)
    return model, optimizer


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _values(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    values = [p.detach().clone() for p in model.parameters()]
    for per_param in optimizer.state.values():
        values += [v.clone() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return values


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _ckpt(tmp_path: Path, **kw: Any) -> Checkpointer:
    (tmp_path / "shm").mkdir(exist_ok=True)
    return Checkpointer(tmp_path / "root", memory=MemoryOptions(directory=str(tmp_path / "shm")),
                        **kw)


class _Counter:
    """A global state (like the loader's cursor)."""

    global_state = True

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


# ---------------------------------------------------------------------------- round trips

def test_snapshot_restores_model_optimizer_globals_extras_and_rng_in_a_new_checkpointer(
        tmp_path: Path) -> None:
    model, optimizer = _model()
    counter = _Counter()
    state = {"model": model, "optim": optimizer, "cursor": counter,
             "extra": {"epoch": 2, "pair": (1, 2.5), 3: None}}
    with _ckpt(tmp_path) as ckpt:
        counter.position = 40
        assert ckpt.snapshot(7, state)
        expected, draw = _values(model, optimizer), (random.random(), torch.rand(1))
        ckpt._close(finished=False)            # as a kill would leave it
    _train(model, optimizer, 2)
    counter.position, state["extra"] = 99, {"epoch": 0, "pair": (0, 0), 3: None}
    with _ckpt(tmp_path) as ckpt:  # a restart: a new Checkpointer finds the snapshot
        assert ckpt.load(state) == 7
    assert _same(_values(model, optimizer), expected)
    assert counter.position == 40 and state["extra"] == {"epoch": 2, "pair": (1, 2.5), 3: None}
    assert (random.random(), torch.rand(1)) == draw  # the RNG streams continue exactly


def test_a_kill_inside_a_snapshot_restores_the_previous_one(tmp_path: Path) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    with _ckpt(tmp_path) as ckpt:
        ckpt.snapshot(1, state)
        expected = _values(model, optimizer)
        _train(model, optimizer)
        ckpt.snapshot(2, state)
        tier = ckpt._memory
        assert tier is not None
        newest = max(tier.scan(), key=lambda found: found[1].seq)[0]
        _tear(Path(tier.folder) / tier.slot_name(newest), HEADER_SIZE + 100)
        assert ckpt.load(state) == 1
    assert _same(_values(model, optimizer), expected)


def test_save_snapshots_too_and_the_newer_tier_wins(tmp_path: Path) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    with _ckpt(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(10, state)                   # disk and memory: step 10
        _train(model, optimizer)
        ckpt.snapshot(12, state)               # memory only
        expected = _values(model, optimizer)
        ckpt._close(finished=False)
    _train(model, optimizer)
    with _ckpt(tmp_path, async_mode="sync") as ckpt:
        assert ckpt.load(state) == 12          # memory is newer than the disk
        assert _same(_values(model, optimizer), expected)
        ckpt.save(14, state)
        ckpt._close(finished=False)
    shm = tmp_path / "shm"
    for path in shm.rglob("rank*"):            # the memory tier is lost (a reboot)
        path.unlink()
    with _ckpt(tmp_path, async_mode="sync") as ckpt:
        assert ckpt.load(state) == 14          # the disk tier


def test_snapshots_that_do_not_continue_the_root_are_not_used(tmp_path: Path) -> None:
    """A root wiped, or saved by another job since: the memory tier yields to the disk."""
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    with _ckpt(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(5, state)
        ckpt.snapshot(6, state)
        ckpt._close(finished=False)          # a crash: the snapshots stay
    with Checkpointer(tmp_path / "root", async_mode="sync") as other:  # no memory tier
        other.load(state)
        other.save(20, state)                  # the root moved on without these snapshots
    with _ckpt(tmp_path, async_mode="sync") as ckpt:
        assert ckpt.load(state) == 20
    with _ckpt(tmp_path, async_mode="sync") as ckpt:
        ckpt.snapshot(21, state)
        ckpt._close(finished=False)
    for path in (tmp_path / "root").iterdir():  # the root wiped
        if path.is_dir():
            for inner in path.iterdir():
                inner.unlink()
            path.rmdir()
    with _ckpt(tmp_path, async_mode="sync") as ckpt:
        assert ckpt.load(state) is None        # the snapshot of step 21 is not trusted


def test_a_snapshot_that_does_not_match_the_state_falls_back_to_the_disk(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = _model()
    with _ckpt(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(3, {"train": ModelState(model, optimizer)})
        ckpt.snapshot(4, {"train": ModelState(model, optimizer), "more": 1})
        ckpt._close(finished=False)
    with caplog.at_level(logging.WARNING), _ckpt(tmp_path, async_mode="sync") as ckpt:
        assert ckpt.load({"train": ModelState(model, optimizer)}) == 3
    assert "does not match the given state" in caplog.text


def test_clean_close_removes_the_slots_and_an_error_keeps_them(tmp_path: Path) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    shm = tmp_path / "shm"
    with pytest.raises(RuntimeError), _ckpt(tmp_path) as ckpt:
        ckpt.snapshot(1, state)
        raise RuntimeError("a fault inside the step")
    assert len(list(shm.rglob("rank0-slot*"))) == 1
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.load(state) == 1
    assert list(shm.rglob("rank0-slot*")) == []


def test_the_default_directory_is_dev_shm_and_is_cleaned(tmp_path: Path) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    model, optimizer = _model()
    with Checkpointer(tmp_path / "root", memory=True) as ckpt:
        ckpt.snapshot(1, {"train": ModelState(model, optimizer)})
        folder = Path(ckpt._memory.folder)  # type: ignore[union-attr]
        assert str(folder).startswith(f"/dev/shm/streamcache-mem-{os.geteuid()}/")
        assert len(list(folder.iterdir())) == 1
    assert not folder.exists()


def test_a_value_that_cannot_be_kept_is_a_clear_error(tmp_path: Path) -> None:
    with _ckpt(tmp_path) as ckpt, pytest.raises(CheckpointError, match="cannot be kept"):
        ckpt.snapshot(1, {"extra": {"when": object()}})


def test_tree_codec_round_trips_and_refuses_what_it_does_not_write() -> None:
    tensors: list[torch.Tensor] = []
    value = {"a": [1, 2.5, None, True, "s"], 7: (torch.ones(2), {"x": ()})}
    encoded = json.loads(json.dumps(encode_tree(value, tensors)))
    decoded = decode_tree(encoded, tensors)
    assert decoded["a"] == value["a"] and decoded[7][1] == {"x": ()}
    assert decoded[7][0] is tensors[0]
    for bad in ({"t": 5}, {"t": True}, {"z": []}, {"d": [[{"l": []}, 1]]}, {"d": [[1]]},
                {"l": 3}, [1, 2], {"t": 0, "l": []}):
        with pytest.raises(ValueError):
            decode_tree(bad, tensors)


def test_choose_takes_the_newest_step_every_rank_holds_and_not_older_than_the_disk() -> None:
    def slot(step: int, rank: int, world: int = 2, committed: str | None = "c",
             root_id: str = ROOT_ID) -> SlotSummary:
        return SlotSummary(step, step, rank, world, None, committed, root_id)

    def root(latest: tuple[str, int] | None, root_id: str | None = ROOT_ID) -> RootView:
        return RootView(latest, root_id)

    both = [[slot(10, 0), slot(12, 0)], [slot(10, 1), slot(12, 1)]]
    assert choose(both, root(("c", 8))) == 12
    cut = [[slot(10, 0), slot(12, 0)], [slot(10, 1)]]  # rank 1 was killed inside step 12
    assert choose(cut, root(("c", 8))) == 10
    assert choose(both, root(("c", 14))) is None        # the disk is newer
    assert choose(both, root(("other", 8))) is None     # the root moved on
    assert choose([[slot(10, 0, world=3)], [slot(10, 1, world=3)]], root(("c", 8))) is None
    assert choose([[slot(10, 1)], [slot(10, 0)]], root(("c", 8))) is None  # ranks swapped
    fresh = [[slot(10, 0, committed=None)], [slot(10, 1, committed=None)]]
    assert choose(fresh, root(None)) == 10              # nothing committed yet, same root
    assert choose(fresh, root(None, root_id=None)) is None       # the root was deleted
    assert choose(fresh, root(None, root_id="f" * 32)) is None   # ... and made again
    assert choose(both, root(("c", 8), root_id=None)) is None


# ---------------------------------------------------------------------------- untrusted files

def _tier(tmp_path: Path, root: str = ROOT, rank: int = 0, world: int = 1) -> MemoryTier:
    return MemoryTier(MemoryOptions(directory=str(tmp_path)), root, rank, world)


def _entries(value: float) -> dict[str, tuple[str, Any]]:
    return {"w": ("stateful", {"a": torch.full((1000,), value), "b": torch.full((3, 5), value)}),
            "g": ("global", {"position": int(value)})}


def _write(tier: MemoryTier, step: int) -> None:
    """A snapshot of ``step``, whole (its finishing thread done)."""
    assert tier.write(step, _entries(float(step)), {}, timeline="", started=None,
                      committed=None, root_id=ROOT_ID)
    assert tier.wait()


def test_a_forked_child_finishes_its_snapshots_with_a_thread_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tier keeps its finishing thread between snapshots; a child forked after the parent
    # made it (a DataLoader worker, NVRx's monitor process) does not have that thread: a
    # snapshot handed to it would never finish, and one the parent's thread was finishing
    # when the child was forked is not the child's to wait for.
    tier = _tier(tmp_path)
    _write(tier, 1)  # the parent's finishing thread exists from here on
    finishing = threading.Event()
    finish = tier._finish
    monkeypatch.setattr(tier, "_finish", lambda *args: (finishing.wait(30), finish(*args)))
    assert tier.write(2, _entries(2.0), {}, timeline="", started=None, committed=None,
                      root_id=ROOT_ID)  # still being finished when the child is forked
    monkeypatch.undo()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(20)  # (a snapshot waiting for the parent's thread: killed here)
            # numpy builds the tensor: no torch kernel runs in a forked child
            entries = {"w": ("stateful", {"a": torch.from_numpy(np.full(1000, 2.0, np.float32))})}
            ok = tier.write(3, entries, {}, timeline="", started=None, committed=None,
                            root_id=ROOT_ID)
            code = 0 if ok and tier.wait() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    finishing.set()
    assert os.waitstatus_to_exitcode(status) == 0
    assert tier.wait()  # the parent's snapshot of step 2, finished by the parent's thread
    _write(tier, 4)  # the parent's own thread still finishes the parent's snapshots
    tier.close()


def _restorable(tier: MemoryTier) -> list[int]:
    """Steps whose slots scan and verify whole."""
    steps = []
    for slot, summary in tier.scan():
        prepared = tier.prepare(slot, summary)
        if prepared is not None:
            expected = torch.full((1000,), float(summary.step))
            assert torch.equal(prepared.trees["w"][1]["a"], expected)
            steps.append(summary.step)
    return sorted(steps)


def _slot_path(tier: MemoryTier, step: int) -> Path:
    slot = next(slot for slot, s in tier.scan() if s.step == step)
    return Path(tier.folder) / tier.slot_name(slot)


def _tear(path: Path, offset: int, data: bytes = b"\xff" * 8) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage", ["header", "header_digest", "tensor", "manifest", "truncate",
                                    "zeros", "garbage", "huge_manifest", "bad_extent"])
def test_a_damaged_slot_is_ignored_and_the_other_restores(tmp_path: Path, damage: str,
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    tier = _tier(tmp_path)
    _write(tier, 1)
    _write(tier, 2)
    path = _slot_path(tier, 2)
    size = path.stat().st_size
    if damage == "header":
        _tear(path, 0)
    elif damage == "header_digest":
        _tear(path, 20, b"\x01")              # the step field: the header's digest catches it
    elif damage == "tensor":
        _tear(path, HEADER_SIZE + 8)
    elif damage == "manifest":
        _tear(path, size - 20)
    elif damage == "truncate":
        os.truncate(path, size // 2)
    elif damage == "zeros":
        path.write_bytes(bytes(size))
    elif damage == "garbage":
        path.write_bytes(os.urandom(size))
    elif damage in ("huge_manifest", "bad_extent"):
        _rewrite_manifest(path, damage)
    with caplog.at_level(logging.WARNING):
        assert _restorable(_tier(tmp_path)) == [1]
    if damage != "zeros":  # zeroes are an empty slot, which needs no warning
        assert "memory tier" in caplog.text


def _rewrite_manifest(path: Path, damage: str) -> None:
    """Rewrite a slot's manifest and reseal its header, as a writer of the file could."""
    def edit(doc: dict[str, Any]) -> None:
        if damage == "bad_extent":
            doc["tensors"][0]["nbytes"] = 1 << 40   # claims far more than the file holds

    _reseal(path, edit, manifest_len=None if damage == "bad_extent" else 1 << 40)


def _reseal(path: Path, edit: Any, *, manifest_len: int | None = None) -> None:
    """Edit a slot's manifest and reseal it, as any writer of the file could.

    ``edit(doc)`` changes the manifest in place and returns the new length of the data region
    (or None: unchanged); the manifest is written after it (a larger region extends the file
    sparsely) and the header gets its new place, length and digest."""
    from streamcache import _native
    from streamcache.checkpoint.memory_format import Header, pack_header, unpack_header
    raw = path.read_bytes()
    header = unpack_header(raw[:HEADER_SIZE], len(raw), _native.xxh64)
    doc = json.loads(raw[header.manifest_offset: header.manifest_offset + header.manifest_len])
    data_len = edit(doc)
    body = json.dumps(doc).encode()
    data_len = header.data_len if data_len is None else data_len
    new = Header(header.seq, header.step, data_len, HEADER_SIZE + data_len,
                 len(body) if manifest_len is None else manifest_len, _native.xxh64(body))
    with open(path, "r+b") as f:
        f.seek(header.manifest_offset)
        f.write(bytes(header.manifest_len))     # the old manifest's place may be data now
        f.seek(new.manifest_offset)
        f.write(body)
        f.truncate(new.manifest_offset + len(body))
        f.seek(0)
        f.write(pack_header(new, _native.xxh64))


def test_another_roots_files_are_not_taken(tmp_path: Path) -> None:
    mine, other = _tier(tmp_path, ROOT), _tier(tmp_path, "file:///other/run")
    assert mine.folder != other.folder                  # two jobs never share a folder
    _write(other, 5)
    for slot in (0, 1):                                  # copied into this root's folder
        src = Path(other.folder) / other.slot_name(slot)
        if src.exists():
            (Path(mine.folder) / mine.slot_name(slot)).write_bytes(src.read_bytes())
            os.chmod(Path(mine.folder) / mine.slot_name(slot), 0o600)
    assert _restorable(_tier(tmp_path, ROOT)) == []


def test_links_and_loose_permissions_are_refused(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    _write(tier, 1)
    _write(tier, 2)
    target = _slot_path(tier, 2)
    elsewhere = tmp_path / "elsewhere"
    os.rename(target, elsewhere)
    os.symlink(elsewhere, target)                       # a link to a valid snapshot
    assert _restorable(_tier(tmp_path)) == [1]
    os.unlink(target)
    os.link(elsewhere, target)                          # a hard link to it
    assert _restorable(_tier(tmp_path)) == [1]
    os.unlink(target)
    os.rename(elsewhere, target)
    os.chmod(target, 0o644)                             # readable by others: not ours alone
    assert _restorable(_tier(tmp_path)) == [1]
    os.chmod(target, 0o600)
    assert _restorable(_tier(tmp_path)) == [1, 2]
    writer = _tier(tmp_path)                            # a link is replaced, never followed
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path1 = _slot_path(writer, 1)
    os.unlink(path1)
    os.symlink(victim, path1)
    _write(writer, 3)
    assert victim.read_bytes() == b"keep"
    assert _restorable(_tier(tmp_path)) == [2, 3]


def test_a_folder_that_is_not_private_is_refused(tmp_path: Path) -> None:
    base = tmp_path / f"streamcache-mem-{os.geteuid()}"
    base.mkdir(mode=0o777)
    os.chmod(base, 0o777)
    with pytest.raises(CheckpointError, match="not a private folder"):
        _tier(tmp_path)
    base.rmdir()
    os.symlink(tmp_path / "somewhere", base)
    (tmp_path / "somewhere").mkdir(mode=0o700)
    with pytest.raises(CheckpointError, match="not a private folder"):
        _tier(tmp_path)


def test_a_full_filesystem_skips_the_snapshot_and_keeps_the_previous(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = _tier(tmp_path)
    _write(tier, 1)
    limited = MemoryTier(MemoryOptions(directory=str(tmp_path), max_bytes=5_000), ROOT, 0, 1)
    with caplog.at_level(logging.WARNING):
        assert not limited.write(2, _entries(2.0), {}, timeline="", started=None,
                                 committed=None, root_id=ROOT_ID)
    assert "not kept" in caplog.text
    assert _restorable(_tier(tmp_path)) == [1]
    # the filesystem itself full: a child process whose file size limit is one snapshot
    ctx = mp.get_context("fork")
    child = ctx.Process(target=_write_under_fsize_limit, args=(str(tmp_path),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert _restorable(_tier(tmp_path)) == [1]


def _write_under_fsize_limit(directory: str) -> None:
    import resource
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    tier = MemoryTier(MemoryOptions(directory=directory), ROOT, 0, 1)
    # numpy builds the tensor: no torch kernel runs in a forked child (OpenMP did not fork)
    big = {"w": ("stateful", {"a": torch.from_numpy(np.zeros(1 << 20, dtype=np.float32))})}
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    ok = tier.write(2, big, {}, timeline="", started=None, committed=None, root_id=ROOT_ID)
    os._exit(0 if ok is False else 3)


# ---------------------------------------------------------------------------- SIGKILL

def _snapshot_loop(directory: str, rank: int, world: int, barrier: Any, done: Any,
                   first: int, background: bool) -> None:
    """One rank: snapshots of steps first, first+1, ... (values = step), in lockstep; with
    ``background``, the tier's thread copies the tensors (a background copy)."""
    tier = MemoryTier(MemoryOptions(directory=directory), ROOT, rank, world)
    # one tensor spanning two digested pieces and a small one; numpy fills them (no torch
    # kernel runs in a forked child: its OpenMP threads did not survive the fork)
    step = first
    while True:
        big = torch.from_numpy(np.full(PIECE_BYTES // 4 + 333, step, dtype=np.float32))
        small = torch.from_numpy(np.full(7, step, dtype=np.float32))
        entries = {"w": ("stateful", {"big": big, "small": small}),
                   "g": ("global", {"position": step})}
        tier.write(step, entries, {"step": step}, timeline="", started=None, committed=None,
                   root_id=ROOT_ID, later=("w",) if background else ())
        tier.wait()                                  # its checksums and header are written
        done[rank] = step                           # so this rank's snapshot is whole
        barrier.wait()                               # lockstep, as a collective in training
        step += 1


def _agreed_step(directory: str, world: int) -> int | None:
    tiers = [MemoryTier(MemoryOptions(directory=directory), ROOT, r, world) for r in range(world)]
    found = [t.scan() for t in tiers]
    step = choose([[s for _, s in f] for f in found], RootView(None, ROOT_ID))
    if step is None:
        return None
    for tier, slots in zip(tiers, found, strict=True):
        slot, summary = max(((i, s) for i, s in slots if s.step == step),
                            key=lambda item: item[1].seq)
        prepared = tier.prepare(slot, summary)
        assert prepared is not None, f"rank {tier.rank}: step {step} does not verify"
        big = prepared.trees["w"][1]["big"]
        assert torch.equal(big, torch.full_like(big, float(step))), "a torn snapshot"
        assert prepared.trees["g"][1] == {"position": step}
        tier.discard_after(step)
    return step


@pytest.mark.parametrize("background", [False, True], ids=["in-call copy", "background copy"])
def test_no_sigkill_inside_snapshots_loses_a_committed_step_or_loads_a_torn_one(
        tmp_path: Path, background: bool) -> None:
    seed = schedule_seed("STREAMCACHE_MEMORY_CRASH_SEED")
    chooser = random.Random(seed)
    ctx = mp.get_context("fork")
    world, first = 2, 0
    for round_ in range(12):
        barrier, done = ctx.Barrier(world), ctx.Array("q", [-1] * world, lock=False)
        ranks = [ctx.Process(target=_snapshot_loop,
                             args=(str(tmp_path), r, world, barrier, done, first,
                                   background))
                 for r in range(world)]
        for process in ranks:
            process.start()
        time.sleep(chooser.uniform(0.05, 0.4))
        victims = [chooser.randrange(world)] if chooser.random() < 0.7 else list(range(world))
        for r in victims:
            os.kill(ranks[r].pid, signal.SIGKILL)   # type: ignore[arg-type]
        for r in set(range(world)) - set(victims):
            time.sleep(chooser.uniform(0, 0.05))    # the others die a little later
            os.kill(ranks[r].pid, signal.SIGKILL)   # type: ignore[arg-type]
        for process in ranks:
            process.join()
        committed = min(done[:])                     # every rank returned from this step
        restored = _agreed_step(str(tmp_path), world)
        if committed >= first:
            assert restored is not None and restored >= committed, (
                f"round {round_}: committed step {committed}, restored {restored} (seed {seed})")
        first = (restored if restored is not None else first - 1) + 1
    assert first > 1  # the rounds made progress


def test_restore_of_100_mb_takes_a_fraction_of_a_second(tmp_path: Path) -> None:
    """Not a timing assertion (benchmarks time it): the 100 MB path runs and verifies."""
    tier = _tier(tmp_path)
    state = {"w": ("stateful", {f"p{i}": torch.full((2_500_000,), float(i)) for i in range(10)})}
    assert tier.write(1, state, {}, timeline="", started=None, committed=None,
                      root_id=ROOT_ID)
    slot, summary = tier.scan()[0]
    prepared = tier.prepare(slot, summary)
    assert prepared is not None
    assert float(prepared.trees["w"][1]["p9"][0]) == 9.0
    assert sum(t.numel() * 4 for t in prepared.trees["w"][1].values()) == 100_000_000
    np.testing.assert_array_equal(prepared.trees["w"][1]["p3"].numpy()[:5], np.full(5, 3.0))


def test_each_job_has_its_own_folder_and_the_next_job_reclaims_an_old_one(
        tmp_path: Path) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    with _ckpt(tmp_path, job_id="job-a") as ckpt:
        ckpt.snapshot(1, state)
        folder_a = Path(ckpt._memory.folder)  # type: ignore[union-attr]
        ckpt._close(finished=False)           # job a was killed for good
    with _ckpt(tmp_path, job_id="job-b") as ckpt:
        assert Path(ckpt._memory.folder) != folder_a  # type: ignore[union-attr]
        assert ckpt.load(state) is None       # job a's snapshots are not job b's
        assert folder_a.exists()
        ckpt.snapshot(2, state)               # job b holds the root's lease now
        assert not folder_a.exists()


# ---------------------------------------------------------------------------- whose root

@pytest.mark.parametrize("committed_save", [False, True])
def test_a_fresh_run_on_a_deleted_root_does_not_restore_the_deleted_runs_snapshots(
        tmp_path: Path, committed_save: bool) -> None:
    """Run 1 snapshots and dies; the user deletes the root and starts run 2 with the same job
    id: run 2 starts fresh. With a committed save, its own snapshot (taken inside the first
    save, when nothing was committed yet) must not come back either."""
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    with _ckpt(tmp_path, job_id="job", async_mode="sync") as ckpt:
        if committed_save:
            ckpt.save(5, state)
        else:
            ckpt.snapshot(10, state)
        ckpt._close(finished=False)            # killed: the snapshots stay
    shutil.rmtree(tmp_path / "root")           # the user starts over
    _train(model, optimizer)
    fresh = _values(model, optimizer)
    with _ckpt(tmp_path, job_id="job", async_mode="sync") as ckpt:
        assert ckpt.load(state) is None
        assert _same(_values(model, optimizer), fresh)
        ckpt.snapshot(3, state)                # run 2's own snapshots restore as before
        ckpt._close(finished=False)
    with _ckpt(tmp_path, job_id="job", async_mode="sync") as ckpt:
        assert ckpt.load(state) == 3


def test_a_root_id_that_is_not_ours_is_replaced_and_the_snapshots_do_not_match(
        tmp_path: Path) -> None:
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    with _ckpt(tmp_path, job_id="job") as ckpt:
        ckpt.snapshot(1, state)
        ckpt._close(finished=False)
    root_file = tmp_path / "root" / "ROOT.json"
    for hostile in (b"[" * 5000, b'{"id": "../../x"}', b"\x00" * 10, b'{"id": 7}'):
        root_file.write_bytes(hostile)
        with _ckpt(tmp_path, job_id="job") as ckpt:
            assert ckpt.load(state) is None    # no id: nothing in memory continues it
            ckpt.snapshot(2, state)            # the lease holder writes a new one
            ckpt._close(finished=False)
        assert json.loads(root_file.read_bytes())["id"] != hostile
        with _ckpt(tmp_path, job_id="job") as ckpt:
            assert ckpt.load(state) == 2
            ckpt._close(finished=False)


# ---------------------------------------------------------------------------- resealed slots

def _disk_then_snapshot(tmp_path: Path) -> tuple[dict[str, Any], list[torch.Tensor], Path]:
    """A committed save of step 3, then a snapshot of step 4 (other values), then a kill;
    returns the state (trained on since), the values of step 3 and the slot of step 4."""
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer), "extra": {"epoch": 3}}
    with _ckpt(tmp_path, async_mode="sync") as ckpt:
        ckpt.save(3, state)
        on_disk = _values(model, optimizer)
        _train(model, optimizer)
        state["extra"] = {"epoch": 4}
        ckpt.snapshot(4, state)
        tier = ckpt._memory
        assert tier is not None
        slot = _slot_path(tier, 4)
        ckpt._close(finished=False)
    _train(model, optimizer)
    state["extra"] = {"epoch": 9}
    return state, on_disk, slot


def _zero_digest() -> int:
    from streamcache import _native
    return int(_native.xxh64(bytes(PIECE_BYTES)))


def _renumber(tree: Any, count: int) -> None:
    """Tensor references of a state tree after its first tensor moved to the table's end."""
    if isinstance(tree, dict) and set(tree) == {"t"}:
        tree["t"] = (tree["t"] - 1) % count
    elif isinstance(tree, dict):
        for value in tree.values():
            _renumber(value, count)
    elif isinstance(tree, list):
        for value in tree:
            _renumber(value, count)


def _peak_rss_since_reset() -> tuple[int, int]:
    """(this process's resident set now, its peak since the last reset), in bytes."""
    with open("/proc/self/status") as f:
        status = f.read()
    now = int(status.split("VmRSS:")[1].split()[0]) * 1024
    peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
    return now, peak


@pytest.mark.parametrize("hostile", ["rng", "rng_types", "huge_shape", "claim_2_gib"])
def test_a_resealed_slot_with_hostile_values_changes_nothing_and_the_disk_tier_loads(
        tmp_path: Path, hostile: str, caplog: pytest.LogCaptureFixture) -> None:
    """A slot a writer of the folder edited and resealed (digests recomputed): nothing of it is
    applied, the load falls back to the disk tier, and what is allocated is bounded by the
    state restored into, not by what the slot claims."""
    state, on_disk, slot = _disk_then_snapshot(tmp_path)

    def edit(doc: dict[str, Any]) -> int | None:
        record = doc["tensors"][0]
        if hostile == "rng":
            doc["rng"]["python"] = [3, [1, 2, 3], None]   # not a Mersenne Twister state
        elif hostile == "rng_types":
            doc["rng"] = {"version": 1, "python": "x", "numpy": 7, "torch": [], "cuda": {}}
        elif hostile == "huge_shape":
            record.update(shape=[10**30, 0], nbytes=0, digests=[])
        else:  # the first tensor claims 2 GiB past the others: a sparse file of zeros
            end = max(r["offset"] + r["nbytes"] for r in doc["tensors"])
            offset, nbytes = (end + 63) // 64 * 64, 2 << 30
            record.update(dtype="uint8", shape=[nbytes], nbytes=nbytes, offset=offset,
                          digests=[_zero_digest()] * (nbytes // PIECE_BYTES))
            doc["tensors"] = [*doc["tensors"][1:], record]  # extents stay in order
            for entry in doc["entries"].values():
                _renumber(entry["tree"], len(doc["tensors"]))
            return offset + nbytes
        return None

    _reseal(slot, edit)
    if hostile == "claim_2_gib":
        assert slot.stat().st_size > 2 << 30 and slot.stat().st_blocks * 512 < 64 << 20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                            # the peak counts from here
    before, _ = _peak_rss_since_reset()
    with caplog.at_level(logging.WARNING), _ckpt(tmp_path, async_mode="sync") as ckpt:
        assert ckpt.load(state) == 3
    _, peak = _peak_rss_since_reset()
    assert _same(_values(state["train"].model, state["train"].optimizers[0]), on_disk)
    assert state["extra"] == {"epoch": 3}
    assert "memory tier" in caplog.text
    assert peak - before < 400 << 20, f"the load peaked {(peak - before) >> 20} MB above its start"


# ---------------------------------------------------------------------------- several ranks

def _snapshots_after_a_restore(rank: int, world: int, tmp: str) -> list[int | None]:
    """save(20), snapshots 21 and 24, killed; restored; snapshots 27 and 30, killed;
    restored: the steps each load returned."""
    model, optimizer = _model()
    state = {"train": ModelState(model, optimizer)}
    loaded: list[int | None] = []

    def checkpointer() -> Checkpointer:
        return Checkpointer(f"{tmp}/root", memory=MemoryOptions(directory=f"{tmp}/shm"),
                            job_id="job", async_mode="sync")

    with checkpointer() as ckpt:
        ckpt.save(20, state)
        ckpt.snapshot(21, state)
        ckpt.snapshot(24, state)
        ckpt._close(finished=False)
    for steps in ((27, 30), ()):
        with checkpointer() as ckpt:
            loaded.append(ckpt.load(state))
            for step in steps:
                ckpt.snapshot(step, state)
            ckpt._close(finished=False)
    return loaded


def test_snapshots_taken_after_a_memory_restore_restore_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    results = run_ranks(_snapshots_after_a_restore, 2, str(tmp_path))
    assert [r.value for r in results] == [[24, 30], [24, 30]]
