"""Checkpoint cost, quiet and under a competing CPU load: blocked time, call to durable, and
the training loop's cost of one save, for the Checkpointer against DCP in the same run.

Run (from the repository root, on a quiet machine):

    python benchmarks/bench_checkpoint.py                                        # ~1 GB a rank
    python benchmarks/bench_checkpoint.py --size 256MiB --repeats 1               # a smoke run

Each of 2 gloo ranks holds an FSDP2-sharded model and its AdamW state (``--size`` of
float32 weights and Adam moments per rank, about 1 GB by default) and saves it with every
method below, interleaved, ``--repeats`` times, in two conditions: *quiet* (nothing else of
ours runs) and *busy* (two processes that spin on the CPU the whole time, as a loader's
workers or another job would). For each save, the maximum over the ranks of:

- ``blocked``: time until the save call returns;
- ``durable``: time from the call until the checkpoint is on disk (fsync'ed) and, for the
  Checkpointer, committed (marker published);
- ``loop cost``: extra wall time of a loop of fake training steps (matrix products, one
  thread per rank: the ranks keep both cores busy) that saves once at its start, against the
  same loop without a save run right before it (paired); the loop lasts ``--loop-s`` seconds
  so that the save becomes durable inside it. Paired wall times differ by a second or two
  from run to run here, so beside it:
- ``loop cpu``: the extra CPU time of the loop's own thread (``time.thread_time``) in the
  same pair: what the save costs the training thread itself (the blocking copy, hooks,
  anything it waits on does not count; the writer's competition for the cores shows in the
  wall time). Compared with a synchronous save's whole duration, which a synchronous save
  costs the loop.
- ``window cpu`` and ``window wall``: the same two costs summed over the steps until the
  first one that ended with the save durable (the steps after it add only noise: 8 s of
  steps vary by more than the cost); ``steps`` is that window's length, ``call cpu`` the
  loop thread's CPU time in the save call alone;
- ``of it runq``: how much of the window's extra wall time the loop thread spent waiting
  for a core while runnable (Linux schedstat): wall time lost to the CPU the save's threads
  and the other processes took, not to a lock or the GIL (those would show as neither CPU
  nor run-queue time).

``--step-wait F`` makes each fake step wait for ``F`` of its time after computing, as the
thread of a GPU job waits for its device; with the default 0 the loop keeps every core busy,
so any CPU the writer uses is taken from the loop's steps (the wall costs then measure the
writer's CPU, not how well it keeps out of the loop's way).

Beside them, in each condition: ``copy`` (one copy of the state's tensors into reused
buffers: the floor of a blocking snapshot) and ``disk`` (writing the state's bytes and
fsync, both ranks at once). The goals of issues #28 and #38 are checked against the same run.

Methods: DCP ``save`` (synchronous); DCP ``async_save`` with a reused ``DefaultStager``
(blocking staging), and with a reused stager and async staging (a staging future, only
``staging_completion`` blocks the step); the Checkpointer's defaults (``sc``), with
``writer_nice=19`` (the default before), in ``sync`` mode, and with background staging.

Last results: docs/checkpoint.md, "Measurements"; JSON in ``benchmarks/out/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist import RankGroup  # the project's multi-process helper

from streamcache.units import size_argument

METHODS = [
    "dcp-sync",
    "dcp-async-stager",
    "dcp-async-stager+async-staging",
    "sc",
    "sc-nice19",
    "sc-sync",
    "sc-background-staging",
]
DEFAULT_METHODS = [m for m in METHODS if m != "sc-background-staging"]
CONDITIONS = ["quiet", "busy"]
_SPIN = "while True:\n    pass\n"


def _model(state_bytes: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model whose weights and Adam moments take ``state_bytes`` on each rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers, width = 16, 1024
    params_per_rank = state_bytes // (4 * 3)  # float32 weight + exp_avg + exp_avg_sq
    rows = max(1, params_per_rank * world // layers // width)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, rows, bias=False)
                                  for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the Adam moments exist
    optimizer.zero_grad()
    return model, optimizer


def _local_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    tensors = [p.to_local() for p in model.parameters()]  # type: ignore[attr-defined]
    for state in optimizer.state.values():
        tensors += [v.to_local() if hasattr(v, "to_local") else v for v in state.values()
                    if isinstance(v, torch.Tensor) and v.numel() > 1]
    return tensors


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _fake_step(a: torch.Tensor, wait_s: float = 0.0) -> None:
    """Four matrix products on this thread, then ``wait_s`` of waiting (where a GPU job's
    thread waits for its device)."""
    for _ in range(4):
        a = torch.tanh(a @ a)
    if wait_s:
        time.sleep(wait_s)


def _run_queue_clock() -> Any:
    """A function giving the calling thread's total time spent waiting for a core
    (runnable, not running), in seconds, from ``/proc/self/task/<tid>/schedstat``; one
    that gives 0.0 where the kernel does not keep it."""
    path = f"/proc/self/task/{threading.get_native_id()}/schedstat"

    def waited() -> float:
        try:
            with open(path) as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    return waited


class Saver:
    """One method: ``start(step)`` returns when the caller may go on; ``durable()`` waits."""

    def __init__(self, method: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 base: Path, rank: int) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from streamcache.checkpoint import Checkpointer, ModelState

        self.method, self.base, self.rank = method, base / method, rank
        self.state = {"train": ModelState(model, optimizer)}
        self.pending: Any = None
        self.ckpt: Any = None
        self.stager: Any = None
        self.group = dist.new_group(backend="gloo")
        if method.startswith("sc"):
            options: dict[str, Any] = {"keep_last": 1}
            if method == "sc-nice19":
                options["writer_nice"] = 19
            elif method == "sc-sync":
                options["async_mode"] = "sync"
            elif method == "sc-background-staging":
                options["background_staging"] = True
            self.ckpt = Checkpointer(self.base, **options)
        elif method.startswith("dcp-async"):
            self.stager = DefaultStager(StagingOptions(
                use_pinned_memory=False, use_shared_memory=False,
                use_async_staging=method.endswith("async-staging"), use_non_blocking_copy=False))

    def start(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.ckpt is not None:
            self.ckpt.save(step, self.state)
            return
        path = str(self.base / f"step-{step}")
        state_dict = {"train": self.state["train"].state_dict()}
        if self.method == "dcp-sync":
            dcp.save(state_dict, checkpoint_id=path, process_group=self.group)
        else:
            self.pending = dcp.async_save(state_dict, checkpoint_id=path,
                                          process_group=self.group, async_stager=self.stager)

    def safe(self) -> None:
        """Where a real loop's ``optimizer.step()`` waits for the snapshot."""
        if self.method == "dcp-async-stager+async-staging":
            self.pending.staging_completion.result()
        elif self.ckpt is not None:
            self.ckpt.wait_staged()

    def in_flight(self) -> bool:
        """Whether the save's background part still runs (no wait)."""
        if self.ckpt is not None:
            return self.ckpt.in_flight
        if self.pending is None:
            return False
        return not getattr(self.pending, "upload_completion", self.pending).done()

    def durable(self) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()
        elif self.pending is not None:
            getattr(self.pending, "upload_completion", self.pending).result()
        self.pending = None
        if self.ckpt is None and self.rank == 0:
            shutil.rmtree(self.base, ignore_errors=True)  # keep the disk from filling up
        dist.barrier(group=self.group)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.stager is not None:
            self.stager.close()


