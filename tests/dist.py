"""Run a function in N real processes joined by torch.distributed (gloo on 127.0.0.1).

The project's own helper for multi-rank tests (not torch's private testing package)::

    from dist import run_ranks

    def _body(rank: int, world_size: int, tmp: str) -> float:   # module level: picklable
        t = torch.ones(1) * rank
        dist.all_reduce(t)
        return t.item()

    def test_sum(tmp_path):
        results = run_ranks(_body, 2, str(tmp_path))
        assert [r.value for r in results] == [1.0, 1.0]

Each rank runs in a new process with ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``,
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` set, and the default process
group initialized on gloo before ``fn(rank, world_size, *args)`` is called. By default the
process is forked from multiprocessing's fork server, which imported torch and streamcache
once for the whole session (a ``spawn`` process imports torch again: 1-2 s a rank, most of a
short test); it starts with the parent's environment and working folder, as a spawned one
does, and has started no thread of its own. ``start_method="spawn"`` gives a fresh
interpreter, for a test whose environment must be read when torch is imported
(``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, ``TORCH_CPP_LOG_LEVEL``).
A rank's return value (or its exception, as type name, message and traceback) is written to
a result file atomically, so it survives the other ranks being killed.

For crash tests, :class:`RankGroup` gives control over the running processes::

    with RankGroup(_train, 2, args=(str(tmp_path),)) as group:
        time.sleep(random.uniform(0.5, 2.0))
        group.kill()                         # SIGKILL every rank, like a node failure
    results = group.results                  # killed ranks have .killed == True

``fail_fast`` (default on) mirrors torchrun: when one rank dies, the others are killed
after ``grace_s`` instead of hanging in a collective until the timeout.

A function is sent by reference, so it must be importable (defined at module level); the
parent's ``sys.path`` is passed on. Starting a group still costs about half a second (the
process group, the fork server's first start 2-3 s), so do several phases in one function
rather than several groups in one test.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RankError", "RankGroup", "RankResult", "free_port", "process_context",
           "run_ranks", "torchrun_environment"]


@dataclass
class RankResult:
    """What one rank's process did."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    killed: bool = False

    @property
    def ok(self) -> bool:
        return self.error_type is None and self.exitcode == 0


class RankError(AssertionError):
    """One or more ranks failed, died or timed out; the message holds each rank's story."""


