"""Replica groups dropping out and rejoining: streamcache's ledger vs torchft's sampler.

Run:
  python benchmarks/bench_replicas.py sampler [--seeds 20]
      The same quorum traces (tests/replica_sim.py: drops before and during steps, two at
      once, discarded steps, a failure in the last step of every epoch; 4 groups, 200
      samples, global batch 8, 2 epochs) through
        - streamcache's ledger (the pure plan; tests/test_replicas_dist.py shows that real
          processes read exactly what it says), and
        - torchft.data.DistributedSampler (torchft's own class when torchft imports, else
          torch's DistributedSampler with the same rank arithmetic, and the table says so),
          driven the way torchft's training loop drives it: each group iterates its own
          shard, a batch is drawn when the group takes part in a step, whether or not the
          step commits. Two ways a recovered group can resume its data loader:
            restart   a fresh DataLoader for the epoch (torchft's healing moves the model and
                      optimizer, not the data loader): the group's shard starts over;
            peer      the data-loader state of a live peer (what streamcache does), applied
                      to the recovered group's own shard: it skips what it missed.
      Counts per epoch: samples of the epoch never committed (lost), committed more than
      once (duplicated), and steps taken; plus the loader state's size.
  /tmp/ft-venv/bin/python benchmarks/bench_replicas.py manager [--epochs 2]
      torchft for real: a Lighthouse, four replica groups (one process each) with a torchft
      Manager (use_async_quorum=False), ProcessGroupGloo and a ReplicaLoader connected by
      TorchftQuorum. The parent SIGKILLs groups while they train (one, then two at once,
      then one in the last steps of an epoch) and restarts them; a restarted group heals
      from a live peer through torchft's own state transfer, loader state included. Checks
      that every sample of every epoch is committed exactly once.

Writes benchmarks/out/bench_replicas.json. Last results: docs/replicas.md ("Measured").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
OUT = os.path.join(HERE, "out")

GROUPS, PER_RANK, NUM_SAMPLES, SEED = 4, 2, 200, 11


# ---------------------------------------------------------------- sampler side by side

def sampler_class() -> tuple[Any, str]:
    try:
        from torchft.data import DistributedSampler

        return DistributedSampler, "torchft.data.DistributedSampler"
    except ImportError:
        from torch.utils.data import DistributedSampler as TorchSampler

        class Equivalent(TorchSampler):  # type: ignore[misc, type-arg]
            """torchft's sampler is exactly this: global rank ``group_rank + R * group``."""

            def __init__(self, dataset: Any, replica_rank: int, num_replica_groups: int,
                         group_rank: int = 0, num_replicas: int = 1, **kw: Any) -> None:
                super().__init__(dataset, rank=group_rank + num_replicas * replica_rank,
                                 num_replicas=num_replicas * num_replica_groups, **kw)

        return Equivalent, "torch DistributedSampler with torchft's rank arithmetic"