def _one_save(saver: Saver, step: int) -> dict[str, float]:
    dist.barrier()
    started = time.perf_counter()
    saver.start(step)
    blocked = time.perf_counter() - started
    saver.durable()
    durable = time.perf_counter() - started
    return {"blocked": _max_over_ranks(blocked), "durable": _max_over_ranks(durable)}


def _loop(saver: Saver | None, steps: int, step: int, wait_s: float) -> dict[str, Any]:
    """One loop of ``steps`` fake steps, saving at the first when ``saver`` is given.

    Returns this rank's ``wall`` time of the loop, ``durable`` (time until the save is
    durable), ``cpu`` (the loop thread's CPU time), ``step_cpu`` (the thread's CPU time of
    each step, the save's call in the first), ``step_runq`` (the time the thread waited for
    a core in each step, runnable but not running: Linux's schedstat, else zeros) and
    ``window`` (the steps until the first one that ended with the save durable, included).
    """
    work = torch.randn(512, 512) / 25
    step_cpu: list[float] = []
    step_wall: list[float] = []
    step_runq: list[float] = []
    window, call_cpu = 0, 0.0
    runq = _run_queue_clock()
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.thread_time()
    last, last_wall, last_runq = cpu_started, started, runq()
    for i in range(steps):
        if saver is not None and i == 0:
            saver.start(step)
            call_cpu = time.thread_time() - last
        _fake_step(work, wait_s)
        if saver is not None:
            saver.safe()
            if not window and not saver.in_flight():
                window = i + 1
        now, wall = time.thread_time(), time.perf_counter()
        step_cpu.append(now - last)
        step_wall.append(wall - last_wall)
        waited = runq()
        step_runq.append(waited - last_runq)
        last, last_wall, last_runq = now, wall, waited
    elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
    if saver is not None:
        saver.durable()
    return {"wall": elapsed, "durable": time.perf_counter() - started, "cpu": cpu,
            "step_cpu": step_cpu, "step_wall": step_wall, "step_runq": step_runq,
            "window": window or steps, "call_cpu": call_cpu}


