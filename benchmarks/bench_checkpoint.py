"""Checkpoint cost: blocked time, time to durable and cost to a training loop, per save mode.

Run (from the repository root):

    python benchmarks/bench_checkpoint.py                 # 1 GiB of state per rank, 2 ranks
    python benchmarks/bench_checkpoint.py --gib-per-rank 0.25 --repeats 2   # a quick look

Each of 2 gloo ranks on this machine holds an FSDP2-sharded model (``--gib-per-rank`` of
float32 parameters per rank, so each rank writes its own shard) and saves it with every
method below, interleaved, ``--repeats`` times. For each save it measures, as the maximum
over ranks:

- ``blocked``: time until the save call returns;
- ``safe``: time until the training loop may change the state again (equal to ``blocked``
  except with background staging, where the optimizer step waits for the copy);
- ``durable``: time until the checkpoint is on disk (fsync'ed) and, for streamcache,
  committed;
- ``durable in loop``: time from the save call to durable when it is issued inside that
  loop (the background work competes with the loop for the cores);
- ``loop cost``: extra wall time of a loop of fake training steps (matrix products on all
  cores, ``wait_staged`` where the optimizer step would be) that issues one save at its
  start, against the same loop without a save, run right before it (paired).

Beside them the same script measures the machine's limits with the same amount of data:
``memcpy`` (copy into a preallocated buffer) and ``disk`` (write + fsync), both ranks at once.

Methods: ``torch.save`` (rank 0 only, no fsync), DCP ``save`` (synchronous, durable),
DCP ``async_save`` with defaults (a fresh stager per call), DCP ``async_save`` with a reused
``DefaultStager`` and async staging, and streamcache's Checkpointer in ``sync``, ``thread``
(background staging, the default), ``thread`` with blocking staging, and ``process`` modes.
The table is printed and written as JSON to ``benchmarks/out/``.

Last results (2026-11-29 10:32 UTC, ``python benchmarks/bench_checkpoint.py``: 1 GiB per rank,
2 ranks, 3 repeats, medians; 2 cores, no GPU, torch 2.13.0; other jobs on the machine, load
average 2-4; "sc-thread" is the Checkpointer's defaults):

    method                     blocked s  safe s  durable s  loop cost s  durable vs dcp-sync
    torch.save (rank 0)            0.989   0.989      1.180        0.907        0.44x
    dcp-sync                       2.055   2.055      2.654        2.204        1.00x
    dcp-async-default              0.596   0.596      4.160        2.314        1.57x
    dcp-async-reused-stager        0.018   0.317      2.767        1.812        1.04x
    sc-sync                        2.587   2.587      2.589        3.190        0.98x
    sc-thread (defaults)           0.006   0.298      3.387        0.091        1.28x
    sc-thread-nice0                0.009   0.331      3.253        2.073        1.23x
    sc-thread-nice19               0.009   0.282      3.320        0.295        1.25x
    sc-thread-blocking-staging     0.322   0.322      2.966        0.236        1.12x
    sc-process                     0.547   0.547      4.120        2.140        1.55x
    limits: memcpy 0.201 s/GiB, disk write+fsync 1.037 s/GiB per rank (both ranks at once)

Two earlier runs under heavier load (load average 6-10) are in docs/checkpoint.md.
Discussion and the defaults chosen from it: docs/checkpoint.md, "Measurements and defaults".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist import RankGroup  # the project's multi-process helper

METHODS = [
    "torch.save",
    "dcp-sync",
    "dcp-async-default",
    "dcp-async-reused-stager",
    "sc-sync",
    "sc-thread",
    "sc-thread-nice0",
    "sc-thread-nice19",
    "sc-thread-blocking-staging",
    "sc-process",
]


def _model(gib: float, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers, width = 16, 1024
    rows = max(1, int(gib * world * (1 << 30) / 4 / layers / width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, rows, bias=False)
                                  for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def _fake_step(a: torch.Tensor) -> None:
    for _ in range(4):
        a = torch.tanh(a @ a)


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _nice(method: str) -> dict[str, int]:
    """The writer niceness a method asks for; none means the Checkpointer's default."""
    return {"writer_nice": int(method.rsplit("nice", 1)[1])} if "nice" in method else {}