def torchrun_environment(node: int, local: int, per_node: int, nodes: int) -> dict[str, str]:
    """The variables torchrun sets for local rank ``local`` of node ``node`` in a job of
    ``nodes`` nodes of ``per_node`` ranks (simulated multi-node jobs fork ranks with them)."""
    return {"RANK": str(node * per_node + local), "WORLD_SIZE": str(nodes * per_node),
            "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node)}


# What the fork server imports before it forks the first process: what the ranks and the
# cache tests' processes import (the server does not get the tests folder on its sys.path:
# packages only). One server serves every caller of the session, so one list.
_PRELOAD = ["torch", "torch.distributed", "streamcache", "streamcache.checkpoint",
            "streamcache.cache.node", "streamcache.cache.prefetch",
            "fsspec.implementations.http", "pytest"]


def process_context(start_method: str = "forkserver") -> Any:
    """The multiprocessing context rank processes start with: by default fresh processes
    forked from a server (not from pytest) that did the imports once; a spawned interpreter
    would pay seconds of imports each. A fork server's children start with the server's
    environment, not the caller's (RankGroup passes the caller's on)."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method={start_method!r}: 'forkserver' or 'spawn'")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # (read when the server first starts)
    return ctx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    result_dir: str,
    backend: str | None,
    pg_timeout_s: float,
    env: dict[str, str],
) -> None:
    os.environ.clear()  # (a fork server's child starts with the server's environment)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    result = RankResult(rank)
    try:
        import torch.distributed as dist

        if backend is None:  # the function makes its groups (e.g. under NVRx's Wrapper)
            result.value = fn(rank, world_size, *args)
        else:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
            try:
                result.value = fn(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
    except BaseException as exc:
        result.error_type = type(exc).__name__
        result.error = str(exc)
        result.traceback = traceback.format_exc()
    path = os.path.join(result_dir, f"rank-{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    # Exit without running atexit handlers or joining leftover threads: a test's function
    # may leave daemon threads behind, and a rank that hangs on exit would look like a hang.
    os._exit(1 if result.error_type else 0)


class RankGroup:
    """``world_size`` processes running ``fn`` under torch.distributed; owned by the caller.

    Args:
        fn: ``fn(rank, world_size, *args)``, defined at module level.
        world_size: number of processes.
        args: extra positional arguments (picklable).
        timeout_s: :meth:`join` kills every rank and raises after this long.
        backend: process group backend ("gloo"); None: no default group is made, the
            function makes its own (an in-process restart engine such as NVRx's Wrapper
            requires that no group exists when it starts).
        env: extra environment variables for the children (on top of the parent's).
        start_method: ``"forkserver"`` (default: forks of a server that imported torch and
            streamcache) or ``"spawn"`` (fresh interpreters; see the module docstring).
        fail_fast: when a rank exits abnormally, SIGKILL the others after ``grace_s``.

    Thread safety: one owner thread.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *,
        args: Sequence[Any] = (),
        timeout_s: float = 120.0,
        backend: str | None = "gloo",
        env: dict[str, str] | None = None,
        fail_fast: bool = True,
        grace_s: float = 2.0,
        start_method: str = "forkserver",
    ) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.fail_fast = fail_fast
        self.grace_s = grace_s
        self._result_dir = tempfile.mkdtemp(prefix="streamcache-dist-")
        self._killed: set[int] = set()
        self._joined = False
        self.results: list[RankResult] = []
        ctx = process_context(start_method)
        environment = {**os.environ, **(env or {})}
        port = free_port()
        self.processes = [
            ctx.Process(
                target=_child,
                args=(fn, rank, world_size, port, tuple(args), self._result_dir, backend,
                      timeout_s, environment),
                name=f"rank-{rank}",
                # not daemonic, like torchrun's workers: a rank may start processes of its
                # own (DCP's checkpoint process, DataLoader workers); join() bounds its life
                daemon=False,
            )
            for rank in range(world_size)
        ]
        self._started = time.monotonic()
        for process in self.processes:
            process.start()

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self.processes]

    def kill(self, ranks: Sequence[int] | None = None, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default) to the given ranks (all by default)."""
        for rank in range(self.world_size) if ranks is None else ranks:
            process = self.processes[rank]
            if process.is_alive() and process.pid is not None:
                self._killed.add(rank)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, sig)

    def join(self, *, check: bool = False) -> list[RankResult]:
        """Wait for every rank (up to the timeout); returns one result per rank.

        Args:
            check: raise :class:`RankError` unless every rank returned normally.
        Raises:
            RankError: on timeout (every rank is killed first), or with ``check``.
        """
        if self._joined:  # the results were read and their folder removed
            if check and not all(r.ok for r in self.results):
                raise RankError(f"some ranks failed:\n{self.describe()}")
            return self.results
        try:
            return self._join(check)
        except BaseException:  # interrupted (a test's timeout, Ctrl-C): leave nothing behind
            self.kill()
            for process in self.processes:
                process.join(timeout=10)
            shutil.rmtree(self._result_dir, ignore_errors=True)
            raise

    def _join(self, check: bool) -> list[RankResult]:
        deadline = self._started + self.timeout_s
        first_failure: float | None = None
        timed_out = False
        while any(p.is_alive() for p in self.processes):
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                self.kill()
                break
            failed = [p for p in self.processes if p.exitcode not in (None, 0)]
            if self.fail_fast and failed and first_failure is None:
                first_failure = now
            if first_failure is not None and now - first_failure > self.grace_s:
                self.kill()
            time.sleep(0.02)
        for process in self.processes:
            process.join(timeout=10)
        self.results = [self._result(rank) for rank in range(self.world_size)]
        # the results are read: the folder goes (a rank still alive after its join timeout
        # has been SIGKILLed above, so nothing writes here any more)
        shutil.rmtree(self._result_dir, ignore_errors=True)
        self._joined = True
        if timed_out:
            raise RankError(f"ranks timed out after {self.timeout_s} s:\n{self.describe()}")
        if check and not all(r.ok for r in self.results):
            raise RankError(f"some ranks failed:\n{self.describe()}")
        return self.results

    def describe(self) -> str:
        lines = []
        for r in self.results:
            state = "killed" if r.killed else f"exit {r.exitcode}"
            lines.append(f"rank {r.rank}: {state}, value={r.value!r}, error={r.error_type}: "
                         f"{r.error}\n{r.traceback or ''}")
        return "\n".join(lines)

    def _result(self, rank: int) -> RankResult:
        path = os.path.join(self._result_dir, f"rank-{rank}.pkl")
        result = RankResult(rank)
        if os.path.exists(path):
            with open(path, "rb") as f:
                result = pickle.load(f)
        result.exitcode = self.processes[rank].exitcode
        result.killed = rank in self._killed or result.exitcode == -signal.SIGKILL
        return result

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.kill()
        self.join()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    start_method: str = "forkserver",
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on every rank; the per-rank results.

    Raises:
        RankError: a rank raised (its traceback is in the message), died, or the run timed
            out; every rank is killed before it is raised.
    """
    group = RankGroup(fn, world_size, args=args, timeout_s=timeout_s, env=env,
                      start_method=start_method)
    return group.join(check=True)
