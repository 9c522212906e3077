"""What a process that torchrun's agent started can tell about how its restarts will go.

torchrun hands its workers the agent's own TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``)
under its default static rendezvous, and under the c10d rendezvous unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. That store outlives a restart, and the keys the
process group's backend writes there (each rank's address) are not separated by attempt: a
restarted process can read the address of a peer that died with the previous attempt and
fail in ``init_process_group`` ("Connection refused"), or wait there until its timeout. Two
gloo ranks, one SIGKILLed (docs/recovery.md, "Restarts under torchrun"): with the static
rendezvous no restart formed its group; with the shared c10d store two restarts were refused
and the third waited for over two minutes (the same cause for NCCL: pytorch/pytorch#135712).
With the c10d rendezvous and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0 serves a fresh
store every attempt: 20 restarts in a row formed their group, none failed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("streamcache.elastic")
_warned = False


def restart_hazard(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why torchrun's restarts of this process may fail to form a process group, or None."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    if restarts <= 0:
        return None
    return (f"torchrun restarts this job (--max-restarts={restarts}) and gives its processes "
            "its own store, which keeps the addresses of the attempt before: a restarted "
            "process can read a dead peer's address and fail in init_process_group "
            "('Connection refused') or wait there until its timeout (pytorch/pytorch#135712). "
            "Run torchrun with --rdzv-backend c10d (or --standalone) and "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (docs/recovery.md, "
            "'Restarts under torchrun')")


def warn_restart_hazard(environ: Mapping[str, str] = os.environ) -> bool:
    """Log :func:`restart_hazard` once per process, on global rank 0 only; whether it did."""
    global _warned
    if _warned or environ.get("RANK", "0") != "0":
        return False
    problem = restart_hazard(environ)
    if problem is None:
        return False
    _warned = True
    log.warning("%s", problem)
    return True


__all__ = ["restart_hazard", "warn_restart_hazard"]
