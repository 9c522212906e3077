"""The on-disk layout of a checkpoint root and the commit marker that makes a checkpoint count.

Layout under ``root`` (any fsspec URL)::

    step-0000000120-018c1f2e5a7b-3/  one save attempt of step 120 (run id: the run's start
                                     time in ms, hex; save sequence within the run)
        __0_0.distcp, __1_0.distcp   DCP data files, one per rank
        .metadata                    DCP metadata (written by DCP's coordinator)
        global.json                  global (rank-independent) states, e.g. the loader cursor
        COMMIT.json                  the commit marker, published last and atomically
    TIMELINES.json                   the timelines started by rollbacks (absent until one)
    LEASE.json                       the lease of the job that writes the root (lease.py)
    ROOT.json                        this root's id, written by the first lease holder: a
                                     root deleted and made again has another id, so memory
                                     snapshots of the deleted one are never taken for it

A directory without a valid ``COMMIT.json`` is a partial save and is never loaded. The marker
lists every file with its size and checksum and carries a checksum of its own body, so a
truncated or edited marker is as invalid as a missing one. Finding the newest complete
checkpoint costs one listing of ``root`` plus one marker read and one directory listing per
candidate, newest first; it never lists every checkpoint's files.

Timelines: ``load(step=N)`` of an older checkpoint (a rollback) starts a new timeline that
forks at that checkpoint; saves carry their timeline in the marker. The *history* of the
live (newest) timeline is its own checkpoints plus, up the chain of forks, each parent's
checkpoints up to the fork point. ``latest``, a plain load and retention see only that
history; checkpoints of abandoned timelines stay on disk, listed, never loaded by default.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..format.checksum import checksum_bytes
from .errors import CheckpointCorruptError
from .tiers import Location, UnreadableFileError

FORMAT = "streamcache.checkpoint"
VERSION = 1
MARKER_NAME = "COMMIT.json"
TIMELINES_NAME = "TIMELINES.json"
ROOT_ID_NAME = "ROOT.json"
ROOT_ID_LIMIT = 4096  # bytes: the file is about fifty
GLOBAL_NAME = "global.json"
DCP_METADATA_NAME = ".metadata"
# caps on the small files read back (a root is untrusted: a huge or endless file is refused)
MARKER_LIMIT = 64 << 20
TIMELINES_LIMIT = 16 << 20
GLOBAL_LIMIT = 256 << 20

# marker keys
K_FORMAT, K_VERSION, K_STEP, K_TIME = "format", "version", "step", "time"
K_WORLD, K_FILES, K_SIZE, K_CHECKSUM, K_BODY = "world_size", "files", "size", "checksum", "body"
K_TIMELINE = "timeline"  # optional marker key: the timeline id ("" for the first timeline)
# TIMELINES.json keys
K_TIMELINES, K_ID, K_PARENT, K_FORK_STEP, K_FORK_NAME = (
    "timelines", "id", "parent", "fork_step", "fork_name")
# global.json keys: the global states, and every saving rank's top-level DCP keys
K_STATES, K_RANK_KEYS = "states", "rank_keys"

_DIR_RE = re.compile(r"^step-(\d{10})-([0-9a-f]+)-(\d+)$")


def dir_name(step: int, run_id: str, sequence: int) -> str:
    """The directory of one save attempt; unique, so a retry never overwrites an older try."""
    return f"step-{step:010d}-{run_id}-{sequence}"


def parse_dir_name(name: str) -> tuple[int, str, int] | None:
    """(step, run id, sequence) of a checkpoint directory name, or None for anything else."""
    match = _DIR_RE.match(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2), int(match.group(3))


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str


@dataclass(frozen=True)
class Marker:
    """The parsed commit marker of one complete checkpoint."""

    step: int
    time: float
    world_size: int
    files: dict[str, FileEntry]
    timeline: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self) -> bytes:
        body = {
            K_FORMAT: FORMAT,
            K_VERSION: VERSION,
            K_STEP: self.step,
            K_TIME: self.time,
            K_WORLD: self.world_size,
            K_FILES: {
                name: {K_SIZE: e.size, K_CHECKSUM: e.checksum}
                for name, e in sorted(self.files.items())
            },
        }
        if self.timeline:
            body[K_TIMELINE] = self.timeline
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return json.dumps({K_BODY: body, K_CHECKSUM: checksum_bytes(canonical)}, indent=1).encode()

    @staticmethod
    def from_json(data: bytes, *, where: str) -> Marker:
        """Parse and self-check a marker; :class:`CheckpointCorruptError` if it is not valid."""
        try:
            outer = json.loads(data)
            body = outer[K_BODY]
            canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
            if checksum_bytes(canonical) != outer[K_CHECKSUM]:
                raise ValueError("the marker's body does not match its checksum")
            if body[K_FORMAT] != FORMAT or body[K_VERSION] != VERSION:
                raise ValueError(f"unknown format/version {body[K_FORMAT]!r}/{body[K_VERSION]!r}")
            files = {
                file_name(name): FileEntry(_count(e[K_SIZE], "size"), str(e[K_CHECKSUM]))
                for name, e in body[K_FILES].items()
            }
            world = _count(body[K_WORLD], "world_size")
            if world < 1:
                raise ValueError(f"world_size {world} is not positive")
            return Marker(_count(body[K_STEP], "step"), float(body[K_TIME]), world, files,
                          str(body.get(K_TIMELINE, "")))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CheckpointCorruptError(
                f"{where}: commit marker is unreadable ({exc}); the checkpoint is not trusted, "
                "delete the directory or load an older step"
            ) from exc


def file_name(name: object) -> str:
    """``name`` if it is a plain file name inside a checkpoint directory, else ValueError.

    Every file a checkpoint lists or refers to lives directly in its step directory: no
    separators, no ``.``/``..``, nothing absolute.
    """
    if (not isinstance(name, str) or not name or name in (".", "..") or len(name) > 255
            or any(c in name for c in "/\\\0")):
        raise ValueError(f"{name!r} is not a file name inside the checkpoint directory")
    return name


def _count(value: object, what: str) -> int:
    """A non-negative integer read from a file (bools and floats are refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} {value!r} is not a non-negative integer")
    return value


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory under a root, complete or not."""

    step: int
    name: str
    url: str
    complete: bool
    time: float | None = None
    size: int | None = None
    world_size: int | None = None
    problem: str | None = None
    marker: Marker | None = None

    @property
    def timeline(self) -> str:
        return self.marker.timeline if self.marker is not None else ""


def new_marker(step: int, world_size: int, files: dict[str, FileEntry],
               timeline: str = "") -> Marker:
    return Marker(step=step, time=time.time(), world_size=world_size, files=files,
                  timeline=timeline)


def scan(root: Location) -> list[tuple[int, str, int, str]]:
    """Checkpoint directories under ``root`` as (step, name, sequence, run id), oldest first.

    Attempts at the same step are ordered by run id (the run's start time) and sequence, so
    the newest attempt comes last.
    """
    found = []
    for name in root.list_names():
        parsed = parse_dir_name(name)
        if parsed is not None:
            step, run_id, sequence = parsed
            found.append((step, name, sequence, run_id))
    return sorted(found, key=lambda entry: (entry[0], entry[3], entry[2]))


def check_cheaply(root: Location, name: str) -> CheckpointInfo:
    """Marker present, self-consistent, and every listed file present with its size.

    One marker read and one directory listing; checksums are left to :func:`verify_fully`.
    """
    parsed = parse_dir_name(name)
    step = parsed[0] if parsed else -1
    url = root.join(name)
    sizes = root.child(name).list_sizes()
    if MARKER_NAME not in sizes:
        return CheckpointInfo(step, name, url, False, problem="no commit marker (partial save)")
    try:
        marker = Marker.from_json(root.child(name).read_bytes(MARKER_NAME, MARKER_LIMIT),
                                  where=url)
    except CheckpointCorruptError as exc:
        return CheckpointInfo(step, name, url, False, problem=str(exc))
    except UnreadableFileError as exc:
        return CheckpointInfo(step, name, url, False, problem=f"commit marker refused: {exc}")
    except FileNotFoundError:
        return CheckpointInfo(step, name, url, False, problem="commit marker vanished")
    problem = size_problem(marker, sizes)
    info = CheckpointInfo(
        step=marker.step,
        name=name,
        url=url,
        complete=problem is None and marker.step == step,
        time=marker.time,
        size=marker.total_bytes,
        world_size=marker.world_size,
        problem=problem if marker.step == step else "marker step differs from directory name",
        marker=marker,
    )
    return info


def size_problem(marker: Marker, sizes: dict[str, int]) -> str | None:
    """What is missing or of the wrong size compared with the marker, or None."""
    for file_name, entry in marker.files.items():
        if file_name not in sizes:
            return f"{file_name} is missing"
        if sizes[file_name] != entry.size:
            return f"{file_name} has {sizes[file_name]} bytes, the marker says {entry.size}"
    return None


def list_checkpoints(root: Location) -> list[CheckpointInfo]:
    """Every checkpoint directory under ``root`` with its completeness, oldest first."""
    return [check_cheaply(root, name) for _, name, _, _ in scan(root)]


def complete_newest_first(root: Location, step: int | None = None, *,
                          everywhere: bool = False) -> list[CheckpointInfo]:
    """Complete checkpoints of the live timeline's history (optionally only of ``step``),
    newest first; with ``everywhere``, those of every timeline.

    Costs one listing of ``root``, one read of ``TIMELINES.json`` and a cheap check of each
    directory: used by ``load`` (which needs fallbacks) and retention.
    """
    timelines = read_timelines(root)
    result = []
    for found_step, name, _, _ in reversed(scan(root)):
        if step is not None and found_step != step:
            continue
        info = check_cheaply(root, name)
        if info.complete and (everywhere or in_history(info, timelines)):
            result.append(info)
    return result


def latest(root: Location) -> CheckpointInfo | None:
    """The newest complete checkpoint of the live timeline's history under ``root``, or None.

    Stops at the first one, newest first.
    """
    timelines = read_timelines(root)
    for _, name, _, _ in reversed(scan(root)):
        info = check_cheaply(root, name)
        if info.complete and in_history(info, timelines):
            return info
    return None


@dataclass(frozen=True)
class Timeline:
    """A timeline started by a rollback: it forks from ``parent`` at ``fork_name``."""

    id: str
    parent: str
    fork_step: int
    fork_name: str


def read_timelines(root: Location) -> list[Timeline]:
    """The timelines of ``root``, oldest first ([]: only the first timeline, id "").

    Raises:
        CheckpointCorruptError: the file exists but is not a valid list of timelines.
    """
    try:
        data = root.read_bytes(TIMELINES_NAME, TIMELINES_LIMIT)
        return [Timeline(str(t[K_ID]), str(t[K_PARENT]), _count(t[K_FORK_STEP], "fork_step"),
                         str(t[K_FORK_NAME])) for t in json.loads(data)[K_TIMELINES]]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointCorruptError(
            f"{root.join(TIMELINES_NAME)} is unreadable ({exc}); it records which "
            "checkpoints a rollback abandoned: restore it, or delete it to treat every "
            "checkpoint as one timeline again"
        ) from exc


def write_timelines(root: Location, timelines: list[Timeline]) -> None:
    """Publish the timelines atomically (only the lease holder writes them)."""
    body = {K_TIMELINES: [{K_ID: t.id, K_PARENT: t.parent, K_FORK_STEP: t.fork_step,
                           K_FORK_NAME: t.fork_name} for t in timelines]}
    root.write_atomic(TIMELINES_NAME, json.dumps(body, indent=1).encode())


def read_root_id(root: Location) -> str | None:
    """This root's id (:func:`ensure_root_id`), or None: no id yet, or a file that is not one
    (anything read here is untrusted; what is not an id is no id, never an error)."""
    try:
        doc = json.loads(root.read_bytes(ROOT_ID_NAME, ROOT_ID_LIMIT))
    except (FileNotFoundError, UnreadableFileError, ValueError, RecursionError):
        return None
    ident = doc.get("id") if isinstance(doc, dict) else None
    return ident if isinstance(ident, str) and _ROOT_ID.fullmatch(ident) else None


def ensure_root_id(root: Location) -> str:
    """This root's id, written first if it has none (only the lease holder calls it).

    A root that is deleted and made again (or whose ``ROOT.json`` is not an id) gets a new
    random id, so whatever recorded the old one (memory-tier snapshots) no longer matches.

    Raises:
        OSError: the id could not be written (e.g. ``ROOT.json`` is a folder).
    """
    existing = read_root_id(root)
    if existing is not None:
        return existing
    new = uuid.uuid4().hex
    root.write_atomic(ROOT_ID_NAME, json.dumps({"id": new}).encode())
    return new


_ROOT_ID = re.compile(r"[0-9a-f]{32}")


def live_timeline(timelines: list[Timeline]) -> str:
    return timelines[-1].id if timelines else ""


def in_history(info: CheckpointInfo, timelines: list[Timeline]) -> bool:
    """Whether ``info`` is in the history of the live timeline (see the module doc)."""
    by_id = {t.id: t for t in timelines}
    current = live_timeline(timelines)
    cap: Timeline | None = None  # the fork by which the history left ``current``
    for _ in range(len(timelines) + 1):
        if info.timeline == current:
            return cap is None or info.step < cap.fork_step or info.name == cap.fork_name
        if current not in by_id:
            return False
        cap = by_id[current]
        current = cap.parent
    return False


def write_marker(location: Location, marker: Marker) -> None:
    """Publish ``marker`` atomically in ``location`` (temp file + fsync + rename, or one PUT)."""
    location.write_atomic(MARKER_NAME, marker.to_json())


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
