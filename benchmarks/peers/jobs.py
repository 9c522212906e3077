"""The measured jobs. Each runs in a fresh process (``run.py --job JSON``) and prints one JSON
line: throughput of one epoch, a mid-epoch resume, or one rank's part of an elastic resume."""

from __future__ import annotations

import importlib
import json
import os
import time
from typing import Any

import numpy as np
from common import DATA, Spec, fresh_dir, native_dir, warm_page_cache

ADAPTERS = {
    "streamcache": "sys_streamcache",
    "mosaic": "sys_mosaic",
    "litdata": "sys_litdata",
    "webdataset": "sys_webdataset",
    "torchdata": "sys_torch:TorchData",
    "dataloader": "sys_torch:DataLoader",
    "raw-gather": "sys_torch:RawLimit",
}


def adapter(system: str) -> Any:
    module, _, attr = ADAPTERS[system].partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded


def source_dir(system: str, data: str) -> str:
    """What a warm run reads: the system's native copy (the .npy for the map-style ones)."""
    if system in ("torchdata", "dataloader", "raw-gather"):
        return os.path.join(DATA, f"{data}.npy")
    return native_dir(system, data)


def _import(system: str) -> Any:
    """The adapter, with torch and the system's library imported: a time to first batch
    counts building the loader and reading, not the imports of a fresh process."""
    import torch  # noqa: F401

    peer = adapter(system)
    if hasattr(peer, "import_library"):
        peer.import_library()
    return peer


def _warm(system: str, data: str) -> None:
    path = source_dir(system, data)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            while f.read(8 << 20):
                pass
    else:
        warm_page_cache(path)


def _consume(loader: Any, steps: int | None, started: float, budget_s: float = 0.0,
             ) -> tuple[list[np.ndarray], float]:
    """Take ``steps`` batches (all if None), or stop ``budget_s`` seconds after the first
    batch (0: no limit); returns the id arrays and the first-batch time."""
    ids: list[np.ndarray] = []
    first = 0.0
    if steps == 0:
        return ids, first
    for batch in loader:
        if not ids:
            first = time.perf_counter() - started
        ids.append(np.asarray(batch))
        if steps is not None and len(ids) >= steps:
            break
        if budget_s and time.perf_counter() - started - first > budget_s:
            break
    return ids, first


def exactness(ids: np.ndarray, num_samples: int, reference: np.ndarray | None = None,
              ) -> dict[str, int]:
    """Duplicates and skips by sample id: against every id once, and (when given) against
    the multiset of an uninterrupted epoch of the same system and configuration."""
    unique = np.unique(ids)
    out = {"delivered": len(ids), "duplicates": int(len(ids) - len(unique)),
           "skipped": int(num_samples - len(unique))}
    if reference is not None:
        mine = np.bincount(ids, minlength=num_samples)
        ref = np.bincount(reference, minlength=num_samples)
        out["extra_vs_uninterrupted"] = int(np.clip(mine - ref, 0, None).sum())
        out["missing_vs_uninterrupted"] = int(np.clip(ref - mine, 0, None).sum())
        out["uninterrupted_duplicates"] = int(len(reference) - len(np.unique(reference)))
        out["uninterrupted_skipped"] = int(num_samples - len(np.unique(reference)))
    return out


def throughput(job: dict[str, Any]) -> dict[str, Any]:
    system, spec = job["system"], Spec(**job["spec"])
    if spec.source == "local":
        _warm(system, spec.data)
    else:
        fresh_dir(spec.cache_dir)
    peer = _import(system)
    started = time.perf_counter()
    loader = peer.open_loader(spec)
    ids, first = _consume(loader, None, started, job.get("budget_s", 0.0))
    elapsed = time.perf_counter() - started
    loader.close()
    delivered = sum(len(b) for b in ids)
    steady = (delivered - len(ids[0])) / max(1e-9, elapsed - first) if len(ids) > 1 else 0.0
    unique = len(np.unique(np.concatenate(ids))) if ids else 0
    return {"samples_per_s": steady, "first_batch_s": first, "seconds": elapsed,
            "delivered": delivered, "unique": unique,
            "epoch_fraction": delivered / spec.num_samples}


def resume(job: dict[str, Any]) -> dict[str, Any]:
    """Fresh start, interrupt at 50% of the epoch, resume in a new loader; finish the epoch
    and count duplicates/skips when ``job["exact"]``, else stop after 3 batches."""
    system, spec = job["system"], Spec(**job["spec"])
    peer = _import(system)
    _warm(system, spec.data)
    steps = spec.num_samples // (spec.per_rank_batch * spec.world_size)
    started = time.perf_counter()
    first_loader = peer.open_loader(spec)
    head, fresh_first = _consume(first_loader, steps // 2, started)
    state = first_loader.state()
    first_loader.close()
    started = time.perf_counter()
    second_loader = peer.open_loader(spec, state=state)
    tail, resumed_first = _consume(second_loader, None if job.get("exact") else 3, started)
    second_loader.close()
    result: dict[str, Any] = {"first_batch_s": fresh_first, "resume_first_batch_s": resumed_first,
                              "state_bytes": len(json.dumps(state, default=str))}
    if job.get("exact"):
        reference, _ = _consume(peer.open_loader(spec), None, time.perf_counter())
        result["exact"] = exactness(np.concatenate(head + tail), spec.num_samples,
                                    np.concatenate(reference))
    return result


def rank_phase(job: dict[str, Any]) -> dict[str, Any]:
    """One rank of an elastic run: take ``steps`` batches (all if None) from ``state``, save
    the ids taken (and the state after them) under ``job["out"]``."""
    system, spec = job["system"], Spec(**job["spec"])
    state = None
    if job.get("state_file"):
        with open(job["state_file"]) as f:
            state = json.load(f)
    loader = adapter(system).open_loader(spec, state=state, global_batch=job["global_batch"])
    ids, _ = _consume(loader, job.get("steps"), time.perf_counter())
    out = job["out"]
    np.save(out + ".ids.npy", np.concatenate(ids) if ids else np.zeros(0, np.int64))
    if job.get("save_state"):
        with open(out + ".state.json", "w") as f:
            json.dump(loader.state(), f, default=_jsonable)
    loader.close()
    return {"batches": len(ids)}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot save {type(value).__name__} in a JSON state")


KINDS = {"throughput": throughput, "resume": resume, "rank": rank_phase}


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    return KINDS[job["kind"]](job)
