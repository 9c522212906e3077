"""Chaos benchmark: goodput of a data-parallel job whose ranks are killed at random times.

N gloo ranks train a 2.4M-parameter MLP (784-1024-1024-512-10, AdamW, 64 samples per rank
per step) for T seconds while this driver injects faults at seeded Poisson times: SIGKILL of
a rank's process, or an exception raised inside a rank's step. Each row restarts the job
with the engine under test:

- ``dataloader_dcp``: torch DataLoader + DistributedSampler, synchronous DCP every
  ``--save-every`` steps, torchrun restarts every process; a resume loads the weights and
  restarts the interrupted epoch from its beginning (what a plain DataLoader can do).
- ``streamcache_torchrun``: StreamDataset/StreamLoader + Checkpointer (async, local root)
  every ``--save-every`` steps; torchrun restarts every process.
- ``streamcache_torchrun_warm``: the same, launched by torchrun's engine through its Python
  API (``torch.distributed.launcher.api.elastic_launch``, the agent torchrun runs) with
  ``start_method="forkserver"`` and torch, ``torch._dynamo`` (which constructing any torch
  optimizer imports: 1.1 s), DCP and streamcache preloaded in the forkserver: the processes
  torchrun restarts after a SIGKILL start with those imports done (docs/recovery.md).
- ``streamcache_nvrx``: the torchrun row under NVIDIA Resiliency Extension's in-process
  restart (``nvidia_resiliency_ext.inprocess.Wrapper``, inside torchrun), with the Checkpointer's
  memory tier: a snapshot every ``--snapshot-every`` steps besides the disk saves. A raised
  fault restarts the training function in the surviving processes (model, optimizer, loader
  and imports kept); a SIGKILL still restarts every process through torchrun, which then
  restores from the memory tier.
- ``streamcache_nvrx_warm``: the NVRx row, launched as the torchrun_warm row is (NVRx
  preloaded too).

Per row it reports goodput (the final step reached in T / the steps the same row makes in T
without faults), restart time (fault to the first new step on every rank) p50/p95 per kind
of fault, steps redone, samples re-read (a sample of an epoch in the final trajectory more
than once) and how many of the final trajectory's global batches equal the clean run's.
It also times ``import streamcache`` and the memory tier (snapshot cost against the step
time; a 100 MB restore).

Run (the full measurement, on a quiet machine):

    python benchmarks/bench_chaos.py --seconds 180 --mtbf 30
    python benchmarks/bench_chaos.py --quick        # 40 s rows, a fault every ~12 s

Results: JSON in benchmarks/out/chaos.json; the table of the last full run is in
benchmarks/RESULTS.md ("Recovery under faults") and its reading in docs/recovery.md. Last full
run (2026-12-02, load average 27 -> 8-13, other
engineers' work throughout): goodput 33% (dataloader_dcp), 48% (streamcache_torchrun), 62%
(streamcache_nvrx), 66% (streamcache_nvrx_warm); raised-fault restarts 25-33 s, SIGKILL
restarts 20.5 s (torchrun) and 11.4 s (warm); 0 samples re-read and every batch equal to the
clean run's on the streamcache rows; snapshot 0.046-0.049 s per 0.135-0.146 s step. Quiet
runs of the torchrun rows with the restart recipe (2026-12-05, SIGKILLs only, T = 150 s):
goodput 87.5-92.7% and SIGKILL restarts 3.3-3.9 s p50 (torchrun), 99.4% and 0.47 s
(torchrun_warm).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROWS = ("dataloader_dcp", "streamcache_torchrun", "streamcache_torchrun_warm",
        "streamcache_nvrx", "streamcache_nvrx_warm")
# modules a restarted process of the _warm rows finds imported (forked from torch elastic's
# forkserver, which imported them once)
# (a module that is not installed, NVRx on the torchrun_warm row's machine, is skipped)
WARM_MODULES = ["__main__", "torch", "torch._dynamo", "torch.optim", "torch.nn.parallel",
                "torch.distributed.checkpoint", "streamcache.loading.loader",
                "streamcache.checkpoint", "nvidia_resiliency_ext.inprocess"]
BATCH = 64  # per rank
FEATURES = 784


@dataclass
class Config:
    row: str
    run_dir: str
    data_dir: str
    seconds: float
    save_every: int
    snapshot_every: int
    seed: int


# ---------------------------------------------------------------------------- the data

def make_data(data_dir: Path, samples: int) -> None:
    """The same samples twice: a streamcache dataset (defaults) and .npy files for the
    DataLoader row. Sample i's features are a function of i, so its id identifies it."""
    import numpy as np

    from streamcache import ShardWriter

    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, FEATURES), dtype=np.float32)
    y = (np.arange(samples) % 10).astype(np.int64)
    np.save(data_dir / "x.npy", x)
    np.save(data_dir / "y.npy", y)
    with ShardWriter(str(data_dir / "ds")) as writer:
        for i in range(samples):
            writer.write({"x": x[i], "y": y[i]})


