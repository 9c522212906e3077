"""Loading: pick the newest complete checkpoint, verify every file, load it in place.

All ranks run it together (collectives on the control group): rank 0's list of candidates is
broadcast so every rank tries the same ones in the same order; each file's checksum is
verified by one rank and the first problem is shared; a damaged candidate is skipped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.stateful import Stateful

from . import layout, rng
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .layout import GLOBAL_NAME, CheckpointInfo
from .ranks import Ranks
from .state import is_global_state
from .tiers import Location

log = logging.getLogger("streamcache.checkpoint")


@dataclass
class Restorer:
    ranks: Ranks
    root: Location
    write_base: Location
    seed: int

    @property
    def tiered(self) -> bool:
        return self.write_base.url != self.root.url

    def load(self, state: dict[str, Any], step: int | None) -> int | None:
        names = [info.name for info in layout.complete_newest_first(self.root, step)]
        candidates: list[str] = self.ranks.broadcast(names, self.ranks.control)
        if not candidates:
            if step is None:
                return None
            raise CheckpointNotFoundError(
                f"no complete checkpoint of step {step} under {self.root.url}; "
                f"`streamcache checkpoints {self.root.url}` lists the steps there"
            )
        problems = []
        for name in candidates:
            info = layout.check_cheaply(self.root, name)
            source, problem = self.verified_source(info)
            if source is None:
                log.error("refusing checkpoint %s: %s", info.url, problem)
                problems.append(f"{name}: {problem}")
                if step is not None:
                    break
                continue
            self.load_from(source, info, state)
            return info.step
        raise CheckpointCorruptError(
            "no loadable checkpoint: " + "; ".join(problems) + ". The files do not match "
            "their commit markers; restore them from a backup or delete these directories"
        )

    def verified_source(self, info: CheckpointInfo) -> tuple[Location | None, str | None]:
        """The local copy if complete and identical on every rank, else root; or a problem."""
        assert info.marker is not None
        if self.tiered:
            local = self.write_base.child(info.name)
            local_ok = layout.size_problem(info.marker, local.list_sizes()) is None
            all_local = self.ranks.all_true(local_ok, self.ranks.control)
            if all_local and self.verify(local, info) is None:
                return local, None
        root_copy = self.root.child(info.name)
        problem = self.verify(root_copy, info)
        return (root_copy, None) if problem is None else (None, problem)

    def verify(self, location: Location, info: CheckpointInfo) -> str | None:
        """Full checksum verification, the files split across ranks; the first problem."""
        assert info.marker is not None
        names = sorted(info.marker.files)
        problem = None
        for name in names[self.ranks.rank :: self.ranks.world_size]:
            expected = info.marker.files[name].checksum
            try:
                actual = location.checksum(name)
            except OSError as exc:
                problem = f"{name}: unreadable ({exc})"
                break
            if actual != expected:
                problem = (f"{name} is corrupt: checksum {actual}, the commit marker says "
                           f"{expected}")
                break
        problems = self.ranks.all_gather(problem, self.ranks.control)
        return next((p for p in problems if p is not None), None)

    def load_from(self, source: Location, info: CheckpointInfo, state: dict[str, Any]) -> None:
        reader: dcp.FileSystemReader = (
            dcp.FileSystemReader(source.local_path()) if source.is_local
            else FsspecReader(source.url, **source.storage_options)
        )
        metadata = reader.read_metadata()
        dcp_state = {k: v for k, v in state.items() if not is_global_state(v)}
        key = rng.rng_key(self.ranks.rank)
        has_rng = key in metadata.state_dict_metadata
        if has_rng:
            dcp_state[key] = ""
        dcp.load(dcp_state, storage_reader=reader, process_group=self.ranks.control,
                 no_dist=not self.ranks.distributed)
        for k, value in state.items():
            if not is_global_state(value) and not isinstance(value, Stateful):
                state[k] = dcp_state[k]
        self._load_global(source, state)
        if has_rng:
            rng.restore(rng.decode(dcp_state[key]))
        else:
            rng.derive(self.seed, self.ranks.rank, info.step)

    def _load_global(self, source: Location, state: dict[str, Any]) -> None:
        saved = json.loads(source.read_bytes(GLOBAL_NAME))["states"]
        for key, value in state.items():
            if not is_global_state(value):
                continue
            if key not in saved:
                raise CheckpointError(
                    f"global state {key!r} is not in the checkpoint (it has "
                    f"{sorted(saved)}); load with the keys it was saved with"
                )
            value.load_state_dict(saved[key])
