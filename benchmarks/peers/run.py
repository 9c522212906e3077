"""streamcache against its peers, one command: build, measure (interleaved, repeated), report.

Run (after the setup in benchmarks/peers/README.md):

    /tmp/peers-venv/bin/python benchmarks/peers/run.py [--repeats 3] [--scale 1.0]

Data: tokens (1 KB samples, int32[256]) and blobs (100 KB samples, uint8[100000]), about
200 MB each at --scale 1, written once into each system's native format under
benchmarks/out/peers/data (shards of about 16 MB, uncompressed) and uploaded to a loopback S3
server (moto) for the cold runs.

Systems: streamcache, Mosaic Streaming, LitData, WebDataset, torchdata StatefulDataLoader
and a plain DataLoader (both map-style over a numpy memmap of the same data), and the raw
page-cache limit (numpy fancy-index gather of sorted shuffled batches, one process).

Cases, each in a fresh process, interleaved (system order rotated each repeat):
  warm-w0 / warm-w2   one shuffled epoch from the page cache, num_workers 0 / 2
  cold-w2             one epoch from the loopback S3 server into an empty cache, 2 workers
  resume              time to first batch fresh, then after a load_state_dict at 50% of the
                      epoch (2 workers); duplicates/skips by sample id (first repeat)
  elastic             (once) 2 simulated ranks stop at 50%, 4 ranks resume from rank 0's
                      state with the global batch fixed; duplicates/skips by sample id
Rates are steady state: from the first batch to the end of the epoch, or to 6 s after the
first batch when that comes first (the slowest peers would take minutes per epoch); start-up
is the first-batch time. Resume repeats after the first only time the first batch.
Writes benchmarks/out/peers/results.json, the "Peer comparison" section of
benchmarks/RESULTS.md and benchmarks/peers_throughput.png / peers_resume.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import (  # noqa: E402
    BUCKET,
    DATA,
    DATASETS,
    OUT,
    REPO,
    Spec,
    aws_env,
    generate,
    log,
    native_dir,
    num_samples,
    s3_key,
    use_streamcache_snapshot,
)

STREAMCACHE_SOURCE = use_streamcache_snapshot()  # before anything imports streamcache

from jobs import ADAPTERS, adapter, run_job  # noqa: E402

SYSTEMS = list(ADAPTERS)
REMOTE_SYSTEMS = ["streamcache", "mosaic", "litdata", "webdataset"]
CASES = ["warm-w0", "warm-w2", "cold-w2", "resume"]
JOB_TIMEOUT_S = 150
BUDGET_S = 6.0  # a throughput run stops this long after its first batch (steady state)


# ------------------------------------------------------------------------------ building


def build_all(scale: float) -> None:
    for data, (_, _, _, default_n) in DATASETS.items():
        n = int(default_n * scale) // 1024 * 1024 or 1024
        marker = os.path.join(DATA, f"{data}.n")
        if not os.path.exists(marker) or num_samples(data) != n:
            log(f"generating {data}: {n} samples")
            generate(data, n)
            for system in SYSTEMS:
                _remove_marker(system, data)
        for system in SYSTEMS:
            done = native_dir(system, data) + ".done"
            if os.path.exists(done):
                continue
            log(f"building {system}/{data}")
            started = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--build", system, data], check=True)
            with open(done, "w") as f:
                json.dump({"n": n, "build_s": time.perf_counter() - started}, f)


def _remove_marker(system: str, data: str) -> None:
    done = native_dir(system, data) + ".done"
    if os.path.exists(done):
        os.remove(done)


def build_one(system: str, data: str) -> None:
    import shutil

    from common import source_array

    out = native_dir(system, data)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    adapter(system).build(data, source_array(data), out)


# ------------------------------------------------------------------------------ S3


class LoopbackS3:
    """moto on 127.0.0.1 holding every remote-capable system's native copy."""

    def __init__(self) -> None:
        sys.path.insert(0, os.path.join(REPO, "tests"))
        from servers import MotoServer

        os.environ.update(aws_env())
        self.server = MotoServer().start()
        self.endpoint = self.server.endpoint_url

    def upload(self) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        for system in REMOTE_SYSTEMS:
            for data in DATASETS:
                folder = native_dir(system, data)
                for root, _, files in os.walk(folder):
                    for name in files:
                        path = os.path.join(root, name)
                        key = s3_key(system, data) + "/" + os.path.relpath(path, folder)
                        client.upload_file(path, BUCKET, key)

    def close(self) -> None:
        self.server.stop()


# ------------------------------------------------------------------------------ running


