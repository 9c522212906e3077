"""Goodput of replica groups under torchft while one group is SIGKILLed every ~30 s.

G replica groups (one process each, each under its own ``torchrun`` with ``--max-restarts``,
as a replica group runs under torchft) train the MLP of ``bench_chaos.py`` (784-1024-1024-
512-10, AdamW, 64 samples a group a step) with a real torchft ``Manager`` (gloo,
``use_async_quorum=False``) and a ``Lighthouse`` in this driver, reading with
``ReplicaLoader`` + ``TorchftQuorum``. The driver SIGKILLs the process of a random group at
seeded Poisson times; that group's torchrun starts a new process, which joins the next
quorum and heals from a live peer (model, optimizer and loader state through torchft's own
transfer). The healthy groups never stop: they go on with the groups that are up.

Per run it reports:
- goodput: the samples committed in T seconds (from the first step every group made) along
  the history that survived, against the same setting's clean run (no faults) measured just
  before;
- exactly once: along that history, no sample of an epoch committed twice, none foreign,
  every sample of every finished epoch committed;
- per fault: the restart breakdown of the killed group (SIGKILL -> new process -> torch,
  torchft and streamcache imported -> model made -> Manager made -> loader made -> first
  quorum returned (healed) -> first committed step with that group in it) and the healthy
  groups' stall (the longest gap between commits from the SIGKILL until the group is back).

Run (on a quiet machine; torchft 0.2.0 installed):

    python benchmarks/bench_replica_chaos.py --groups 3 --seconds 150 --mtbf 30

JSON in benchmarks/out/replica_chaos.json; results in docs/recovery.md ("Replica groups under
torchft") and RESULTS.md. Last runs (2026-12-06, quiet 2-core machine, 3 groups, a kill every
~30 s, T = 150 s): warm launch with 300 ms lighthouse timeouts 99.3% and 97.8%, the killed
group back in 0.52-0.54 s (p50); 1000 ms timeouts 97.9%, 1.24 s; the torchrun command 96.8%
and 103.6%, 4.1-4.6 s; every sample committed exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_chaos import (
    BATCH,
    _model,
    _process_started,
    elastic_launch_warm,
    launch_env,
    make_data,
)

SEED = 0
# what a warm launch's forkserver imports once (a restarted worker is forked with them done)
WARM_MODULES = ["__main__", "torch", "torch._dynamo", "torch.optim", "torchft.manager",
                "torchft.process_group", "streamcache", "streamcache.replicas"]
PHASES = ("exec", "torch imported", "torchft imported", "streamcache imported", "model made",
          "manager made", "loader made", "quorum")


@dataclass
class Config:
    run_dir: str
    data_dir: str
    lighthouse: str
    groups: int
    min_replicas: int


# ---------------------------------------------------------------- one replica group

def worker(cfg: Config, group: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # end at once, even inside a collective
    run_dir = Path(cfg.run_dir)
    log = open(run_dir / f"g{group}.jsonl", "a", buffering=1)  # noqa: SIM115
    pid = os.getpid()

    def phase(name: str, when: float | None = None) -> None:
        log.write(json.dumps({"phase": name, "pid": pid,
                              "t": time.time() if when is None else when}) + "\n")

    started = _process_started()
    if started is not None:
        phase("exec", started)
    (run_dir / f"pid-g{group}").write_text(str(pid))
    from datetime import timedelta

    import torch

    phase("torch imported")
    torch.set_num_threads(1)
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    phase("torchft imported")
    from streamcache import StreamDataset
    from streamcache.replicas import ReplicaLoader, TorchftQuorum

    phase("streamcache imported")
    model, optimizer = _model()
    phase("model made")

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=cfg.min_replicas,
        load_state_dict=load_state_dict, state_dict=state_dict, use_async_quorum=False,
        replica_id=f"group{group}", store_addr="127.0.0.1", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=cfg.lighthouse, hostname="127.0.0.1",
        timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30))
    phase("manager made")
    dataset = StreamDataset(str(Path(cfg.data_dir) / "ds"), batch_size=BATCH, rank=0,
                            world_size=1, seed=SEED,
                            cache_dir=str(Path(cfg.data_dir) / f"cache-g{group}"))
    loader = ReplicaLoader(dataset, num_groups=cfg.groups, group=group)
    quorum = TorchftQuorum(manager, loader)
    phase("loader made")
    first = True
    while True:
        manager.start_quorum()  # a restarted group heals here: model, optimizer, loader
        if first:
            phase("quorum")
            first = False
        before = json.dumps(loader.ledger.to_dict(), sort_keys=True)
        batch = loader.next_batch()
        if batch is None:  # an epoch of no step: the loader moved to the next one
            continue
        ids = [int(i) for i, pad in zip(batch["__id__"].tolist(),
                                         batch["__padding__"].tolist(), strict=True)
               if not pad]
        log.write(json.dumps({"kind": "read", "before": before, "ids": ids, "pid": pid}) + "\n")
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        optimizer.zero_grad()
        loss.backward()
        for work in [manager.allreduce(p.grad) for p in model.parameters()]:
            work.wait()
        groups = quorum.participants()
        ok = manager.should_commit()
        if ok:
            optimizer.step()
        committed = sorted(groups) if ok else []
        epoch, step = loader.ledger.epoch, loader.ledger.step
        loader.commit(committed)
        log.write(json.dumps({"kind": "commit", "t": time.time(), "pid": pid, "epoch": epoch,
                              "step": step, "before": before, "committed": committed,
                              "state": json.dumps(loader.ledger.to_dict(), sort_keys=True)})
                  + "\n")


def worker_entry(cfg_path: str, group: int) -> None:
    """The entry point of the warm launch's processes (started by torch elastic)."""
    worker(Config(**json.loads(Path(cfg_path).read_text())), group)


