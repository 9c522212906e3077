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
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from format_helpers import backend  # noqa: F401  (fixture: native core and Python twin)
from servers import FaultServer, MotoServer, S3Bucket, aws_test_environment


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
