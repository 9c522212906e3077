"""What the memory tier's snapshots cost a training loop: step time with a snapshot every N
steps against the same loop without, interleaved, on 2 gloo ranks (DDP, the chaos benchmark's
MLP: 28.6 MB of model and AdamW state a rank).

Each round runs a block of steps without snapshots and a block with one every
``--snapshot-every`` steps (the order alternates between rounds), on the same processes,
after ``--warmup`` steps. A rank reports each block's wall time and CPU time (the process's,
so the snapshot's background thread counts) and the ``snapshot`` calls' own time. The cost is
(snapshot block - plain block) / plain block, per round; the table gives medians and the
machine's load average before and after. Before the rounds, ``--alone`` snapshots are timed
one at a time with nothing else running: the call, its thread's CPU, and the process's CPU
until the snapshot is whole (its background checksums included).

    python benchmarks/bench_snapshot.py                    # the defaults: 8 rounds of 100 steps
    python benchmarks/bench_snapshot.py --rounds 12 --steps 150
"""

from __future__ import annotations

import argparse
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


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from streamcache.checkpoint import Checkpointer, ModelState

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
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        state = {"train": ModelState(model, optimizer)}
        with Checkpointer(Path(tmp) / "root", memory=True, job_id="bench") as ckpt:
            for _ in range(args.warmup):
                step()
            ckpt.snapshot(0, state)  # the slots exist: steady state, as in a long run
            ckpt.snapshot(0, state)
            ckpt.wait()
            alone: list[dict[str, float]] = []  # one snapshot at a time, nothing else running
            for i in range(args.alone):
                dist.barrier()
                wall, thread, cpu = time.perf_counter(), time.thread_time(), time.process_time()
                ckpt.snapshot(i, state)
                call, call_cpu = time.perf_counter() - wall, time.thread_time() - thread
                ckpt.wait()
                alone.append({"call": call, "call_cpu": call_cpu,
                              "cpu": time.process_time() - cpu})
            for round_ in range(args.rounds):
                modes = ("plain", "snapshot") if round_ % 2 == 0 else ("snapshot", "plain")
                for mode in modes:
                    calls: list[float] = []
                    dist.barrier()
                    wall, cpu = time.perf_counter(), time.process_time()
                    for i in range(1, args.steps + 1):
                        step()
                        if mode == "snapshot" and i % args.snapshot_every == 0:
                            started = time.perf_counter()
                            ckpt.snapshot(i, state)
                            calls.append(time.perf_counter() - started)
                    ckpt.wait()  # the block's last snapshot is finished inside the block
                    blocks.append({"round": round_, "mode": mode,
                                   "wall": time.perf_counter() - wall,
                                   "cpu": time.process_time() - cpu, "calls": calls})
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

    alone = {key: statistics.median(a[key] for r in per_rank for a in r["alone"])
             for key in ("call", "call_cpu", "cpu")}

    wall_cost, cpu_cost, step_s, calls = [], [], [], []
    for round_ in range(args.rounds):
        # the job's pace is its slowest rank's
        plain = max(block(r, round_, "plain")["wall"] for r in range(args.ranks))
        snap = max(block(r, round_, "snapshot")["wall"] for r in range(args.ranks))
        wall_cost.append((snap - plain) / plain)
        plain_cpu = sum(block(r, round_, "plain")["cpu"] for r in range(args.ranks))
        snap_cpu = sum(block(r, round_, "snapshot")["cpu"] for r in range(args.ranks))
        cpu_cost.append((snap_cpu - plain_cpu) / plain_cpu)
        step_s.append(plain / args.steps)
        calls += [c for r in range(args.ranks) for c in block(r, round_, "snapshot")["calls"]]
    report = {"args": vars(args), "load_before": load_before, "load_after": load_after,
              "alone": alone,
              "step_s": statistics.median(step_s),
              "snapshot_call_s": statistics.median(calls),
              "wall_cost": statistics.median(wall_cost), "wall_costs": wall_cost,
              "cpu_cost": statistics.median(cpu_cost), "cpu_costs": cpu_cost}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"load average before {'/'.join(f'{x:.2f}' for x in load_before)}, after "
          f"{'/'.join(f'{x:.2f}' for x in load_after)}")
    print("| ranks | step (no snapshot) | alone: call / its CPU / all CPU until whole | "
          "in the loop: call p50 | every | step time cost p50 (min..max) | CPU cost p50 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.ranks} | {statistics.median(step_s) * 1e3:.1f} ms | "
          f"{alone['call'] * 1e3:.2f} / {alone['call_cpu'] * 1e3:.2f} / "
          f"{alone['cpu'] * 1e3:.2f} ms | "
          f"{statistics.median(calls) * 1e3:.2f} ms | {args.snapshot_every} | "
          f"{statistics.median(wall_cost):+.1%} ({min(wall_cost):+.1%}..{max(wall_cost):+.1%}) "
          f"| {statistics.median(cpu_cost):+.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
