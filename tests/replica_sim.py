"""The quorum-trace simulator: replay drops and rejoins of replica groups with real processes.

A *trace* is one :class:`TraceStep` per training step: which groups take part (read their
batch), which of them go on to commit, and whether the step is discarded. The parent builds
it (:func:`make_trace`, with the pure ledger telling where an epoch ends, so a drop can be
placed in its last steps) and replays the same history through the pure ledger
(:func:`expected`) to know what every group must read at every step.

Each group is one process (``tests/dist.py``, gloo on 127.0.0.1). :func:`group_main` runs the
trace: a group that is down skips the step entirely (no collective, no read); a group that
rejoins throws its loader away, builds a fresh one (as a restarted process would) and gets the
state from a live peer through a process group of the step's live ranks
(``broadcast_object_list``), no disk involved; a group that fails during a step reads its
batch and then leaves without taking part in the commit; the committed set comes from
:class:`~streamcache.replicas.ProcessGroupQuorum` (one all-reduce over the surviving ranks).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

from streamcache.replicas import Ledger, ReplicaPlan


@dataclass(frozen=True)
class TraceStep:
    """One step of a quorum trace.

    Attributes:
        up: groups that take part in the step (read their batch).
        committed: groups whose data is in the step's update (a subset of ``up``; the others
            fail during the step and are down at the next one). Empty with ``discard``.
        discard: the step is discarded (nobody commits; the groups stay up).
    """

    up: frozenset[int]
    committed: frozenset[int]
    discard: bool = False

    @property
    def survivors(self) -> frozenset[int]:
        """Groups that finish the step (and take part in its commit all-reduce)."""
        return self.up if self.discard else self.committed


def make_trace(plan: ReplicaPlan, epochs: int, seed: int, *,
               scripted: dict[int, TraceStep] | None = None) -> list[TraceStep]:
    """A random trace over ``epochs`` epochs: groups drop (one or two at once, before or
    during a step) and rejoin after a few steps, some steps are discarded, and a group fails
    during the last step of every epoch. At least one group that finished the previous step
    stays up at every step (someone must hold the current state).
    """
    rng = random.Random(seed)
    groups = frozenset(range(plan.num_groups))
    ledger, trace = Ledger(), []
    down_until: dict[int, int] = {}
    while ledger.epoch < epochs:
        t = len(trace)
        if scripted and t in scripted:
            step = scripted[t]
        else:
            step = _random_step(rng, plan, ledger, t, groups, down_until, trace)
        for g in step.up - step.survivors:
            down_until[g] = t + 1 + rng.randint(1, 4)
        trace.append(step)
        ledger = ledger.committed(plan, step.committed)
    return trace


def _random_step(rng: random.Random, plan: ReplicaPlan, ledger: Ledger, t: int,
                 groups: frozenset[int], down_until: dict[int, int],
                 trace: list[TraceStep]) -> TraceStep:
    previous = trace[-1].survivors if trace else groups
    up = {g for g in groups if down_until.get(g, 0) <= t}
    roll = rng.random()
    continuing = sorted(up & previous)
    if roll < 0.08 and len(continuing) > 2:  # two groups drop at once, before the step
        for g in rng.sample(continuing, 2):
            up.discard(g)
            down_until[g] = t + rng.randint(2, 5)
    if not up & previous:  # someone who holds the current state must be up
        keep = min(previous)
        up.add(keep)
        down_until.pop(keep, None)
    if roll > 0.95:
        return TraceStep(frozenset(up), frozenset(), discard=True)
    last_step = not ledger.pending and ledger.next_fresh + plan.num_groups >= plan.num_slices
    failing: set[int] = set()
    if (last_step or roll > 0.85) and len(up) > 1:
        failing = {rng.choice(sorted(up))}
    return TraceStep(frozenset(up), frozenset(up - failing))


def expected(plan: ReplicaPlan, trace: list[TraceStep]) -> list[Ledger]:
    """The ledger before every step of ``trace`` (and after the last)."""
    ledgers = [Ledger()]
    for step in trace:
        ledgers.append(ledgers[-1].committed(plan, step.committed))
    return ledgers


def state_digest(state: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]


def group_main(rank: int, world_size: int, url: str, cache: str, plan_args: dict[str, Any],
               trace: list[TraceStep]) -> dict[str, Any]:
    """One replica group (one rank) replaying ``trace``; its records for the parent.

    Returns ``{"steps": [...], "transfers": [...]}``: per step taken part in, the epoch,
    slice and sample ids read, whether the group committed, and the digest of the loader
    state after the step; per rejoin, the step and the bytes received.
    """
    import torch.distributed as dist

    from streamcache.loading.dataset import StreamDataset
    from streamcache.replicas import ProcessGroupQuorum, ReplicaLoader, send_state

    group = rank

    def fresh_loader() -> ReplicaLoader:
        dataset = StreamDataset(url, batch_size=plan_args["per_rank"], rank=0, world_size=1,
                                cache_dir=cache, seed=plan_args["seed"])
        return ReplicaLoader(dataset, num_groups=world_size, group=group)

    # Every rank creates every process group the trace needs, in the same order.
    needed = sorted({s.survivors for s in trace} | {s.up for s in trace},
                    key=lambda s: sorted(s))
    pgs = {members: dist.new_group(sorted(members)) for members in needed if members}
    loader = fresh_loader()
    records: list[dict[str, Any]] = []
    transfers: list[dict[str, Any]] = []
    for t, step in enumerate(trace):
        if group not in step.up:
            continue
        previous = trace[t - 1].survivors if t else frozenset(range(world_size))
        rejoining = group not in previous
        if step.up - previous:  # someone rejoins: the live ranks bring them up to date
            source = min(step.up & previous)
            if rejoining:
                loader.close()
                loader = fresh_loader()  # a restarted process knows nothing
            size = send_state(loader, source, pgs[step.up])
            if rejoining:
                transfers.append({"step": t, "bytes": size})
        batch = loader.next_batch()
        record = {"t": t, "epoch": loader.epoch, "slice": loader.current_slice(),
                  "ids": batch["__id__"].tolist(), "padding": batch["__padding__"].tolist(),
                  "rejoined": rejoining}
        records.append(record)
        if group not in step.survivors:
            continue  # fails during the step: no commit, down at the next step
        committed = ProcessGroupQuorum(group, world_size, pgs[step.survivors]).participants()
        if step.discard:
            committed = frozenset()
        record["committed"] = group in committed
        record["committed_set"] = sorted(committed)
        loader.commit(committed)
        record["state"] = state_digest(loader.state_dict())
    loader.close()
    dist.barrier()
    return {"steps": records, "transfers": transfers}


# ---------------------------------------------------------------- SIGKILL and restart

def incarnations(trace: list[TraceStep], group: int) -> list[int]:
    """The steps at which a process of ``group`` starts: the first step it is up, and every
    step at which it is up after not finishing the step before."""
    starts = []
    for t, step in enumerate(trace):
        previous = trace[t - 1].survivors if t else frozenset()
        if group in step.up and group not in previous:
            starts.append(t)
    return starts


def killed_main(group: int, start: int, port: int, url: str, cache: str,
                plan_args: dict[str, Any], trace: list[TraceStep], log_path: str) -> None:
    """One process of one replica group, from step ``start`` until the trace takes it down,
    when it SIGKILLs itself (after reading its batch if it fails during the step, after
    committing if it drops before the next one). Process groups are built per membership
    directly on the parent's TCPStore, as a fault-tolerance library reconfigures them per
    quorum; a process started late joins the transfer group of its first step and gets the
    loader state from a live peer. Records go to ``log_path`` as JSON lines, flushed, so a
    killed process's reads survive it."""
    import datetime
    import os
    import signal

    import torch.distributed as dist

    from streamcache.loading.dataset import StreamDataset
    from streamcache.replicas import ProcessGroupQuorum, ReplicaLoader, broadcast_state

    num_groups = plan_args["groups"]
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))

    def process_group(name: str, members: frozenset[int]) -> Any:
        ranks = sorted(members)
        return dist.ProcessGroupGloo(dist.PrefixStore(name, store), ranks.index(group),
                                     len(ranks), datetime.timedelta(seconds=60))

    dataset = StreamDataset(url, batch_size=plan_args["per_rank"], rank=0, world_size=1,
                            cache_dir=cache, seed=plan_args["seed"])
    loader = ReplicaLoader(dataset, num_groups=num_groups, group=group)
    commit_pg: Any = None
    with open(log_path, "a", buffering=1) as log:
        for t in range(start, len(trace)):
            step = trace[t]
            previous = trace[t - 1].survivors if t else frozenset(range(num_groups))
            if step.up - previous:  # someone rejoins: a group for the transfer
                source = min(step.up & previous)
                pg = process_group(f"xfer/{t}", step.up)
                size = broadcast_state(loader, sorted(step.up).index(source), pg)
                if t == start and t:
                    log.write(json.dumps({"kind": "transfer", "t": t, "bytes": size}) + "\n")
            batch = loader.next_batch()
            log.write(json.dumps({"kind": "read", "t": t, "epoch": loader.epoch,
                                  "slice": loader.current_slice(),
                                  "ids": batch["__id__"].tolist(),
                                  "padding": batch["__padding__"].tolist(),
                                  "first": t == start}) + "\n")
            if group not in step.survivors:
                os.kill(os.getpid(), signal.SIGKILL)  # fails during the step
            if commit_pg is None or step.survivors != previous:
                commit_pg = process_group(f"commit/{t}", step.survivors)
            committed = ProcessGroupQuorum(group, num_groups, commit_pg).participants()
            if step.discard:
                committed = frozenset()
            loader.commit(committed)
            log.write(json.dumps({"kind": "commit", "t": t, "committed": sorted(committed),
                                  "state": state_digest(loader.state_dict())}) + "\n")
            if t + 1 < len(trace) and group not in trace[t + 1].up:
                os.kill(os.getpid(), signal.SIGKILL)  # down before the next step
    loader.close()