def _loop_costs(steps: int, saver: Saver, step: int, wait_s: float) -> dict[str, float]:
    """The loop's costs of one save (a loop without a save right before, paired), each the
    maximum over the ranks; the ``window_*`` costs count only the steps until the save was
    durable (after them the save does nothing, and the rest of the loop only adds noise)."""
    without = _loop(None, steps, 0, wait_s)
    with_save = _loop(saver, steps, step, wait_s)
    window = with_save["window"]

    def extra(per_step: str) -> float:  # the save's extra over the window's steps
        return sum(with_save[per_step][:window]) - sum(without[per_step][:window])

    window_cpu, window_wall, window_runq = (extra("step_cpu"), extra("step_wall"),
                                            extra("step_runq"))
    return {"loop_cost": _max_over_ranks(with_save["wall"] - without["wall"]),
            "loop_s": _max_over_ranks(without["wall"]),
            "durable_in_loop": _max_over_ranks(with_save["durable"]),
            "loop_cpu_cost": _max_over_ranks(with_save["cpu"] - without["cpu"]),
            "window_cpu_cost": _max_over_ranks(window_cpu),
            "window_wall_cost": _max_over_ranks(window_wall),
            "window_runq_cost": _max_over_ranks(window_runq),
            "window_steps": _max_over_ranks(window),
            "call_cpu": _max_over_ranks(with_save["call_cpu"])}


def _limits(tensors: list[torch.Tensor], buffers: list[torch.Tensor], path: Path) -> dict[str,
                                                                                          float]:
    dist.barrier()
    started = time.perf_counter()
    for source, target in zip(tensors, buffers, strict=True):
        target.copy_(source)
    copy = _max_over_ranks(time.perf_counter() - started)
    dist.barrier()
    started = time.perf_counter()
    with open(path, "wb") as f:
        for tensor in buffers:
            data: Any = tensor.reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    disk = _max_over_ranks(time.perf_counter() - started)
    path.unlink()
    return {"copy": copy, "disk": disk}


def _busy(start: bool, spinners: list[subprocess.Popen[bytes]]) -> None:
    """Rank 0 starts (or stops) the two spinning processes of the busy condition."""
    if dist.get_rank() == 0:
        if start:
            spinners += [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(2)]
            time.sleep(0.5)
        else:
            for spinner in spinners:
                spinner.send_signal(signal.SIGKILL)
                spinner.wait()
            spinners.clear()
    dist.barrier()


def _calibrate(seconds: float, wait_share: float) -> tuple[int, float]:
    """(steps of a loop of ``seconds``, each step's wait): a step computes for about
    ``1 - wait_share`` of its time and waits for the rest."""
    work = torch.randn(512, 512) / 25
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < 1.0:
        _fake_step(work)
        steps += 1
    per_step = _max_over_ranks((time.perf_counter() - started) / steps)
    wait_s = per_step * wait_share / (1 - wait_share)
    return max(10, int(seconds / (per_step + wait_s))), wait_s