# ---------------------------------------------------------------------------- the worker

def _model() -> Any:
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
              torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.ReLU(),
              torch.nn.Linear(512, 10)]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


class StepLog:
    """Per-rank JSON lines: every completed step with its sample ids, and events."""

    def __init__(self, cfg: Config, rank: int, attempt: str) -> None:
        self.rank, self.attempt = rank, attempt
        self.fault_flag = Path(cfg.run_dir) / f"fault-rank{rank}"
        self._file = open(Path(cfg.run_dir) / f"log-rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115

    def step(self, step: int, ids: Any, **extra: Any) -> None:
        self._file.write(json.dumps({"t": time.time(), "s": step, "a": self.attempt,
                                     "ids": [int(i) for i in ids], **extra}) + "\n")

    def event(self, name: str, **extra: Any) -> None:
        self._file.write(json.dumps({"t": time.time(), "event": name, "a": self.attempt,
                                     **extra}) + "\n")

    def maybe_fault(self, step: int) -> None:
        """Raise inside the step when the driver asked for it (after backward)."""
        if self.fault_flag.exists():
            with contextlib.suppress(FileNotFoundError):
                self.fault_flag.unlink()
            self.event("raise", s=step)
            raise RuntimeError(f"injected fault at step {step} on rank {self.rank}")


def phase(cfg: Config, name: str, when: float | None = None) -> None:
    """When a process reached ``name`` (where a restart's time goes)."""
    rank = os.environ.get("RANK", "?")
    with open(Path(cfg.run_dir) / f"phases-rank{rank}.jsonl", "a") as out:
        out.write(json.dumps({"t": time.time() if when is None else when, "pid": os.getpid(),
                              "phase": name}) + "\n")


def _process_started() -> float | None:
    """When this process was created, as a ``time.time()`` value (the kernel's record, in
    1/CLK_TCK s of the boot-time clock), or None."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError):
        return None


# the phases of a restarted process, in order (docs/recovery.md: where a restart goes)
PHASES = ("exec", "process", "torch imported", "streamcache imported", "loader made",
          "group made", "checkpointer made", "restored")


def _train_step(ddp: Any, optimizer: Any, x: Any, y: Any, log: StepLog, step: int) -> None:
    import torch

    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    optimizer.zero_grad()
    loss.backward()
    log.maybe_fault(step)
    optimizer.step()


def run_dataloader_dcp(cfg: Config, model: Any, optimizer: Any, log: StepLog) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    class Samples(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.x = np.load(Path(cfg.data_dir) / "x.npy", mmap_mode="r")
            self.y = np.load(Path(cfg.data_dir) / "y.npy", mmap_mode="r")

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> Any:
            return torch.from_numpy(np.array(self.x[i])), int(self.y[i]), i

    dist.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    samples = Samples()
    sampler = DistributedSampler(samples, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(samples, batch_size=BATCH, sampler=sampler, drop_last=True)
    root = Path(cfg.run_dir) / "dcp"
    step = 0
    latest = root / "latest"
    if latest.exists():
        step = int(latest.read_text())
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(root / f"step-{step}"))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    log.event("resumed", s=step)
    deadline = time.time() + cfg.seconds + 30
    while time.time() < deadline:
        sampler.set_epoch(step // len(loader))  # the epoch restarts from its beginning
        for x, y, ids in loader:
            _train_step(ddp, optimizer, x, y, log, step)
            step += 1
            log.step(step, ids)
            if step % cfg.save_every == 0:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                dcp.save({"model": model_sd, "optim": optim_sd},
                         checkpoint_id=str(root / f"step-{step}"))
                if dist.get_rank() == 0:
                    (root / "latest.tmp").write_text(str(step))
                    os.replace(root / "latest.tmp", latest)
            if step % len(loader) == 0:
                break


def run_streamcache(cfg: Config, model: Any, optimizer: Any, log: StepLog, loader: Any,
                    memory: bool, links: Any = None) -> None:
    """``links``: the training group's GlooLinks (under NVRx), which the Checkpointer's own
    gloo groups' connections join, so that the failing rank shuts those down too."""
    import torch
    import torch.nn.functional

    from streamcache.checkpoint import Checkpointer, ModelState
    from streamcache.gloo_links import GlooLinks

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = {"train": ModelState(model, optimizer), "loader": loader}
    snap_costs: list[float] = []
    with GlooLinks.track(keep_ports=links.keep_ports if links else ()) as own:
        checkpointer = Checkpointer(Path(cfg.run_dir) / "ckpt", keep_last=2, memory=memory,
                                    job_id="bench-chaos")
    if links is not None:
        links.inodes |= own.inodes
    with checkpointer as ckpt:
        phase(cfg, "checkpointer made")
        step = ckpt.load(state) or 0
        phase(cfg, "restored")
        log.event("resumed", s=step)
        try:
            step = _loop(cfg, ddp, optimizer, log, loader, ckpt, state, step, memory,
                         snap_costs)
        except BaseException:
            if memory:  # under NVRx: the peers' blocked collectives fail now, not at timeout
                if links is not None:
                    links.shutdown()
                abort_gloo_groups()
            raise


def abort_gloo_groups() -> None:
    """Abort this process's gloo groups: a peer blocked in a collective with it gets a
    closed connection at once. NVRx aborts NCCL communicators only; done by the rank that
    failed, before it unwinds (a survivor that aborted its own group while blocked in it
    waited for the group's timeout instead)."""
    import torch.distributed as dist

    if dist.is_initialized():
        c10d = dist.distributed_c10d
        for group in list(c10d._world.pg_names):
            with contextlib.suppress(Exception):  # the first abort may take the others along
                c10d._abort_process_group(group)


def _loop(cfg: Config, ddp: Any, optimizer: Any, log: StepLog, loader: Any, ckpt: Any,
          state: dict[str, Any], step: int, memory: bool, snap_costs: list[float]) -> int:
    for batch in loader:
        _train_step(ddp, optimizer, batch["x"], batch["y"], log, step)
        step += 1
        log.step(step, batch["__id__"])
        if step % cfg.save_every == 0:
            ckpt.save(step, state)
        elif memory and step % cfg.snapshot_every == 0:
            started = time.perf_counter()
            ckpt.snapshot(step, state)
            snap_costs.append(time.perf_counter() - started)
            if len(snap_costs) == 20:
                log.event("snapshot_cost", median_s=statistics.median(snap_costs))
                snap_costs.clear()
    return step


def worker(cfg: Config) -> None:
    rank = int(os.environ["RANK"])
    # the launcher's SIGTERM ends a survivor at once even inside a blocked gloo collective
    # (a Python-level handler would run only when the collective times out)
    log_handler = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    started = _process_started()
    if started is not None:
        phase(cfg, "exec", started)
    phase(cfg, "process")
    import torch

    phase(cfg, "torch imported")

    torch.set_num_threads(1)
    model, optimizer = _model()
    (Path(cfg.run_dir) / f"pid-rank{rank}").write_text(str(os.getpid()))
    (Path(cfg.run_dir) / f"sigterm-rank{rank}").write_text(repr(log_handler))
    if cfg.row == "dataloader_dcp":
        run_dataloader_dcp(cfg, model, optimizer, StepLog(cfg, rank, f"{os.getpid()}"))
        return
    from streamcache import StreamDataset, StreamLoader

    phase(cfg, "streamcache imported")
    dataset = StreamDataset(str(Path(cfg.data_dir) / "ds"), batch_size=BATCH, seed=cfg.seed,
                            infinite=True)
    loader = StreamLoader(dataset)
    if cfg.row.startswith("streamcache_torchrun"):
        import torch.distributed as dist

        phase(cfg, "loader made")
        dist.init_process_group("gloo")
        phase(cfg, "group made")
        run_streamcache(cfg, model, optimizer, StepLog(cfg, rank, f"{os.getpid()}"), loader,
                        memory=False)
        return
    phase(cfg, "loader made")
    nvrx_worker(cfg, rank, model, optimizer, loader)


def worker_entry(cfg_path: str) -> None:
    """The entry point of the _warm row's processes (started by torch elastic)."""
    worker(Config(**json.loads(Path(cfg_path).read_text())))


def launch_warm(cfg_path: str, ranks: int) -> None:
    """torchrun's agent through its Python API, its workers forked from a preloaded
    forkserver (``--launch``; the driver runs this in place of the torchrun command)."""
    elastic_launch_warm(worker_entry, (cfg_path,), ranks, WARM_MODULES)


def elastic_launch_warm(entrypoint: Any, args: tuple[Any, ...], ranks: int,
                        modules: list[str]) -> None:
    """Run ``entrypoint(*args)`` in ``ranks`` workers under torchrun's agent (its Python
    API, the same agent and restart policy as the command), the workers forked from a
    forkserver that imported ``modules`` once (docs/recovery.md, "Warm restarts")."""
    import multiprocessing
    import uuid

    import torch._dynamo  # noqa: F401  (the agent formats a dead worker's traceback with it)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    multiprocessing.set_forkserver_preload(modules)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks,
                          run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=1000,
                          monitor_interval=0.1, start_method="forkserver")
    elastic_launch(config, entrypoint=entrypoint)(*args)