def run_killed(trace: list[TraceStep], url: str, cache: str, plan_args: dict[str, Any],
               logs: str, timeout_s: float = 120) -> dict[str, int]:
    """Replay ``trace`` with one process per group, SIGKILLed where the trace takes a group
    down and started again where it comes back; returns each group's exit codes count.

    Raises:
        AssertionError: a process exited other than by its planned SIGKILL or normally, or
            the run outlived ``timeout_s``.
    """
    import os
    import signal
    import time

    from dist import process_context

    ctx = process_context()  # forks of a server that imported torch (spawn: 1-2 s a process)
    # The store lives in a process of its own, so that nothing of it (its server thread, its
    # connections to SIGKILLed clients) can outlive or block the caller.
    receive, send = ctx.Pipe(duplex=False)
    store_process = ctx.Process(target=serve_store, args=(send,), name="store", daemon=True)
    store_process.start()
    assert receive.poll(60), "the store process did not start"
    port = receive.recv()
    plan = {g: incarnations(trace, g) for g in range(plan_args["groups"])}
    running: dict[int, Any] = {}
    started = {g: 0 for g in plan}
    kills = {g: 0 for g in plan}

    def spawn(g: int) -> None:
        start = plan[g][started[g]]
        started[g] += 1
        running[g] = ctx.Process(target=killed_main, name=f"group-{g}", args=(
            g, start, port, url, cache, plan_args, trace,
            os.path.join(logs, f"g{g}-{start}.jsonl")))
        running[g].start()

    for g in plan:
        if plan[g]:
            spawn(g)
    deadline = time.monotonic() + timeout_s
    try:
        while running:
            assert time.monotonic() < deadline, f"timed out; still running: {sorted(running)}"
            for g, proc in list(running.items()):
                if proc.exitcode is None:
                    continue
                del running[g]
                if proc.exitcode == -signal.SIGKILL:
                    kills[g] += 1
                    if started[g] < len(plan[g]):
                        spawn(g)  # started at once: it waits for its step in the store
                else:
                    assert proc.exitcode == 0, f"group {g} exited with {proc.exitcode}"
            time.sleep(0.02)
    finally:
        for proc in [*running.values(), store_process]:
            proc.kill()
            proc.join()
    return kills


def serve_store(send: Any) -> None:
    """Host the TCPStore of :func:`run_killed` until killed; sends its port."""
    import time

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    send.send(store.port)
    while True:
        time.sleep(1)


def read_logs(logs: str) -> list[tuple[int, dict[str, Any]]]:
    """(group, record) of every complete JSON line the processes wrote."""
    import os

    out = []
    for name in sorted(os.listdir(logs)):
        group = int(name[1:].split("-")[0])
        with open(os.path.join(logs, name)) as f:
            for line in f:
                try:
                    out.append((group, json.loads(line)))
                except json.JSONDecodeError:  # cut by a SIGKILL
                    continue
    return out