class Saver:
    """One method: ``start(step)`` returns after the blocking part; then ``safe``/``durable``."""

    def __init__(self, method: str, model: torch.nn.Module, base: Path, rank: int) -> None:
        from streamcache.checkpoint import Checkpointer, ModelState

        self.method, self.model, self.base, self.rank = method, model, base / method, rank
        self.state = {"train": ModelState(model)}
        self.pending: Any = None
        self.ckpt: Any = None
        self.stager: Any = None
        self.group = dist.new_group(backend="gloo")
        if method.startswith("sc-"):
            mode = {"sc-sync": "sync", "sc-process": "process"}.get(method, "thread")
            self.ckpt = Checkpointer(self.base, async_mode=mode, keep_last=1,
                                     background_staging=method != "sc-thread-blocking-staging",
                                     **_nice(method))
        if method == "dcp-async-reused-stager":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(False, False, True, False))

    def sd(self) -> dict[str, Any]:
        return {"train": self.state["train"].state_dict()}

    def start(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        path = self.base / f"step-{step}"
        if self.method == "torch.save":
            if self.rank == 0:
                path.mkdir(parents=True, exist_ok=True)
                torch.save(self.model.state_dict(), path / "model.pt")
        elif self.method == "dcp-sync":
            dcp.save(self.sd(), checkpoint_id=str(path), process_group=self.group)
        elif self.method == "dcp-async-default":
            self.pending = dcp.async_save(self.sd(), checkpoint_id=str(path),
                                          process_group=self.group)
        elif self.method == "dcp-async-reused-stager":
            self.pending = dcp.async_save(self.sd(), checkpoint_id=str(path),
                                          process_group=self.group, async_stager=self.stager)
        else:
            self.ckpt.save(step, self.state)

    def safe(self) -> None:
        if self.method == "dcp-async-reused-stager":
            self.pending.staging_completion.result()
        elif self.ckpt is not None:
            self.ckpt.wait_staged()

    def durable(self) -> None:
        if self.method == "dcp-async-default":
            self.pending.result()
        elif self.method == "dcp-async-reused-stager":
            self.pending.upload_completion.result()
        elif self.ckpt is not None:
            self.ckpt.wait()
        self.pending = None
        if self.ckpt is None and self.rank == 0:
            shutil.rmtree(self.base, ignore_errors=True)  # keep the disk from filling up
        dist.barrier()

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
    saver.safe()
    safe = time.perf_counter() - started
    saver.durable()
    durable = time.perf_counter() - started
    return {"blocked": _max_over_ranks(blocked), "safe": _max_over_ranks(safe),
            "durable": _max_over_ranks(durable)}


def _loop(saver: Saver | None, steps: int, step: int) -> tuple[float, float]:
    work = torch.randn(768, 768) / 40
    dist.barrier()
    started = time.perf_counter()
    for i in range(steps):
        if saver is not None and i == 0:
            saver.start(step)
        _fake_step(work)
        if saver is not None:
            saver.safe()  # where a real loop's optimizer.step() would wait
    elapsed = time.perf_counter() - started
    if saver is not None:
        saver.durable()
    durable = time.perf_counter() - started
    return _max_over_ranks(elapsed), _max_over_ranks(durable)


def _limits(gib: float) -> dict[str, float]:
    numel = int(gib * (1 << 30) / 4)
    source, target = torch.ones(numel), torch.zeros(numel)
    dist.barrier()
    started = time.perf_counter()
    target.copy_(source)
    memcpy = _max_over_ranks(time.perf_counter() - started)
    del target
    path = Path(tempfile.gettempdir()) / f"streamcache-bench-disk-{os.getpid()}"
    data = source.numpy().view("uint8")
    dist.barrier()
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    disk = _max_over_ranks(time.perf_counter() - started)
    path.unlink()
    return {"memcpy": memcpy, "disk": disk}


def _bench(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    base = Path(args["dir"])
    model = _model(args["gib_per_rank"], world)
    local_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())  # type: ignore[operator]
    savers = {m: Saver(m, model, base, rank) for m in args["methods"]}
    results: dict[str, list[dict[str, float]]] = {m: [] for m in args["methods"]}
    limits = []
    step = 0
    for saver in savers.values():  # warm up: buffers allocated, DCP's process started
        step += 1
        _one_save(saver, step)
    for _ in range(args["repeats"]):
        limits.append(_limits(local_bytes / (1 << 30)))
        for method, saver in savers.items():
            step += 1
            record = _one_save(saver, step)
            step += 1
            without, _ = _loop(None, args["loop_steps"], 0)
            with_save, durable_in_loop = _loop(saver, args["loop_steps"], step)
            record.update(loop_cost=with_save - without, loop_s=without,
                          durable_in_loop=durable_in_loop)
            results[method].append(record)
            if rank == 0:
                print(f"  {method:28} " + "  ".join(f"{k} {v:6.3f}" for k, v in record.items()),
                      flush=True)
    for saver in savers.values():
        saver.close()
    return {"results": results, "limits": limits, "local_bytes": local_bytes}


def _table(summary: dict[str, Any]) -> str:
    gib = summary["local_bytes"] / (1 << 30)
    lines = [
        f"{summary['ranks']} ranks, {gib:.2f} GiB of state per rank, {summary['repeats']} "
        f"repeats (median; loop cost is paired against a loop of "
        f"{summary['loop_s']:.2f} s)",
        f"{'method':28} {'blocked s':>9} {'s/GiB':>6} {'safe s':>7} {'durable s':>9} "
        f"{'loop cost s':>11} {'durable in loop s':>17} {'durable vs dcp-sync':>19}",
    ]
    sync = summary["median"].get("dcp-sync", {}).get("durable")
    for method, m in summary["median"].items():
        ratio = f"{m['durable'] / sync:.2f}x" if sync else "-"
        lines.append(f"{method:28} {m['blocked']:9.3f} {m['blocked'] / gib:6.3f} "
                     f"{m['safe']:7.3f} {m['durable']:9.3f} {m['loop_cost']:11.3f} "
                     f"{m['durable_in_loop']:17.3f} {ratio:>19}")
    lim = summary["limits"]
    lines.append(f"limits: memcpy {lim['memcpy']:.3f} s ({gib / lim['memcpy']:.2f} GiB/s per "
                 f"rank), disk write+fsync {lim['disk']:.3f} s ({gib / lim['disk']:.2f} GiB/s "
                 "per rank), both ranks at once")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib-per-rank", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop-steps", type=int, default=60,
                        help="fake steps per loop; make the loop outlast a durable save")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="streamcache-bench-ckpt-"))
    options = {"gib_per_rank": args.gib_per_rank, "repeats": args.repeats, "dir": str(workdir),
               "loop_steps": args.loop_steps, "methods": args.methods}
    try:
        group = RankGroup(_bench, args.ranks, args=(options,), timeout_s=3600)
        results = group.join(check=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    value = results[0].value
    median = {m: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
              for m, runs in value["results"].items()}
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cpus": os.cpu_count(), "ranks": args.ranks,
        "repeats": args.repeats, "local_bytes": value["local_bytes"],
        "loop_s": statistics.median(r["loop_s"] for runs in value["results"].values()
                                    for r in runs),
        "median": median,
        "limits": {k: statistics.median(x[k] for x in value["limits"])
                   for k in value["limits"][0]},
        "runs": value["results"],
    }
    table = _table(summary)
    print(table)
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    path = out / f"checkpoint-{summary['date'].replace(':', '')}.json"
    path.write_text(json.dumps({**summary, "table": table}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
