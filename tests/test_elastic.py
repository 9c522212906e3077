"""Restarts under torchrun (streamcache/elastic.py): the configuration whose restarts read a
dead peer's address is named once, and the recipe docs/recovery.md gives restarts a killed
rank for real (torchrun's agent, two gloo processes, SIGKILL)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from streamcache import elastic

HAZARD = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3",
          "RANK": "0"}


@pytest.mark.parametrize("environ, named", [
    (HAZARD, True),
    ({**HAZARD, "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # rank 0 serves its own
    ({**HAZARD, "TORCHELASTIC_MAX_RESTARTS": "0"}, False),  # never restarted
    ({**HAZARD, "TORCHELASTIC_MAX_RESTARTS": "many"}, False),  # not torchrun's: say nothing
    ({"RANK": "0"}, False),  # not under torchrun
])
def test_the_restart_hazard_is_named_only_where_restarts_share_the_agents_store(
        environ: dict[str, str], named: bool) -> None:
    problem = elastic.restart_hazard(environ)
    assert (problem is not None) == named
    if named:
        assert problem is not None
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem and "--max-restarts=3" in problem


def test_the_warning_is_logged_once_and_by_rank_0_only(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(elastic, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="streamcache.elastic"):
        assert not elastic.warn_restart_hazard({**HAZARD, "RANK": "1"})
        assert elastic.warn_restart_hazard(HAZARD)
        assert not elastic.warn_restart_hazard(HAZARD)
    assert len(caplog.records) == 1 and "pytorch/pytorch#135712" in caplog.text


_WORKER = textwrap.dedent('''
    import datetime, os, signal, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from streamcache import Checkpointer

    out = Path(sys.argv[1])
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    with Checkpointer(out / "root") as ckpt:
        value = torch.ones(1)
        dist.all_reduce(value)
        if attempt < int(os.environ.get("KILLS", "0")) and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the agent restarts both processes
        dist.all_reduce(value)
        (out / f"done-{rank}-{attempt}").write_text(str(float(value)))
''')


def _torchrun(tmp_path: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK"))}
    temp = tmp_path / "tmp"  # (the agent's log folders go there, not to the temp folder)
    temp.mkdir(exist_ok=True)
    environ.update(env, OMP_NUM_THREADS="1", TMPDIR=str(temp))
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--monitor-interval", "0.1", *args, str(script), str(tmp_path)],
        env=environ, capture_output=True, text=True, timeout=240)


def test_the_recipe_restarts_a_killed_rank_every_time(tmp_path: Path) -> None:
    run = _torchrun(tmp_path, ["--standalone", "--max-restarts", "2"],
                    {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "KILLS": "2"})
    assert run.returncode == 0, run.stderr[-3000:]
    done = sorted(p.name for p in tmp_path.glob("done-*"))
    assert done == ["done-0-2", "done-1-2"], run.stderr[-3000:]  # both kills restarted
    assert (tmp_path / "done-0-2").read_text() == "4.0"
    assert "135712" not in run.stderr  # the recipe is not warned about


def test_torchruns_default_rendezvous_with_restarts_is_warned_about(tmp_path: Path) -> None:
    # (nothing is killed: the static rendezvous's first attempt runs through, and rank 0's
    # Checkpointer names the setup whose restarts would read dead addresses)
    run = _torchrun(tmp_path, ["--max-restarts", "1", "--master-port", str(_free_port())], {})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("pytorch/pytorch#135712") == 1, run.stderr[-3000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in run.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_WARM_WORKER = textwrap.dedent('''
    import datetime, os, signal, sys
    from pathlib import Path

    def main(out: str) -> None:
        # forked from the server that imported these once: a restart does not import them
        preloaded = all(name in sys.modules for name in ("torch._dynamo", "streamcache.checkpoint"))
        import torch, torch.distributed as dist
        from streamcache import Checkpointer

        folder = Path(out)
        rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        with Checkpointer(folder / "root") as ckpt:
            value = torch.ones(1)
            dist.all_reduce(value)
            if attempt < 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # the agent restarts both processes
            dist.all_reduce(value)
            (folder / f"done-{rank}-{attempt}").write_text(f"{float(value)} {preloaded}")
''')

_WARM_LAUNCH = textwrap.dedent('''
    import multiprocessing, os, sys, uuid
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch._dynamo  # the agent formats a dead worker's traceback with it
    import warm_worker
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if __name__ == "__main__":
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        multiprocessing.set_forkserver_preload(
            ["warm_worker", "torch", "torch._dynamo", "torch.optim", "torch.nn.parallel",
             "torch.distributed.checkpoint", "streamcache.loading.loader",
             "streamcache.checkpoint"])
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2,
                              run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", max_restarts=2,
                              monitor_interval=0.1, start_method="forkserver")
        elastic_launch(config, entrypoint=warm_worker.main)(sys.argv[1])
''')


def test_the_warm_recipe_restarts_killed_ranks_from_preloaded_processes(tmp_path: Path) -> None:
    """docs/recovery.md "Warm restarts": torchrun's engine through its Python API, workers
    forked from a forkserver that imported torch, torch._dynamo, DCP and streamcache once."""
    (tmp_path / "warm_worker.py").write_text(_WARM_WORKER)
    (tmp_path / "launch.py").write_text(_WARM_LAUNCH)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK"))}
    # (a short TMPDIR: the forkserver's socket path must fit AF_UNIX's 108 bytes)
    with tempfile.TemporaryDirectory(prefix="sc") as temp:
        environ.update(OMP_NUM_THREADS="1", TMPDIR=temp)
        run = subprocess.run([sys.executable, str(tmp_path / "launch.py"), str(tmp_path)],
                             env=environ, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    done = sorted(p.name for p in tmp_path.glob("done-*"))
    assert done == ["done-0-2", "done-1-2"], run.stderr[-3000:]  # both kills restarted
    assert (tmp_path / "done-0-2").read_text() == "4.0 True"  # summed, and preloaded
    assert (tmp_path / "done-1-2").read_text() == "4.0 True"
    assert "135712" not in run.stderr