def nvrx_worker(cfg: Config, rank: int, model: Any, optimizer: Any, loader: Any) -> None:
    """The training function under NVRx's in-process restart: the model, optimizer, loader
    and the app's store are made once per process and reused by every restart iteration."""
    import datetime

    import nvidia_resiliency_ext.inprocess as inprocess
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], port + 1, int(os.environ["WORLD_SIZE"]),
                          is_master=rank == 0, multi_tenant=True, wait_for_workers=True,
                          use_libuv=True)
    fast = datetime.timedelta(milliseconds=50)

    from streamcache.gloo_links import GlooLinks

    links = [GlooLinks()]  # the training group's connections, shut down by the failing rank

    def train(call_wrapper: Any = None) -> None:
        assert call_wrapper is not None
        iteration = call_wrapper.iteration
        phase(cfg, f"train {iteration}")
        log = StepLog(cfg, rank, f"{os.getpid()}:{iteration}")
        with GlooLinks.track(keep_ports=[port + 1, port + 2]) as links[0]:
            dist.init_process_group("gloo", store=dist.PrefixStore(str(iteration), store),
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=datetime.timedelta(seconds=30))
        phase(cfg, "group made")
        run_streamcache(cfg, model, optimizer, log, loader, memory=True, links=links[0])

    class AbortGloo(inprocess.abort.Abort):
        """NVRx aborts NCCL communicators; a gloo collective blocked on a rank that raised
        waits for its timeout unless the connections close (gloo's abort does not close
        them): shut down the group's connections (the peers' blocked collectives then fail
        at once), abort every gloo group, then NVRx destroys them."""

        def __call__(self, state: Any) -> Any:
            links[0].shutdown()
            abort_gloo_groups()
            return state

    # NVRx passes its CallWrapper to the parameter annotated with that class (an object, not
    # the string that `from __future__ import annotations` makes of it)
    train.__annotations__["call_wrapper"] = inprocess.CallWrapper
    wrapped = inprocess.Wrapper(
        store_kwargs={"port": port + 2},
        monitor_thread_interval=fast, monitor_process_interval=fast,
        progress_watchdog_interval=fast, heartbeat_interval=datetime.timedelta(seconds=1),
        last_call_wait=datetime.timedelta(milliseconds=100),
        soft_timeout=datetime.timedelta(seconds=60), hard_timeout=datetime.timedelta(seconds=90),
        health_check=None,
        abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), AbortGloo()),
    )(train)
    wrapped()