def launch_warm(cfg_path: str, group: int) -> None:
    """One replica group's torchrun agent through its Python API, its worker forked from a
    forkserver that imported torch, torchft and streamcache."""
    elastic_launch_warm(worker_entry, (cfg_path, group), 1, WARM_MODULES)


# ---------------------------------------------------------------- the driver

class Logs:
    """The groups' JSON lines, read incrementally (the driver polls them while it runs)."""

    def __init__(self, run_dir: Path, groups: int) -> None:
        self.paths = [run_dir / f"g{g}.jsonl" for g in range(groups)]
        self.offsets = [0] * groups
        self.records: list[list[dict[str, Any]]] = [[] for _ in range(groups)]

    def read(self) -> list[list[dict[str, Any]]]:
        for g, path in enumerate(self.paths):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets[g])
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            self.offsets[g] += end
            self.records[g].extend(json.loads(line) for line in data[:end].splitlines()
                                   if line.endswith(b"}"))
        return self.records


def run(cfg_args: argparse.Namespace, data_dir: Path, run_dir: Path,
        chaos: bool) -> dict[str, Any]:
    from torchft._torchft import LighthouseServer

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=cfg_args.min_replicas,
                                  join_timeout_ms=cfg_args.join_ms,
                                  heartbeat_timeout_ms=cfg_args.heartbeat_ms)
    cfg = Config(str(run_dir), str(data_dir), lighthouse.address(), cfg_args.groups,
                 cfg_args.min_replicas)
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg)))
    env = launch_env(run_dir, GLOO_SOCKET_IFNAME="lo")
    procs = []
    for g in range(cfg.groups):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", "1", "--max-restarts", "1000", "--monitor-interval", "0.1",
               __file__, "--worker", str(run_dir / "config.json"), "--group", str(g)]
        if cfg_args.launcher == "warm":
            cmd = [sys.executable, __file__, "--launch", str(run_dir / "config.json"),
                   "--group", str(g)]
        with open(run_dir / f"torchrun-g{g}.log", "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
    faults: list[dict[str, Any]] = []
    logs = Logs(run_dir, cfg.groups)
    try:
        start = _wait(lambda: all(any(r.get("kind") == "commit" and g in r["committed"]
                                      for r in log)
                                  for g, log in enumerate(logs.read())),
                      procs, 300)
        chooser = random.Random(cfg_args.seed)
        next_fault = start + chooser.expovariate(1 / cfg_args.mtbf)
        while time.time() < start + cfg_args.seconds:
            time.sleep(0.02)
            for g, proc in enumerate(procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"torchrun of group {g} exited; see "
                                       f"{run_dir / f'torchrun-g{g}.log'}")
            if not chaos or time.time() < next_fault:
                continue
            time.sleep(0.08)  # (the driver's polls take little of the groups' cores)
            if faults and _back(logs.read(), faults[-1]) is None:
                continue  # one fault at a time: the last killed group is not back yet
            group = chooser.randrange(cfg.groups)
            with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
                pid = int((run_dir / f"pid-g{group}").read_text())
                os.kill(pid, signal.SIGKILL)
                faults.append({"t": time.time(), "group": group, "pid": pid})
            next_fault = time.time() + chooser.expovariate(1 / cfg_args.mtbf)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        lighthouse.shutdown()
        if cfg_args.keep:
            shutil.copytree(run_dir, Path(cfg_args.keep) / run_dir.name, dirs_exist_ok=True)
    return analyze(logs.read(), faults, start, cfg_args.seconds, data_dir, cfg.groups)


def _wait(cond: Any, procs: list[subprocess.Popen[bytes]], timeout: float) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return time.time()
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a group's torchrun exited before the first step")
        time.sleep(0.1)
    raise RuntimeError(f"no step of every group within {timeout} s")


def _back(logs: list[list[dict[str, Any]]], fault: dict[str, Any]) -> float | None:
    """When the killed group's new process was first in a committed step."""
    for r in logs[fault["group"]]:
        if (r.get("kind") == "commit" and r["pid"] != fault["pid"] and r["t"] > fault["t"]
                and fault["group"] in r["committed"]):
            return float(r["t"])
    return None


def analyze(logs: list[list[dict[str, Any]]], faults: list[dict[str, Any]], start: float,
            seconds: float, data_dir: Path, groups: int) -> dict[str, Any]:
    """Samples committed in [start, start + seconds] along the history that survived, and
    exactly-once along it."""
    from streamcache import StreamDataset
    from streamcache.plan import EpochOrder, ShuffleOptions

    reads: dict[tuple[str, int], list[int]] = {}
    after_to: dict[str, tuple[str, list[int], int, float]] = {}
    for g, log in enumerate(logs):
        for r in log:
            if r.get("kind") == "read":
                reads[(r["before"], g)] = r["ids"]
            elif r.get("kind") == "commit":
                # every group writes the same transition; keep the earliest time
                prev = after_to.get(r["state"])
                if prev is None or r["t"] < prev[3]:
                    after_to[r["state"]] = (r["before"], r["committed"], r["epoch"], r["t"])
    # the surviving history ends at the furthest state every later one descends from:
    # take the state with the most steps and walk back
    def rank(state: str) -> tuple[int, int]:
        d = json.loads(state)
        return (d["epoch"], d["step"])

    end = max(after_to, key=rank)
    chain: list[tuple[str, list[int], int, float]] = []
    state = end
    while state in after_to:
        chain.append(after_to[state])
        state = after_to[state][0]
    chain.reverse()
    per_epoch: dict[int, Counter[int]] = {}
    committed_in_t = 0
    unread = 0
    commit_times = []
    for before, committed, epoch, t in chain:
        counter = per_epoch.setdefault(epoch, Counter())
        for g in committed:
            ids = reads.get((before, g))
            if ids is None:
                unread += 1  # the group died after its data went in, before its log line
                continue
            counter.update(ids)
            if t <= start + seconds:
                committed_in_t += len(ids)
        if committed and t <= start + seconds:
            commit_times.append(t)
    index = StreamDataset(str(data_dir / "ds"), batch_size=BATCH, rank=0, world_size=1).index
    per_epoch_samples = index.num_samples // (BATCH * groups) * BATCH * groups
    epochs = []
    last = max(per_epoch) if per_epoch else -1
    for epoch, got in sorted(per_epoch.items()):
        want = set(EpochOrder(index.shard_rows, SEED, epoch, ShuffleOptions())
                   .sample_ids(0, per_epoch_samples).tolist())
        epochs.append({"epoch": epoch, "finished": epoch < last,
                       "lost": len(want - set(got)) if epoch < last else None,
                       "duplicated": sum(c - 1 for c in got.values() if c > 1),
                       "foreign": len(set(got) - want)})
    for fault in faults:
        back = _back(logs, fault)
        fault["back_s"] = None if back is None else back - fault["t"]
        new = [r for r in logs[fault["group"]] if "phase" in r and r["pid"] != fault["pid"]
               and r["t"] >= fault["t"] - 1]
        pid = new[0]["pid"] if new else None
        fault["phases_s"] = {r["phase"]: r["t"] - fault["t"] for r in new if r["pid"] == pid}
        if back is not None:
            fault["phases_s"]["first committed step"] = back - fault["t"]
        window = [t for t in commit_times if fault["t"] - 5 <= t <= (back or fault["t"]) + 5]
        gaps = [b - a for a, b in itertools.pairwise(window)]
        fault["longest_commit_gap_s"] = max(gaps) if gaps else None
    gaps = [b - a for a, b in itertools.pairwise(commit_times)]
    return {"committed_samples": committed_in_t, "commits": len(commit_times),
            "median_commit_gap_s": statistics.median(gaps) if gaps else None,
            "chain_steps": len(chain), "commits_without_read_line": unread,
            "epochs": epochs, "faults": faults}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--launch", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--launcher", choices=("torchrun", "warm"), default="torchrun",
                        help="each group under the torchrun command (new interpreters) or "
                             "torchrun's agent with a preloaded forkserver")
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--min-replicas", type=int, default=0,
                        help="the lighthouse's min_replicas (default: a majority of groups)")
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between kills")
    parser.add_argument("--join-ms", type=int, default=1000,
                        help="the lighthouse's join timeout")
    parser.add_argument("--heartbeat-ms", type=int, default=1000,
                        help="the lighthouse's heartbeat timeout")
    parser.add_argument("--samples", type=int, default=25_600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="copy the runs' logs into this folder")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" /
                                             "replica_chaos.json"))
    args = parser.parse_args(argv)
    if args.worker:
        worker(Config(**json.loads(Path(args.worker).read_text())), args.group)
        return 0
    if args.launch:
        launch_warm(args.launch, args.group)
        return 0
    args.min_replicas = args.min_replicas or args.groups // 2 + 1
    report: dict[str, Any] = {"args": vars(args), "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-replica-chaos-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        make_data(data_dir, args.samples)
        clean = run(args, data_dir, Path(tmp) / "clean", chaos=False)
        print("clean:", json.dumps({k: v for k, v in clean.items() if k != "faults"}),
              flush=True)
        chaos = run(args, data_dir, Path(tmp) / "chaos", chaos=True)
    report.update(clean=clean, chaos=chaos, load_after=os.getloadavg(),
                  goodput=chaos["committed_samples"] / max(1, clean["committed_samples"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print_report(report)
    return 0


def print_report(report: dict[str, Any]) -> None:
    chaos, clean = report["chaos"], report["clean"]
    dup = sum(e["duplicated"] + e["foreign"] for e in chaos["epochs"])
    lost = sum(e["lost"] or 0 for e in chaos["epochs"])
    backs = [f["back_s"] for f in chaos["faults"] if f["back_s"] is not None]
    stalls = [f["longest_commit_gap_s"] for f in chaos["faults"]
              if f["longest_commit_gap_s"] is not None]
    print("| launcher | groups | heartbeat / join ms | goodput (samples committed in T) | "
          "kills | killed group back p50 / worst s | healthy groups' longest stall p50 / "
          "worst s | samples lost / twice | epochs |")
    print("|---|---|---|---|---|---|---|---|---|")

    def fmt(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} / {max(values):.2f}" if values else "-"

    args = report["args"]
    print(f"| {args['launcher']} | {args['groups']} | {args['heartbeat_ms']} / "
          f"{args['join_ms']} | {report['goodput']:.1%} "
          f"({chaos['committed_samples']}/{clean['committed_samples']}) | "
          f"{len(chaos['faults'])} | {fmt(backs)} | {fmt(stalls)} | {lost} / {dup} | "
          f"{len(chaos['epochs'])} |")
    print("\nWhere a killed group's restart goes (s from the SIGKILL, medians):")
    names = [n for n in (*PHASES, "first committed step")
             if any(n in f["phases_s"] for f in chaos["faults"])]
    medians = {n: statistics.median(f["phases_s"][n] for f in chaos["faults"]
                                    if n in f["phases_s"]) for n in names}
    print(", ".join(f"{n} {t:.2f}" for n, t in medians.items()))
    print(f"load average before {report['load_before']}, after {report['load_after']}")


if __name__ == "__main__":
    sys.exit(main())
