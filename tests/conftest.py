"""Shared pytest fixtures. The servers themselves live in ``tests/servers.py``.

Server fixtures:
- ``moto_server`` (session): a running :class:`servers.MotoServer` (``.endpoint_url``);
  dummy AWS credentials are in the environment while it runs.
- ``s3_bucket`` (session): an :class:`servers.S3Bucket` on it (``.put``, ``.url``,
  ``.storage_options()``); shared by all tests, so use keys unique to your test.
- ``fault_server``: a :class:`servers.FaultServer` serving the files of ``fault_server.root``
  (a fresh directory) with fresh counters and no faults until a test asks for some.
- ``s3_fault_proxy``: a :class:`servers.FaultServer` forwarding to ``moto_server``; reach a
  bucket through it with ``s3_bucket.storage_options(via=s3_fault_proxy.url)``.

Hygiene, for every test:
- The temp folder (``TMPDIR``, ``tempfile.gettempdir()``) is a folder of this session's own,
  inherited by every process a test starts, and removed at the end (pass ``--basetemp DIR``
  to keep the ``tmp_path`` folders of a run). A test that leaves
  anything in it fails (at teardown, naming what it left; the leftovers are removed), so no
  run fills the machine's temp folder. Pytest's own ``tmp_path`` folders live there too and
  are exempt (pytest owns them).
- A test that draws a random schedule takes its seed from ``seeds.schedule_seed``; a failure's
  report (a timeout's too) says how to replay it.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import seeds
from format_helpers import backend  # noqa: F401  (fixture: native core and Python twin)
from servers import FaultServer, MotoServer, S3Bucket, aws_test_environment

# With the resilience extra installed (nvidia-resiliency-ext brings pynvml 13), ``import torch``
# warns in every process that pynvml is deprecated: torch's import, not ours (pyproject's
# filterwarnings ignores it in this process). Children the tests start inherit this one
# exception, so a test of a child's stderr reads what streamcache and its examples print.
_PYNVML_DEPRECATION = "ignore:The pynvml package is deprecated:FutureWarning"
os.environ["PYTHONWARNINGS"] = ",".join(
    part for part in (os.environ.get("PYTHONWARNINGS"), _PYNVML_DEPRECATION) if part)

# Folders a process keeps for its lifetime, made by the libraries beneath the tests
# (multiprocessing's helper folder for spawn and forkserver; torch's compile cache, made
# when torch._dynamo is first imported, e.g. by the first optimizer): not a test's leftovers.
_PROCESS_LIFETIME_PREFIXES = ("pymp-", "torchinductor_")


def pytest_configure(config: pytest.Config) -> None:
    """Give the session a temp folder of its own (see the module docstring)."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller set TMPDIR
        return
    root = tempfile.mkdtemp(prefix="tests-streamcache-")
    config.stash[_TEMP_ROOT] = (root, os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"] = root
    tempfile.tempdir = root


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's temp folder (``--basetemp DIR`` keeps ``tmp_path`` folders).

    multiprocessing removes its own ``pymp-*`` folder in there at exit, in a finalizer of
    priority -100; the folder itself goes in one of -101, which runs after it (removing it
    now made that finalizer print a FileNotFoundError traceback at exit)."""
    saved = config.stash.get(_TEMP_ROOT, None)
    if saved is None:
        return
    root, previous_env, previous_tempdir = saved
    tempfile.tempdir = previous_tempdir
    if previous_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous_env
    for name in os.listdir(root):
        if not name.startswith("pymp-"):
            _remove(os.path.join(root, name))
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(root,),
                                  kwargs={"ignore_errors": True}, exitpriority=-101)


_TEMP_ROOT = pytest.StashKey[tuple[str, "str | None", "str | None"]]()


def _remove(path: str) -> None:
    """Remove a file, a link or a folder with everything in it."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _temp_entries() -> set[str]:
    root = tempfile.gettempdir()
    return {name for name in os.listdir(root)
            if not name.startswith(("pytest-of-", *_PROCESS_LIFETIME_PREFIXES))}


@pytest.fixture(autouse=True)
def _leaves_no_temp_files(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves files in the temp folder (and remove them)."""
    seeds.chosen.clear()
    before = _temp_entries()
    yield
    left = sorted(_temp_entries() - before)
    if not left:
        return
    root = tempfile.gettempdir()
    for name in left:
        _remove(os.path.join(root, name))
    pytest.fail(f"{request.node.nodeid} left files in the temp folder: {left} (use tmp_path, "
                "or remove them)", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None],
                              ) -> Iterator[None]:
    """Add how to replay a failed test's random schedule to its report."""
    report = yield
    line = seeds.replay_line()
    if line is not None and report.failed:
        report.sections.append(("random schedule", line))
    return report


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    with aws_test_environment(), MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def s3_bucket(moto_server: MotoServer) -> S3Bucket:
    return S3Bucket.create(moto_server.endpoint_url, f"streamcache-test-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def fault_server(tmp_path: Path) -> Iterator[FaultServer]:
    root = tmp_path / "served"
    root.mkdir()
    with FaultServer(root=root) as server:
        yield server


@pytest.fixture
def s3_fault_proxy(moto_server: MotoServer) -> Iterator[FaultServer]:
    with FaultServer(upstream=moto_server.endpoint_url) as server:
        yield server