def _bench(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)  # each rank's loop keeps one of the machine's cores busy
    base = Path(args["dir"])
    model, optimizer = _model(args["size"], world)
    tensors = _local_tensors(model, optimizer)
    buffers = [torch.empty_like(t) for t in tensors]
    for source, target in zip(tensors, buffers, strict=True):
        target.copy_(source)  # (the floor is a copy into memory already touched)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    savers = {m: Saver(m, model, optimizer, base, rank) for m in args["methods"]}
    loop_steps, wait_s = _calibrate(args["loop_s"], args["step_wait"])
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        c: {m: [] for m in args["methods"]} for c in CONDITIONS}
    limits: dict[str, list[dict[str, float]]] = {c: [] for c in CONDITIONS}
    spinners: list[subprocess.Popen[bytes]] = []
    step = 0
    for saver in savers.values():  # warm up: buffers allocated, files of a first save
        step += 1
        _one_save(saver, step)
    try:
        for repeat in range(args["repeats"]):
            for condition in CONDITIONS if repeat % 2 == 0 else reversed(CONDITIONS):
                _busy(condition == "busy", spinners)
                limits[condition].append(_limits(tensors, buffers, base / f"disk-{rank}"))
                for method, saver in savers.items():
                    step += 1
                    record = _one_save(saver, step)
                    step += 1
                    record.update(_loop_costs(loop_steps, saver, step, wait_s))
                    results[condition][method].append(record)
                    if rank == 0:
                        print(f"  {condition:5} {method:31} " + "  ".join(
                            f"{k} {v:6.3f}" for k, v in record.items()), flush=True)
                _busy(False, spinners)
    finally:
        _busy(False, spinners)
    for saver in savers.values():
        saver.close()
    return {"results": results, "limits": limits, "state_bytes": state_bytes,
            "loop_steps": loop_steps, "step_wait_s": wait_s}


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _table(summary: dict[str, Any]) -> str:
    gb = summary["state_bytes"] / 1e9
    lines = [f"{summary['ranks']} ranks, {gb:.2f} GB of weights and Adam moments per rank, "
             f"{summary['repeats']} repeats (medians), load average {summary['load_before']} "
             f"before, {summary['load_after']} after; loop steps wait "
             f"{summary['step_wait']:.0%} of their time"]
    for condition in CONDITIONS:
        med = summary["median"][condition]
        lim = summary["limits"][condition]
        sync = med.get("dcp-sync", {})
        lines += ["", f"{condition}: copy of the state {lim['copy']:.3f} s, write + fsync "
                      f"{lim['disk']:.3f} s (both ranks at once)",
                  f"{'method':31} {'blocked s':>9} {'/copy':>6} {'durable s':>9} "
                  f"{'/dcp-sync':>9} {'loop cost s':>11} {'/dcp-sync':>9} {'loop cpu s':>10} "
                  f"{'/sync save':>10} {'window cpu s':>12} {'/sync save':>10} "
                  f"{'window wall s':>13} {'/sync save':>10} {'of it runq s':>12} "
                  f"{'steps':>5} "
                  f"{'loop s':>7} {'durable in loop s':>17}"]
        for method, m in med.items():
            durable_ratio = m["durable"] / sync["durable"] if sync else float("nan")
            cost_ratio = m["loop_cost"] / sync["loop_cost"] if sync else float("nan")
            cpu_ratio = m["loop_cpu_cost"] / sync["durable"] if sync else float("nan")
            window_ratio = m["window_cpu_cost"] / sync["durable"] if sync else float("nan")
            wall_ratio = m["window_wall_cost"] / sync["durable"] if sync else float("nan")
            lines.append(f"{method:31} {m['blocked']:9.3f} {m['blocked'] / lim['copy']:6.2f} "
                         f"{m['durable']:9.3f} {durable_ratio:8.2f}x {m['loop_cost']:11.3f} "
                         f"{cost_ratio:8.3f}x {m['loop_cpu_cost']:10.3f} {cpu_ratio:9.3f}x "
                         f"{m['window_cpu_cost']:12.3f} {window_ratio:9.3f}x "
                         f"{m['window_wall_cost']:13.3f} {wall_ratio:9.3f}x "
                         f"{m['window_runq_cost']:12.3f} "
                         f"{m['window_steps']:5.0f} "
                         f"{m['loop_s']:7.2f} {m['durable_in_loop']:17.3f}")
    return "\n".join(lines)