# ---------------------------------------------------------------------------- the driver

@dataclass
class Fault:
    time: float
    kind: str
    rank: int


@dataclass
class RowResult:
    row: str
    chaos: bool
    steps: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    restart_s: dict[str, list[float]] = field(default_factory=dict)
    steps_run: int = 0
    samples_reread: int = 0
    batches_equal: int = 0
    batches_compared: int = 0
    step_s: float = 0.0
    snapshot_s: float | None = None


def read_logs(run_dir: Path, ranks: int, stem: str = "log") -> list[list[dict[str, Any]]]:
    """Each rank's JSON lines: ``log`` (steps and events) or ``phases``."""
    logs = []
    for rank in range(ranks):
        path = run_dir / f"{stem}-rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        logs.append([json.loads(line) for line in lines if line.endswith("}")])
    return logs


def launch_env(run_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a row's launcher and workers: docs/recovery.md's recipe (rank 0
    serves a fresh store each attempt, since with the agent's store shared restarts read dead
    peers' addresses; no reverse name lookup in a timed-out store wait's warning, which
    stalled NVRx restarts for the resolver's timeout), one thread per rank, and a TMPDIR in
    the run's folder (the agents' torchelastic_* log folders go with it)."""
    (run_dir / "tmp").mkdir(exist_ok=True)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", TORCH_CPP_LOG_LEVEL="ERROR",
                TMPDIR=str(run_dir / "tmp"), **extra)


def run_row(cfg: Config, ranks: int, chaos: bool, mtbf: float, kinds: list[str],
            seed: int) -> tuple[list[list[dict[str, Any]]], list[Fault], float,
                                list[list[dict[str, Any]]]]:
    """Run one row for ``cfg.seconds`` (after its first step); the logs, faults, start and
    the processes' phases."""
    run_dir = Path(cfg.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg_path = run_dir / "config.json"
    cfg_path.write_text(json.dumps(asdict(cfg)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(ranks), "--max-restarts", "1000", "--monitor-interval",
           "0.1", __file__, "--worker", str(cfg_path)]
    if cfg.row.endswith("_warm"):
        cmd = [sys.executable, __file__, "--launch", str(cfg_path), "--ranks", str(ranks)]
    with open(run_dir / "torchrun.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=launch_env(run_dir),
                                start_new_session=True)
    faults: list[Fault] = []
    try:
        start = _wait_first_step(run_dir, ranks, proc)
        chooser = random.Random(seed)
        next_fault = start + chooser.expovariate(1 / mtbf)
        while time.time() < start + cfg.seconds:
            time.sleep(0.02)
            if proc.poll() is not None:
                raise RuntimeError(f"torchrun exited ({proc.returncode}); see "
                                   f"{run_dir / 'torchrun.log'}")
            if not chaos or time.time() < next_fault:
                continue
            if faults and not _recovered(run_dir, ranks, faults[-1]):
                continue  # one fault at a time: the previous restart is not done yet
            fault = Fault(time.time(), kinds[len(faults) % len(kinds)], chooser.randrange(ranks))
            _inject(run_dir, fault)
            faults.append(fault)
            next_fault = fault.time + chooser.expovariate(1 / mtbf)
    finally:
        _stop(proc)
        _remove_snapshots()
    return read_logs(run_dir, ranks), faults, start, read_logs(run_dir, ranks, "phases")


def _remove_snapshots() -> None:
    """The stopped job's memory-tier folders (job id "bench-chaos"): a job stopped from
    outside keeps them for a restart that will not come."""
    from streamcache.checkpoint.memory_files import folder_name

    base = Path("/dev/shm") / f"streamcache-mem-{os.geteuid()}"
    suffix = "-" + folder_name("", "bench-chaos").split("-")[1]
    for folder in base.glob(f"*{suffix}") if base.is_dir() else []:
        shutil.rmtree(folder, ignore_errors=True)


def _wait_first_step(run_dir: Path, ranks: int, proc: subprocess.Popen[bytes]) -> float:
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"torchrun exited; see {run_dir / 'torchrun.log'}")
        logs = read_logs(run_dir, ranks)
        if all(any("s" in e and "ids" in e for e in log) for log in logs):
            return time.time()
        time.sleep(0.1)
    raise RuntimeError("no first step within 300 s")


def _recovered(run_dir: Path, ranks: int, fault: Fault) -> bool:
    return _restart_time(read_logs(run_dir, ranks), fault) is not None


def _inject(run_dir: Path, fault: Fault) -> None:
    if fault.kind == "raise":
        (run_dir / f"fault-rank{fault.rank}").write_text("1")
        return
    with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
        os.kill(int((run_dir / f"pid-rank{fault.rank}").read_text()), signal.SIGKILL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _fault_time(logs: list[list[dict[str, Any]]], fault: Fault) -> float:
    """A raised fault happens when the rank raises (it sees the flag at its next step)."""
    if fault.kind == "raise":
        raised = [e["t"] for e in logs[fault.rank]
                  if e.get("event") == "raise" and e["t"] >= fault.time]
        if raised:
            return float(min(raised))
    return fault.time


def _restart_time(logs: list[list[dict[str, Any]]], fault: Fault) -> float | None:
    """Seconds from the fault to the first step of a new attempt on every rank."""
    when = _fault_time(logs, fault)
    latest = 0.0
    for log in logs:
        before = [e["a"] for e in log if e["t"] <= when]
        old = before[-1] if before else None
        new = [e["t"] for e in log if e["t"] > when and "ids" in e and e["a"] != old]
        if not new:
            return None
        latest = max(latest, min(new))
    return latest - when


def _breakdown(logs: list[list[dict[str, Any]]], phases: list[list[dict[str, Any]]],
               fault: Fault, restart: float) -> dict[str, float]:
    """Seconds from the fault to each phase of the restarted processes (the last rank to
    reach it: the job waits for it), and to the first step. A phase not passed again before
    that step (an in-process restart keeps its process and imports) is left out."""
    when = _fault_time(logs, fault)
    out: dict[str, float] = {}
    for name in PHASES:
        reached = [min((e["t"] for e in rank if e["phase"] == name
                        and when < e["t"] <= when + restart), default=None) for rank in phases]
        if reached and all(t is not None for t in reached):
            out[name] = max(t for t in reached if t is not None) - when
    out["first step"] = restart
    return out


def analyze(row: str, chaos: bool, logs: list[list[dict[str, Any]]], faults: list[Fault],
            start: float, seconds: float, clean: dict[int, list[int]] | None,
            steps_per_epoch: int, phases: list[list[dict[str, Any]]] | None = None,
            ) -> tuple[RowResult, dict[int, list[int]]]:
    end = start + seconds
    result = RowResult(row, chaos)
    trajectory: dict[int, list[int]] = {}
    done_by_end = []
    for log in logs:
        steps = [e for e in log if "ids" in e and e["t"] <= end]
        done_by_end.append(max((e["s"] for e in steps), default=0))
        for e in steps:  # the last execution of each step is the one that counts
            trajectory.setdefault(e["s"], [])
    result.steps = min(done_by_end)
    per_rank_last: list[dict[int, list[int]]] = []
    for log in logs:
        last: dict[int, list[int]] = {}
        for e in log:
            if "ids" in e and e["t"] <= end:
                last[e["s"]] = e["ids"]
        per_rank_last.append(last)
    trajectory = {s: sorted(i for last in per_rank_last for i in last.get(s, []))
                  for s in range(1, result.steps + 1)}
    result.steps_run = sum(1 for e in logs[0] if "ids" in e and e["t"] <= end)
    windows: dict[int, list[int]] = {}
    for s, ids in trajectory.items():
        windows.setdefault((s - 1) // steps_per_epoch, []).extend(ids)
    result.samples_reread = sum(len(ids) - len(set(ids)) for ids in windows.values())
    if clean is not None:
        compared = [s for s in trajectory if s in clean]
        result.batches_compared = len(compared)
        result.batches_equal = sum(trajectory[s] == clean[s] for s in compared)
    times = sorted(e["t"] for e in logs[0] if "ids" in e and e["t"] <= end)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    result.step_s = statistics.median(gaps) if gaps else 0.0
    costs = [e["median_s"] for log in logs for e in log if e.get("event") == "snapshot_cost"]
    result.snapshot_s = statistics.median(costs) if costs else None
    for fault in faults:
        restart = _restart_time(logs, fault)
        entry: dict[str, Any] = {**asdict(fault), "restart_s": restart}
        if restart is not None:
            result.restart_s.setdefault(fault.kind, []).append(restart)
            if phases is not None:
                entry["phases_s"] = _breakdown(logs, phases, fault, restart)
        result.faults.append(entry)
    return result, trajectory


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


# ---------------------------------------------------------------------------- other parts

def measure_imports(repeats: int) -> dict[str, float]:
    """Median seconds of three imports in fresh interpreters, interleaved."""
    probes = {
        "torch": "import torch",
        "torch + streamcache": "import torch; import streamcache",
        "torch + StreamDataset, StreamLoader, Checkpointer":
            "import torch; from streamcache import StreamDataset, StreamLoader, Checkpointer",
    }
    times: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(repeats):
        for name, code in probes.items():
            timed = ("import time; _t = time.perf_counter(); " + code +
                     "; print(time.perf_counter() - _t)")
            out = subprocess.run([sys.executable, "-c", timed], capture_output=True, text=True,
                                 check=True)
            times[name].append(float(out.stdout.strip().splitlines()[-1]))
    return {name: statistics.median(values) for name, values in times.items()}


def measure_memory_tier(directory: str, repeats: int) -> dict[str, float]:
    """Snapshot and restore of the MLP's state and of 100 MB, medians (one process)."""
    import torch

    from streamcache.checkpoint import Checkpointer, ModelState

    model, optimizer = _model()
    loss = model(torch.randn(BATCH, FEATURES)).sum()
    loss.backward()
    optimizer.step()
    big = {f"p{i}": torch.full((2_500_000,), float(i)) for i in range(10)}  # 100 MB
    results: dict[str, list[float]] = {"mlp_snapshot_s": [], "mlp_restore_s": [],
                                       "100mb_snapshot_s": [], "100mb_restore_s": []}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        for name, state in (("mlp", {"train": ModelState(model, optimizer)}),
                            ("100mb", {"big": big})):
            with Checkpointer(Path(tmp) / name, memory=True) as ckpt:
                for i in range(repeats):
                    started = time.perf_counter()
                    ckpt.snapshot(i, state)
                    results[f"{name}_snapshot_s"].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    ckpt.load(state)
                    results[f"{name}_restore_s"].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--launch", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="40 s rows, a fault every ~12 s")
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between faults")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--kinds", default="raise,kill")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--snapshot-every", type=int, default=5)
    parser.add_argument("--samples", type=int, default=25_600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="imports,memory,chaos")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "chaos.json"))
    args = parser.parse_args(argv)
    if args.worker:
        worker(Config(**json.loads(Path(args.worker).read_text())))
        return 0
    if args.launch:
        launch_warm(args.launch, args.ranks)
        return 0
    if args.quick:
        args.seconds, args.mtbf = 40.0, 12.0
    parts = args.parts.split(",")
    report: dict[str, Any] = {"args": vars(args), "load_before": os.getloadavg()}
    if "imports" in parts:
        report["imports_s"] = measure_imports(3 if args.quick else 7)
        print("imports (median s):", json.dumps(report["imports_s"]))
    if "memory" in parts:
        report["memory_tier"] = measure_memory_tier("/dev/shm", 3 if args.quick else 7)
        print("memory tier (median s):", json.dumps(report["memory_tier"]))
    if "chaos" in parts:
        report["rows"] = run_chaos(args)
    report["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"load average before {report['load_before']}, after {report['load_after']}; "
          f"JSON in {args.out}")
    return 0


def run_chaos(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows, out = args.rows.split(","), []
    kinds = args.kinds.split(",")
    steps_per_epoch = args.samples // (BATCH * args.ranks)
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        make_data(data_dir, args.samples)
        for row in rows:
            try:
                out.append(_run_pair(args, row, Path(tmp), data_dir, kinds, steps_per_epoch))
            except RuntimeError as exc:  # a row that cannot run is reported, the rest go on
                out.append({"row": row, "error": str(exc)})
            print(json.dumps(out[-1]), flush=True)
            Path(args.out).with_suffix(".partial.json").write_text(json.dumps(out, indent=1))
    _print_table(out)
    return out


def _run_pair(args: argparse.Namespace, row: str, tmp: Path, data_dir: Path, kinds: list[str],
              steps_per_epoch: int) -> dict[str, Any]:
    """The row without faults, then with them; the summary of the second against the first."""
    clean_traj: dict[int, list[int]] | None = None
    clean_steps = 0
    for chaos in (False, True):
        cfg = Config(row, str(tmp / f"{row}-{int(chaos)}"), str(data_dir), args.seconds,
                     args.save_every, args.snapshot_every, args.seed)
        logs, faults, start, phases = run_row(cfg, args.ranks, chaos, args.mtbf, kinds,
                                              args.seed)
        result, traj = analyze(row, chaos, logs, faults, start, args.seconds, clean_traj,
                               steps_per_epoch, phases)
        if not chaos:
            clean_traj, clean_steps = traj, result.steps
    return _summary(result, clean_steps)


def _summary(result: RowResult, clean_steps: int) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "row": result.row, "clean_steps": clean_steps, "steps": result.steps,
        "goodput": result.steps / clean_steps if clean_steps else 0.0,
        "faults": len(result.faults),
        "steps_redone": result.steps_run - result.steps,
        "samples_reread": result.samples_reread,
        "batches_equal": f"{result.batches_equal}/{result.batches_compared}",
        "step_s": result.step_s, "snapshot_s": result.snapshot_s,
        "fault_log": result.faults,
    }
    for kind, values in result.restart_s.items():
        summary[f"restart_{kind}_p50_s"] = statistics.median(values)
        summary[f"restart_{kind}_p95_s"] = _pct(values, 0.95)
        breakdowns = [f["phases_s"] for f in result.faults
                      if f["kind"] == kind and "phases_s" in f]
        names = [n for n in (*PHASES, "first step") if any(n in b for b in breakdowns)]
        summary[f"phases_{kind}_p50_s"] = {
            n: statistics.median(b[n] for b in breakdowns if n in b) for n in names}
    return summary


def _print_table(rows: list[dict[str, Any]]) -> None:
    print("| row | goodput | faults | restart raise p50/p95 s | restart kill p50/p95 s | "
          "steps redone | samples re-read | batches equal | step s | snapshot s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['row']} | error: {r['error']} |")
            continue

        def pair(kind: str, r: dict[str, Any] = r) -> str:
            p50 = r.get(f"restart_{kind}_p50_s")
            return "-" if p50 is None else f"{p50:.2f} / {r[f'restart_{kind}_p95_s']:.2f}"
        snap = "-" if r["snapshot_s"] is None else f"{r['snapshot_s']:.4f}"
        print(f"| {r['row']} | {r['goodput']:.1%} ({r['steps']}/{r['clean_steps']}) | "
              f"{r['faults']} | {pair('raise')} | {pair('kill')} | {r['steps_redone']} | "
              f"{r['samples_reread']} | {r['batches_equal']} | {r['step_s']:.3f} | {snap} |")
    print("\nWhere a restart goes: seconds from the fault to each phase of the restarted "
          "processes (the last rank to reach it), medians over the row's faults of a kind")
    for r in rows:
        for key, phases in r.items():
            if key.startswith("phases_") and phases:
                kind = key.split("_")[1]
                print(f"{r['row']} ({kind}): " + ", ".join(f"{n} {t:.2f}"
                                                           for n, t in phases.items()))


if __name__ == "__main__":
    sys.exit(main())