def torchft_epoch(trace: list[Any], epoch: int, recovery: str,
                  before: frozenset[int]) -> dict[str, Any]:
    """One epoch of torchft's sampler under ``trace`` (the steps of this epoch; ``before``:
    the groups that finished the step before it)."""
    sampler_cls, _ = sampler_class()
    samplers = [sampler_cls(range(NUM_SAMPLES), replica_rank=g, num_replica_groups=GROUPS,
                            group_rank=0, num_replicas=1, shuffle=True, seed=SEED,
                            drop_last=True) for g in range(GROUPS)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    shards = [list(iter(s)) for s in samplers]
    steps = len(shards[0]) // PER_RANK
    drawn = [0] * GROUPS  # batches each group's data loader has produced
    committed: list[int] = []
    previous = before
    for t in range(steps):
        step = trace[t] if t < len(trace) else None
        up = step.up if step else frozenset(range(GROUPS))
        for g in sorted(up - previous):  # recovered this step
            if recovery == "restart":
                drawn[g] = 0
            else:  # a live peer's loader position, on the group's own shard
                drawn[g] = max(drawn[p] for p in up & previous)
        for g in sorted(up):
            batch = shards[g][drawn[g] * PER_RANK:(drawn[g] + 1) * PER_RANK]
            drawn[g] += 1
            if step is None or (g in step.committed and not step.discard):
                committed.extend(batch)
        previous = step.survivors if step else frozenset(range(GROUPS))
    counts = Counter(committed)
    everything = set().union(*map(set, shards))
    return {"lost": len(everything - set(counts)),
            "duplicated": sum(c - 1 for c in counts.values() if c > 1), "steps": steps}


def streamcache_epochs(trace: list[Any]) -> list[dict[str, Any]]:
    from replica_sim import expected

    from streamcache.replicas import PAD_SLICE, ReplicaPlan

    plan = ReplicaPlan(NUM_SAMPLES, GROUPS * PER_RANK, GROUPS)
    ledgers = expected(plan, trace)
    results: dict[int, dict[str, Any]] = {}
    for t, step in enumerate(trace):
        ledger = ledgers[t]
        result = results.setdefault(ledger.epoch, {"positions": Counter(), "steps": 0,
                                                   "state_bytes": 0, "failed": 0})
        result["steps"] += 1
        result["failed"] += len(step.up) < GROUPS or step.committed != step.up
        result["state_bytes"] = max(result["state_bytes"], len(json.dumps(ledger.to_dict())))
        slices = ledger.assignment(plan)
        for g in step.committed:
            if slices[g] != PAD_SLICE:
                positions, _ = plan.rank_positions(slices[g], g, 0)
                result["positions"].update(positions.tolist())
    total = NUM_SAMPLES // plan.global_batch * plan.global_batch
    out = []
    for epoch in sorted(results):
        counts = results[epoch]["positions"]
        out.append({"lost": total - len(counts),
                    "duplicated": sum(c - 1 for c in counts.values() if c > 1),
                    "steps": results[epoch]["steps"],
                    "ledger_bytes_max": results[epoch]["state_bytes"],
                    "failure_steps": results[epoch]["failed"]})
    return out


def run_sampler(seeds: int) -> dict[str, Any]:
    from replica_sim import make_trace

    from streamcache.replicas import ReplicaPlan

    plan = ReplicaPlan(NUM_SAMPLES, GROUPS * PER_RANK, GROUPS)
    rows = []
    for seed in range(seeds):
        trace = make_trace(plan, epochs=2, seed=seed)
        ours = streamcache_epochs(trace)
        steps = NUM_SAMPLES // (GROUPS * PER_RANK)  # torchft's epoch: a fixed step count
        for epoch in (0, 1):
            # the same failures, step for step: torchft's epoch e is steps [e*25, e*25+25)
            window = trace[epoch * steps:(epoch + 1) * steps]
            before = trace[epoch * steps - 1].survivors if epoch else frozenset(range(GROUPS))
            row = {"seed": seed, "epoch": epoch, "streamcache": ours[epoch]}
            for recovery in ("restart", "peer"):
                row[f"torchft_{recovery}"] = torchft_epoch(window, epoch, recovery, before)
            rows.append(row)
    _, sampler_name = sampler_class()
    summary = summarize(rows)
    print(f"sampler: {sampler_name}; {seeds} traces x 2 epochs; 4 groups, {NUM_SAMPLES} "
          f"samples, global batch {GROUPS * PER_RANK}")
    print(f"{'loader':<22}{'lost/epoch':>12}{'dup/epoch':>12}{'max lost':>10}"
          f"{'max dup':>9}{'steps/epoch':>13}")
    for name, s in summary.items():
        print(f"{name:<22}{s['lost_mean']:>12.1f}{s['dup_mean']:>12.1f}{s['lost_max']:>10}"
              f"{s['dup_max']:>9}{s['steps_mean']:>13.1f}")
    ledger_max = max(r["streamcache"]["ledger_bytes_max"] for r in rows)
    print(f"streamcache ledger: at most {ledger_max} bytes of JSON in any step of any trace")
    return {"sampler": sampler_name, "rows": rows, "summary": summary,
            "ledger_bytes_max": ledger_max}


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for name in ("streamcache", "torchft_restart", "torchft_peer"):
        lost = [r[name]["lost"] for r in rows]
        dup = [r[name]["duplicated"] for r in rows]
        steps = [r[name]["steps"] for r in rows]
        out[name] = {"lost_mean": sum(lost) / len(lost), "lost_max": max(lost),
                     "dup_mean": sum(dup) / len(dup), "dup_max": max(dup),
                     "steps_mean": sum(steps) / len(steps)}
    return out


# ---------------------------------------------------------------- torchft for real

def ft_replica(group: int, lighthouse: str, url: str, cache: str, log_path: str,
               epochs: int, min_replicas: int) -> None:
    """One replica group (one process) training under a torchft Manager."""
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from streamcache.loading.dataset import StreamDataset
    from streamcache.replicas import ReplicaLoader, TorchftQuorum

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=min_replicas,
        load_state_dict=model.load_state_dict, state_dict=model.state_dict,
        use_async_quorum=False, replica_id=f"group{group}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
        hostname="127.0.0.1", timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=30))
    dataset = StreamDataset(url, batch_size=PER_RANK, rank=0, world_size=1, cache_dir=cache,
                            seed=SEED)
    loader = ReplicaLoader(dataset, num_groups=GROUPS, group=group)
    quorum = TorchftQuorum(manager, loader)
    with open(log_path, "a", buffering=1) as log:
        while loader.epoch < epochs:
            manager.start_quorum()  # a healing replica loads model and loader state here
            ledger = loader.ledger
            before = json.dumps(ledger.to_dict(), sort_keys=True)
            batch = loader.next_batch()
            log.write(json.dumps({"kind": "read", "epoch": ledger.epoch, "step": ledger.step,
                                  "before": before, "slice": loader.current_slice(),
                                  "pid": os.getpid(),
                                  "ids": batch["__id__"].tolist(),
                                  "padding": batch["__padding__"].tolist(),
                                  "healed": manager.current_step()}) + "\n")
            model.zero_grad()
            x = batch["x"].float()[:, None]
            model(x).pow(2).mean().backward()
            for p in model.parameters():
                manager.allreduce(p.grad).wait()
            groups = quorum.participants()
            ok = manager.should_commit()
            committed = sorted(groups) if ok else []
            loader.commit(committed)
            log.write(json.dumps({"kind": "commit", "epoch": ledger.epoch,
                                  "step": ledger.step, "committed": committed,
                                  "before": before, "quorum_step": manager.current_step(),
                                  "state": json.dumps(loader.ledger.to_dict(),
                                                      sort_keys=True)}) + "\n")
            time.sleep(0.1)  # a model's step: gives restarted groups time to come back
    manager.shutdown(wait=False)
    os._exit(0)