def spawn(job: dict[str, Any], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A job in its own process group, so that a hung job's DataLoader workers go with it."""
    return subprocess.Popen([sys.executable, __file__, "--job", json.dumps(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def collect(process: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        stdout, stderr = process.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(process.pid, signal.SIGKILL)  # the job and the workers it started
        process.communicate()
        return {"error": f"hung: no result after {JOB_TIMEOUT_S} s (killed)"}
    lines = stdout.strip().splitlines()
    if process.returncode != 0 or not lines:
        tail = [line for line in stderr.strip().splitlines() if line.strip()]
        return {"error": (tail[-1] if tail else f"exit {process.returncode}")[:300]}
    return json.loads(lines[-1])


def run_case(system: str, data: str, case: str, endpoint: str, exact: bool) -> dict[str, Any]:
    reason = cannot(system, case)
    if reason:
        return {"cannot": reason}
    spec = Spec(data=data, workers=0 if case == "warm-w0" else 2)
    job: dict[str, Any] = {"system": system, "kind": "throughput", "budget_s": BUDGET_S}
    if case == "cold-w2":
        spec.source, spec.endpoint = "s3", endpoint
        spec.cache_dir = tempfile.mkdtemp(prefix=f"peers-cold-{system}-")
    if case == "resume":
        job.update(kind="resume", exact=exact)
    job["spec"] = spec.__dict__
    result = collect(spawn(job, aws_env(endpoint)))
    if spec.cache_dir:
        import shutil

        shutil.rmtree(spec.cache_dir, ignore_errors=True)
    return result


def cannot(system: str, case: str) -> str:
    reasons = adapter(system).CANNOT
    return reasons.get(case.split("-")[0]) or reasons.get(case.split("-")[-1]) or ""


def elastic(system: str, data: str, before: int = 2, after: int = 4) -> dict[str, Any]:
    """2 ranks stop at 50% of the epoch; 4 ranks resume from rank 0's state; the global batch
    stays the same. Every rank is its own process, all ranks of a phase at once."""
    reason = cannot(system, "elastic")
    if reason:
        return {"cannot": reason}
    import numpy as np
    from jobs import exactness

    global_batch = DATASETS[data][2]
    steps = num_samples(data) // global_batch
    work = tempfile.mkdtemp(prefix=f"peers-elastic-{system}-")
    peer = adapter(system)
    phases = [(before, steps // 2, None), (after, None, os.path.join(work, "p0-r0.state.json"))]
    for phase, (world, take, state_file) in enumerate(phases):
        processes = []
        port = str(_free_port())  # for a peer that rendezvouses through torch.distributed
        for rank in range(world):
            spec = Spec(data=data, rank=rank, world_size=world)
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            if hasattr(peer, "rank_env"):
                env.update(peer.rank_env(spec))
            job = {"system": system, "kind": "rank", "spec": spec.__dict__, "steps": take,
                   "global_batch": global_batch, "state_file": state_file,
                   "save_state": phase == 0 and rank == 0,
                   "out": os.path.join(work, f"p{phase}-r{rank}")}
            processes.append(spawn(job, env))
        for process in processes:
            result = collect(process)
            if "error" in result:
                import shutil

                shutil.rmtree(work, ignore_errors=True)
                return {"error": f"phase {phase}: {result['error']}"}
    ids = [np.load(os.path.join(work, name)) for name in sorted(os.listdir(work))
           if name.endswith(".ids.npy")]
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    result = exactness(np.concatenate(ids).astype(np.int64), num_samples(data))
    if getattr(peer, "ELASTIC_NOTE", ""):
        result["note"] = peer.ELASTIC_NOTE
    return result


def snapshot_head() -> str:
    """Export streamcache/ of the HEAD commit with the installed native extension beside it
    (other engineers edit the working tree while this runs; a commit can be named). Named by
    the last commit that changed streamcache/ or csrc/."""
    import glob
    import importlib.util
    import shutil

    commit = subprocess.run(["git", "-C", REPO, "log", "-1", "--format=%h", "HEAD", "--",
                             "streamcache", "csrc"],
                            capture_output=True, text=True, check=True).stdout.strip()
    target = os.path.join(OUT, f"streamcache-{commit}")
    if not os.path.exists(os.path.join(target, "COMMIT")):
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        archive = subprocess.run(["git", "-C", REPO, "archive", "HEAD", "streamcache"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", target], input=archive, check=True)
        spec = importlib.util.find_spec("streamcache")
        assert spec is not None and spec.submodule_search_locations is not None
        for folder in [*spec.submodule_search_locations, *sys.path]:
            found = glob.glob(os.path.join(folder, "streamcache", "_core*.so")) + \
                glob.glob(os.path.join(folder, "_core*.so"))
            if found:
                shutil.copy(found[0], os.path.join(target, "streamcache"))
                break
        with open(os.path.join(target, "COMMIT"), "w") as f:
            f.write(commit)
    return target


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ["torch", "numpy", "pyarrow", "streamcache", "mosaicml-streaming", "litdata",
                 "webdataset", "torchdata", "moto", "s3fs", "matplotlib"]:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    out["streamcache commit"] = commit
    out["streamcache source"] = STREAMCACHE_SOURCE
    if STREAMCACHE_SOURCE.startswith("/"):
        marker = os.path.join(STREAMCACHE_SOURCE, "COMMIT")
        if os.path.exists(marker):
            with open(marker) as f:
                out["streamcache commit"] = f.read().strip()
    else:
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "streamcache",
                                "csrc"], capture_output=True, text=True).stdout.strip()
        if dirty:
            out["streamcache commit"] += " + uncommitted changes in the working tree"
    return out


def measure(repeats: int, endpoint: str) -> list[dict[str, Any]]:
    runs = []
    for repeat in range(repeats):
        for data in DATASETS:
            for case in CASES:
                order = SYSTEMS[repeat % len(SYSTEMS):] + SYSTEMS[:repeat % len(SYSTEMS)]
                for system in order:
                    result = run_case(system, data, case, endpoint, exact=repeat == 0)
                    log(f"[{repeat}] {data:<7}{case:<9}{system:<12}{_short(result)}")
                    runs.append({"repeat": repeat, "data": data, "case": case,
                                 "system": system, **result})
    return runs


def _short(result: dict[str, Any]) -> str:
    if "samples_per_s" in result:
        return f"{result['samples_per_s']:,.0f} samples/s, 1st {result['first_batch_s']:.3f} s"
    if "resume_first_batch_s" in result:
        return (f"1st {result['first_batch_s']:.3f} s, after resume "
                f"{result['resume_first_batch_s']:.3f} s {result.get('exact', '')}")
    return str(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="dataset size relative to ~200 MB per dataset")
    parser.add_argument("--systems", help="comma-separated subset (default: all)")
    parser.add_argument("--cases", help="comma-separated subset of " + ",".join(CASES) +
                        "; with --merge, replaces those cases in the last results.json")
    parser.add_argument("--merge", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--live", action="store_true",
                        help="measure the working tree through the editable install instead "
                             "of a snapshot of the HEAD commit")
    parser.add_argument("--machine", default="",
                        help="what else ran on the machine (written beside the load average)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--build", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(run_job(json.loads(args.job))))
        return 0
    if args.build:
        build_one(*args.build)
        return 0
    if args.systems:
        SYSTEMS[:] = [s for s in SYSTEMS if s in args.systems.split(",")]
    if args.cases:
        CASES[:] = [c for c in CASES if c in args.cases.split(",")]
    from report import write_report

    global STREAMCACHE_SOURCE
    if not args.live and not os.environ.get("PEERS_STREAMCACHE_SRC"):
        os.environ["PEERS_STREAMCACHE_SRC"] = STREAMCACHE_SOURCE = snapshot_head()
    log(f"streamcache measured from: {STREAMCACHE_SOURCE}")
    started = time.time()
    build_all(args.scale)
    s3 = LoopbackS3()
    try:
        log(f"uploading to {s3.endpoint}")
        s3.upload()
        load_before = os.getloadavg()
        runs = measure(args.repeats, s3.endpoint)
        elastic_runs = {} if args.merge else {
            f"{system}/tokens": elastic(system, "tokens") for system in SYSTEMS}
        load_after = os.getloadavg()
    finally:
        s3.close()
    results = {"versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": " ".join(["python benchmarks/peers/run.py", *(argv or sys.argv[1:])]),
               "repeats": args.repeats, "scale": args.scale, "load_before": load_before,
               "load_after": load_after, "wall_s": time.time() - started,
               "datasets": {d: {"samples": num_samples(d), "batch": DATASETS[d][2],
                                "sample_bytes": _sample_bytes(d)} for d in DATASETS},
               "runs": runs, "elastic": elastic_runs, "cpus": os.cpu_count(),
               "machine": args.machine}
    if args.merge:
        results = merged(results)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(write_report(results))
    return 0


def merged(new: dict[str, Any]) -> dict[str, Any]:
    """The last results.json with the runs of the cases just measured replaced by the new
    ones (same streamcache commit only); notes the rerun in the command."""
    with open(os.path.join(OUT, "results.json")) as f:
        old = json.load(f)
    if old["versions"]["streamcache commit"] != new["versions"]["streamcache commit"]:
        raise SystemExit("--merge: the last results are of another streamcache commit")
    old["runs"] = [r for r in old["runs"] if r["case"] not in CASES] + new["runs"]
    old["command"] += f"; then {new['command']}"
    old["wall_s"] += new["wall_s"]
    old["load_after"] = new["load_after"]
    return old


def _sample_bytes(data: str) -> int:
    import numpy as np

    shape, dtype, _, _ = DATASETS[data]
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


if __name__ == "__main__":
    sys.exit(main())