def _goals(summary: dict[str, Any]) -> str:
    lines = ["goals of #28 and #38 (sc = the Checkpointer's defaults):"]
    for condition in CONDITIONS:
        med, lim = summary["median"][condition], summary["limits"][condition]
        if "sc" not in med or "dcp-sync" not in med:
            continue
        sc, sync = med["sc"], med["dcp-sync"]
        checks = [
            ("call to durable <= 1.1x dcp-sync", sc["durable"] / sync["durable"], 1.1),
            ("blocked <= 1.3x one copy", sc["blocked"] / lim["copy"], 1.3),
            ("loop cost <= 0.1x dcp-sync's save (durable)", sc["loop_cost"] / sync["durable"],
             0.1),
            ("loop cost <= 0.1x dcp-sync's loop cost", sc["loop_cost"] / sync["loop_cost"], 0.1),
            ("loop thread CPU <= 0.1x dcp-sync's save (durable)",
             sc["loop_cpu_cost"] / sync["durable"], 0.1),
            ("loop thread CPU until durable <= 0.1x dcp-sync",
             sc["window_cpu_cost"] / sync["durable"], 0.1),
            ("loop wall time until durable <= 0.1x dcp-sync",
             sc["window_wall_cost"] / sync["durable"], 0.1),
        ]
        for name, ratio, bound in checks:
            verdict = "met" if ratio <= bound else "NOT met"
            lines.append(f"  {condition:5} {name:45} {ratio:6.3f}  {verdict}")
    return "\n".join(lines)


def _load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", type=size_argument, default=10**9,
                        help="weights + Adam moments per rank (default 1GB)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop-s", type=float, default=8.0,
                        help="length of the fake training loop, quiet (outlast a save)")
    parser.add_argument("--step-wait", type=float, default=0.0,
                        help="share of each fake step spent waiting, as a GPU job's thread "
                             "waits for its device (default 0: the loop keeps the cores busy)")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=METHODS,
                        help="default: all but sc-background-staging (memory: each method "
                             "with staging holds a copy of the state)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    if not 0 <= args.step_wait < 1:
        parser.error(f"--step-wait {args.step_wait}: give a share in [0, 1)")
    workdir = Path(tempfile.mkdtemp(prefix="streamcache-bench-ckpt-", dir=args.dir))
    options = {"size": args.size, "repeats": args.repeats, "dir": str(workdir),
               "loop_s": args.loop_s, "methods": args.methods, "step_wait": args.step_wait}
    load_before = _load_average()
    try:
        # fresh interpreters, as a launcher starts ranks (the tests' default forks them from
        # a server that imported torch)
        group = RankGroup(_bench, args.ranks, args=(options,), timeout_s=6 * 3600,
                          start_method="spawn")
        results = group.join(check=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    value = results[0].value
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "torch": torch.__version__, "cpus": os.cpu_count(), "ranks": args.ranks,
        "repeats": args.repeats, "state_bytes": value["state_bytes"],
        "loop_steps": value["loop_steps"], "step_wait": args.step_wait,
        "step_wait_s": value["step_wait_s"], "load_before": load_before,
        "load_after": _load_average(),
        "median": {c: {m: _medians(runs) for m, runs in value["results"][c].items()}
                   for c in CONDITIONS},
        "limits": {c: _medians(value["limits"][c]) for c in CONDITIONS},
        "runs": value["results"],
    }
    table, goals = _table(summary), _goals(summary)
    print(table)
    print(goals)
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    path = out / f"checkpoint-{summary['date'].replace(':', '')}.json"
    path.write_text(json.dumps({**summary, "table": table, "goals": goals}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