def run_manager(epochs: int, min_replicas: int) -> dict[str, Any]:
    import multiprocessing as mp
    import signal
    import tempfile

    from loader_helpers import make_dataset
    from torchft._torchft import LighthouseServer

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    folder = tempfile.mkdtemp(prefix="bench-replicas-")
    url = make_dataset(folder, [37, 50, 13, 60, 40], seq=False)
    cache = os.path.join(folder, "cache")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas,
                                  join_timeout_ms=1000)
    address = lighthouse.address()
    ctx = mp.get_context("spawn")
    procs: dict[int, Any] = {}
    logs = os.path.join(folder, "logs")
    os.makedirs(logs)

    def start(g: int) -> None:
        procs[g] = ctx.Process(target=ft_replica, args=(g, address, url, cache,
                                                        os.path.join(logs, f"g{g}.jsonl"),
                                                        epochs, min_replicas))
        procs[g].start()

    def progress() -> tuple[int, int, int]:
        """(epoch, step, fresh slices left) of the furthest commit record."""
        best = (0, 0, 10**9)
        for name in os.listdir(logs):
            with open(os.path.join(logs, name)) as f:
                for rec in _records(f):
                    if rec["kind"] == "commit" and (rec["epoch"], rec["step"]) >= best[:2]:
                        left = NUM_SAMPLES // PER_RANK - json.loads(rec["state"])["next_fresh"]
                        best = (rec["epoch"], rec["step"], left)
        return best

    def wait_for(cond: Any, timeout: float = 120) -> tuple[int, int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = progress()
            if cond(p):
                return p
            time.sleep(0.1)  # a model's step: gives restarted groups time to come back
        raise TimeoutError(f"no progress: {progress()}")

    events = []
    started = time.monotonic()
    for g in range(GROUPS):
        start(g)

    def kill(groups: list[int]) -> None:
        at = progress()
        for g in groups:
            os.kill(procs[g].pid, signal.SIGKILL)
            procs[g].join()
        events.append({"kill": groups, "at": at[:2]})

    def restart(groups: list[int]) -> None:
        for g in groups:
            start(g)
        events.append({"restart": groups, "at": progress()[:2]})

    wait_for(lambda p: p[:2] >= (0, 3))
    kill([1])
    wait_for(lambda p: p[:2] >= (0, 7))
    restart([1])
    wait_for(lambda p: p[:2] >= (0, 11))
    kill([2, 3])
    wait_for(lambda p: p[:2] >= (0, 15))
    restart([2, 3])
    wait_for(lambda p: (p[0] == 0 and p[2] <= GROUPS * 2) or p[0] >= 1)  # last steps
    kill([0])
    restart([0])
    for proc in procs.values():
        proc.join(timeout=300)
    elapsed = time.monotonic() - started
    lighthouse.shutdown()
    return check_manager_logs(logs, epochs, url, events, elapsed)


def check_manager_logs(logs: str, epochs: int, url: str, events: list[Any],
                       elapsed: float) -> dict[str, Any]:
    """Exactly-once along the history that survived.

    With torchft, a replica that trained in a quorum of its own (possible while the
    lighthouse's ``min_replicas`` is below a majority) is overwritten when it heals: its
    steps are not in the final model. So the committed history is the chain of ledger states
    that leads to the final state: walk it backwards (every commit record holds the ledger
    before and after the step) and count, per epoch, the samples the committed groups read
    at each step of that chain.
    """
    from streamcache.loading.dataset import StreamDataset
    from streamcache.plan import EpochOrder, ShuffleOptions
    from streamcache.replicas import Ledger, ReplicaPlan

    reads: dict[tuple[str, int], list[int]] = {}
    first_reads: dict[int, tuple[int, str, int]] = {}  # pid -> (group, before, slice)
    after_to: dict[str, tuple[str, list[int], int, int]] = {}
    records = 0
    for name in sorted(os.listdir(logs)):
        group = int(name[1:].split(".")[0])
        with open(os.path.join(logs, name)) as f:
            for rec in _records(f):
                if rec["kind"] == "read":
                    first_reads.setdefault(rec["pid"], (group, rec["before"], rec["slice"]))
                    reads[(rec["before"], group)] = [
                        i for i, pad in zip(rec["ids"], rec["padding"], strict=True) if not pad]
                else:
                    records += 1
                    after_to[rec["state"]] = (rec["before"], rec["committed"], rec["epoch"],
                                              rec["step"])
    finals = [s for s in after_to if json.loads(s)["epoch"] == epochs]
    index = StreamDataset(url, batch_size=PER_RANK, rank=0, world_size=1).index
    total = NUM_SAMPLES // (GROUPS * PER_RANK) * (GROUPS * PER_RANK)
    counts: dict[int, Counter[int]] = {e: Counter() for e in range(epochs)}
    steps = {e: 0 for e in range(epochs)}
    state, chain = finals[0] if finals else "", 0
    start = json.dumps(Ledger().to_dict(), sort_keys=True)
    while state in after_to and state != start:
        before, committed, epoch, _ = after_to[state]
        for group in committed:
            counts[epoch].update(reads[(before, group)])
        steps[epoch] += 1
        chain += 1
        state = before
    chain_states = set()
    state = finals[0] if finals else ""
    while state in after_to and state != start:
        chain_states.add(after_to[state][0])
        state = after_to[state][0]
    plan = ReplicaPlan(NUM_SAMPLES, GROUPS * PER_RANK, GROUPS)
    rejoins = [{"group": g, "at": [json.loads(before)["epoch"], json.loads(before)["step"]],
                "on_surviving_history": before in chain_states,
                "slice_as_planned": Ledger.from_dict(json.loads(before), plan)
                .assignment(plan)[g] == slice_index}
               for g, before, slice_index in first_reads.values()]
    orphans = sum(1 for s_after, (_, committed, _, _) in after_to.items()
                  if committed and s_after not in chain_states and s_after not in finals)
    result: dict[str, Any] = {"events": events, "elapsed_s": round(elapsed, 1),
                              "commit_records": records, "chain_steps": chain,
                              "reached_start": state == start,
                              "commits_off_the_surviving_history": orphans,
                              "first_batches": rejoins, "epochs": []}
    for epoch in range(epochs):
        want = set(EpochOrder(index.shard_rows, SEED, epoch, ShuffleOptions())
                   .sample_ids(0, total).tolist())
        got = counts[epoch]
        result["epochs"].append({
            "epoch": epoch, "steps": steps[epoch], "lost": len(want - set(got)),
            "duplicated": sum(c - 1 for c in got.values() if c > 1),
            "foreign": len(set(got) - want)})
    print(json.dumps(result, indent=1))
    return result


def _records(lines: Any) -> Any:
    for line in lines:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:  # the last line of a process killed while writing
            continue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sampler = sub.add_parser("sampler")
    sampler.add_argument("--seeds", type=int, default=20)
    manager = sub.add_parser("manager")
    manager.add_argument("--epochs", type=int, default=2)
    manager.add_argument("--min-replicas", type=int, default=2)
    args = parser.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "bench_replicas.json")
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    if args.what == "sampler":
        results["sampler"] = run_sampler(args.seeds)
    else:
        results[f"manager_min{args.min_replicas}"] = run_manager(args.epochs,
                                                                 args.min_replicas)
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
