"""What the memory tier's snapshots cost a training loop: step time with a snapshot every N
steps against the same loop without, interleaved, on 2 gloo ranks (DDP, the chaos benchmark's
MLP: 28.6 MB of model and AdamW state a rank), for the default snapshot (every tensor copied
before ``snapshot`` returns) and ``MemoryOptions(background_copy=True)`` (model and optimizer
tensors copied on the tier's thread while ``optimizer.step`` waits for it).

Each round runs a block of steps without snapshots and one block per kind of snapshot, one
every ``--snapshot-every`` steps (the order rotates between rounds), on the same processes,
after ``--warmup`` steps. A rank reports each block's wall time, the training thread's CPU time
(``time.thread_time``: what the loop itself pays, background threads excluded) and the
process's CPU time (background threads included), and the ``snapshot`` calls' own time. A
cost is (snapshot block - plain block) / plain block's wall time, per round; the table gives
medians and the machine's load average before and after. The per-step columns time every
step: the median step at each place after a snapshot (the 1st, 2nd, ... of the N) against the
median step of the plain blocks, summed over the N places, plus the median call, over N
plain steps (per wall time, and per the training thread's CPU time). Before the rounds, ``--alone``
snapshots of each kind are timed one at a time with nothing else running: the call, its
thread's CPU, and the process's CPU until the snapshot is whole (its background work
included). On a machine whose cores all run ranks (this one: 2 ranks, 2 cores) the loop's
wall time pays for the background threads too; where cores are idle (a GPU job's host
threads mostly wait on their device) it pays the training thread's part only.

    python benchmarks/bench_snapshot.py                    # the defaults: 8 rounds of 100 steps
    python benchmarks/bench_snapshot.py --rounds 12 --steps 150
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import bench_chaos  # the chaos rows' MLP and batch

KINDS = ("snapshot", "background")  # the default snapshot; background_copy=True


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from streamcache.checkpoint import Checkpointer, MemoryOptions, ModelState

    torch.set_num_threads(1)  # each rank has its core, as under torchrun on this machine
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, optimizer = bench_chaos._model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(bench_chaos.BATCH, bench_chaos.FEATURES, generator=gen)
    y = torch.randint(0, 10, (bench_chaos.BATCH,), generator=gen)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    blocks: list[dict[str, Any]] = []
    alone: dict[str, list[dict[str, float]]] = {}  # one snapshot at a time, nothing else running
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp, contextlib.ExitStack() as stack:
        state = {"train": ModelState(model, optimizer)}
        ckpts = {kind: stack.enter_context(Checkpointer(
                     Path(tmp) / kind, job_id="bench",
                     memory=MemoryOptions(background_copy=kind == "background")))
                 for kind in KINDS}
        for _ in range(args.warmup):
            step()
        for kind, ckpt in ckpts.items():
            ckpt.snapshot(0, state)  # the slots exist: steady state, as in a long run
            ckpt.snapshot(0, state)
            ckpt.wait()
            alone[kind] = []
            for i in range(args.alone):
                dist.barrier()
                wall, thread, cpu = time.perf_counter(), time.thread_time(), time.process_time()
                ckpt.snapshot(i, state)
                call, call_cpu = time.perf_counter() - wall, time.thread_time() - thread
                ckpt.wait()
                alone[kind].append({"call": call, "call_cpu": call_cpu,
                                    "cpu": time.process_time() - cpu})
        modes = ("plain", *KINDS)
        for round_ in range(args.rounds):
            for mode in modes[round_ % len(modes):] + modes[:round_ % len(modes)]:
                ckpt = ckpts.get(mode)
                calls: list[float] = []
                call_cpus: list[float] = []
                steps: list[tuple[float, float]] = []  # each step's (wall, thread CPU)
                dist.barrier()
                wall, thread, cpu = time.perf_counter(), time.thread_time(), time.process_time()
                for i in range(1, args.steps + 1):
                    step_wall, step_cpu = time.perf_counter(), time.thread_time()
                    step()
                    steps.append((time.perf_counter() - step_wall,
                                  time.thread_time() - step_cpu))
                    if ckpt is not None and i % args.snapshot_every == 0:
                        started, started_cpu = time.perf_counter(), time.thread_time()
                        ckpt.snapshot(i, state)
                        calls.append(time.perf_counter() - started)
                        call_cpus.append(time.thread_time() - started_cpu)
                if ckpt is not None:
                    ckpt.wait()  # the block's last snapshot is finished inside the block
                blocks.append({"round": round_, "mode": mode,
                               "wall": time.perf_counter() - wall,
                               "thread_cpu": time.thread_time() - thread,
                               "cpu": time.process_time() - cpu, "calls": calls,
                               "call_cpus": call_cpus, "steps": steps})
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"blocks": blocks, "alone": alone}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100, help="steps per block")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--alone", type=int, default=20,
                        help="snapshots timed alone first (call, its CPU, all CPU until whole)")
    parser.add_argument("--snapshot-every", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tmp", default=None, help="folder for the checkpoint root")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "snapshot.json"))
    args = parser.parse_args(argv)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "blocks")
        mp.start_processes(_rank, args=(args.ranks, port, args, out), nprocs=args.ranks,
                           start_method="spawn")
        per_rank = []
        for rank in range(args.ranks):
            with open(f"{out}.{rank}") as f:
                per_rank.append(json.load(f))
    load_after = os.getloadavg()

    def block(rank: int, round_: int, mode: str) -> dict[str, Any]:
        return next(b for b in per_rank[rank]["blocks"]
                    if b["round"] == round_ and b["mode"] == mode)

    print(f"load average before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
          f"{'/'.join(f'{x:.2f}' for x in load_after)}")
    print("| snapshot | step (no snapshot) | alone: call / its CPU / all CPU until whole | "
          "in the loop: call p50 | every | step time cost p50 (min..max) | training thread "
          "CPU cost p50 (min..max) | process CPU cost p50 | per-step medians: step time "
          "cost / training thread CPU cost |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    report: dict[str, Any] = {"args": vars(args), "load_before": load_before,
                              "load_after": load_after}
    for kind in KINDS:
        report[kind] = row = _costs(args, per_rank, block, kind)
        alone = row["alone"]
        wall, thread = row["wall_costs"], row["thread_cpu_costs"]
        print(f"| {kind} | {row['step_s'] * 1e3:.1f} ms | "
              f"{alone['call'] * 1e3:.2f} / {alone['call_cpu'] * 1e3:.2f} / "
              f"{alone['cpu'] * 1e3:.2f} ms | "
              f"{row['snapshot_call_s'] * 1e3:.2f} ms | {args.snapshot_every} | "
              f"{row['wall_cost']:+.1%} ({min(wall):+.1%}..{max(wall):+.1%}) | "
              f"{row['thread_cpu_cost']:+.2%} ({min(thread):+.2%}..{max(thread):+.2%}) | "
              f"{row['cpu_cost']:+.1%} | {row['per_step_wall_cost']:+.2%} / "
              f"{row['per_step_thread_cpu_cost']:+.2%} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def _costs(args: argparse.Namespace, per_rank: list[dict[str, Any]], block: Any,
           kind: str) -> dict[str, Any]:
    """One kind of snapshot's costs against the plain blocks of the same rounds."""
    ranks = range(args.ranks)
    alone = {key: statistics.median(a[key] for r in per_rank for a in r["alone"][kind])
             for key in ("call", "call_cpu", "cpu")}
    wall_cost, thread_cost, cpu_cost, step_s, calls = [], [], [], [], []
    for round_ in range(args.rounds):
        # the job's pace is its slowest rank's; CPU costs are the ranks' mean
        plain = max(block(r, round_, "plain")["wall"] for r in ranks)
        snap = max(block(r, round_, kind)["wall"] for r in ranks)
        wall_cost.append((snap - plain) / plain)
        for key, costs in (("thread_cpu", thread_cost), ("cpu", cpu_cost)):
            extra = sum(block(r, round_, kind)[key] - block(r, round_, "plain")[key]
                        for r in ranks) / args.ranks
            costs.append(extra / plain)
        step_s.append(plain / args.steps)
        calls += [c for r in ranks for c in block(r, round_, kind)["calls"]]
    # per-step medians: each step after a snapshot (by its place among the N between two)
    # against a plain block's step, plus the call; robust where whole blocks are too noisy
    every = args.snapshot_every
    plain_steps = [st for r in ranks for b in per_rank[r]["blocks"] if b["mode"] == "plain"
                   for st in b["steps"]]
    by_place: list[list[list[float]]] = [[] for _ in range(every)]
    call_cpus = []
    for r in ranks:
        for b in per_rank[r]["blocks"]:
            if b["mode"] == kind:
                call_cpus += b["call_cpus"]
                for i, st in enumerate(b["steps"][every:], start=every):  # after the first
                    by_place[i % every].append(st)
    per_step = {}
    for j, name in ((0, "wall"), (1, "thread_cpu")):
        base = statistics.median(st[j] for st in plain_steps)
        extra = sum(statistics.median(st[j] for st in place) - base for place in by_place)
        call = statistics.median(calls if j == 0 else call_cpus)
        per_step[name] = (extra + call) / (every * statistics.median(
            st[0] for st in plain_steps))
    return {"alone": alone, "step_s": statistics.median(step_s),
            "per_step_wall_cost": per_step["wall"],
            "per_step_thread_cpu_cost": per_step["thread_cpu"],
            "snapshot_call_s": statistics.median(calls),
            "wall_cost": statistics.median(wall_cost), "wall_costs": wall_cost,
            "thread_cpu_cost": statistics.median(thread_cost), "thread_cpu_costs": thread_cost,
            "cpu_cost": statistics.median(cpu_cost), "cpu_costs": cpu_cost}


if __name__ == "__main__":
    raise SystemExit(main())
