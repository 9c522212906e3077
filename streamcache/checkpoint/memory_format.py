"""The memory tier's file format, as pure functions: header, manifest, state trees, choice.

One slot file holds one rank's snapshot of one step::

    [0, 4096)             header: magic, version, sequence, step, where the manifest and data
                          are, the manifest's digest, and a digest of the header itself
    [4096, 4096 + data)   every tensor's bytes, each at a 64-byte aligned offset
    [manifest_offset, +n) the manifest: UTF-8 JSON describing the state (below)

The header is written last, so a slot is whole exactly when its header is valid; a writer first
zeroes the header of the slot it is about to overwrite. Everything here reads untrusted bytes
(another process of the node may have written the file): sizes are capped, every field is
type-checked, tensor extents are checked against the data region, dtypes come from a fixed
list, and nothing is unpickled.

State trees (what ``state_dict()`` returns) are encoded as JSON: ``None``, bools, ints, floats
and strings as themselves; a tensor as ``{"t": index}`` into the manifest's tensor table; a
list as ``{"l": [...]}``, a tuple as ``{"u": [...]}``, a dict as ``{"d": [[key, value], ...]}``
(keys are encoded leaves, so integer keys stay integers). Anything else cannot be snapshotted.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"SCMEMv1\x00"
FORMAT_VERSION = 2  # 2: the root's id (layout.ROOT_ID_NAME) in the manifest
HEADER_SIZE = 4096
ALIGN = 64
PIECE_BYTES = 4 << 20  # tensors are digested in pieces of this size (read and hashed hot)
MAX_MANIFEST_BYTES = 64 << 20
_HEADER = struct.Struct("<8sIIqqQQQQQ")  # magic, version, 0, seq, step, data_len,
#                                         manifest_offset, manifest_len, manifest_digest, digest

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "complex64": torch.complex64, "complex128": torch.complex128,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# manifest keys
K_VERSION, K_ROOT, K_RANK, K_WORLD, K_STEP = "version", "root", "rank", "world_size", "step"
K_TIMELINE, K_STARTED, K_COMMITTED, K_ROOT_ID = "timeline", "started", "committed", "root_id"
K_ENTRIES, K_TENSORS, K_RNG = "entries", "tensors", "rng"
K_KIND, K_TREE = "kind", "tree"
KINDS = ("stateful", "global", "plain")
K_DTYPE, K_SHAPE, K_OFFSET, K_NBYTES, K_DIGESTS = "dtype", "shape", "offset", "nbytes", "digests"
MAX_DIM = (1 << 63) - 1  # torch's sizes are int64


class FormatProblem(ValueError):
    """A slot file is not a whole, valid snapshot (the message says what is wrong)."""


class EmptySlot(FormatProblem):
    """The slot's header is zeroes: invalidated, or a snapshot was cut short there."""


@dataclass(frozen=True)
class Header:
    seq: int
    step: int
    data_len: int
    manifest_offset: int
    manifest_len: int
    manifest_digest: int


def pack_header(header: Header, digest_fn: Any) -> bytes:
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, header.seq, header.step, header.data_len,
                        header.manifest_offset, header.manifest_len, header.manifest_digest, 0)
    digest = digest_fn(body[: _HEADER.size - 8])
    return body[: _HEADER.size - 8] + struct.pack("<Q", digest)


def unpack_header(raw: bytes, file_size: int, digest_fn: Any) -> Header:
    """The header of a slot of ``file_size`` bytes, or :class:`FormatProblem`."""
    if len(raw) < _HEADER.size:
        raise FormatProblem(f"header is {len(raw)} bytes, shorter than {_HEADER.size}")
    magic, version, _, seq, step, data_len, m_off, m_len, m_digest, digest = _HEADER.unpack(
        raw[: _HEADER.size])
    if magic == bytes(len(MAGIC)):
        raise EmptySlot("no snapshot (invalidated, or cut short while it was written)")
    if magic != MAGIC:
        raise FormatProblem("no valid header (never written, being written, or not ours)")
    if digest_fn(raw[: _HEADER.size - 8]) != digest:
        raise FormatProblem("header checksum mismatch (torn or edited)")
    if version != FORMAT_VERSION:
        raise FormatProblem(f"format version {version}, this streamcache reads {FORMAT_VERSION}")
    if seq < 0 or step < 0:
        raise FormatProblem(f"negative sequence {seq} or step {step}")
    if m_len > MAX_MANIFEST_BYTES:
        raise FormatProblem(f"manifest of {m_len} bytes exceeds the cap {MAX_MANIFEST_BYTES}")
    if HEADER_SIZE + data_len > m_off or m_off + m_len > file_size:
        raise FormatProblem(f"regions (data {data_len} B, manifest at {m_off} + {m_len} B) do "
                            f"not fit a file of {file_size} bytes")
    return Header(seq, step, data_len, m_off, m_len, m_digest)


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


# ---------------------------------------------------------------------------- state trees

def encode_tree(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` as JSON-able data; its tensors are appended to ``tensors``.

    Raises:
        TypeError: a value that cannot be snapshotted (names its type).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if isinstance(value, list):
        return {"l": [encode_tree(v, tensors) for v in value]}
    if isinstance(value, tuple):
        return {"u": [encode_tree(v, tensors) for v in value]}
    if isinstance(value, dict):
        return {"d": [[encode_tree(k, tensors), encode_tree(v, tensors)]
                      for k, v in value.items()]}
    raise TypeError(f"a {type(value).__module__}.{type(value).__qualname__} cannot be kept in "
                    "the memory tier (state values must be tensors, numbers, strings, None, "
                    "lists, tuples and dicts)")


def decode_tree(data: Any, tensors: list[Any], depth: int = 0) -> Any:
    """The inverse of :func:`encode_tree`; ``tensors[i]`` replaces ``{"t": i}``.

    Raises:
        FormatProblem: anything that :func:`encode_tree` does not write.
    """
    if depth > 100:
        raise FormatProblem("state tree nested deeper than 100 levels")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if not isinstance(data, dict) or len(data) != 1:
        raise FormatProblem(f"state tree node of type {type(data).__name__}")
    (tag, body), = data.items()
    if tag == "t":
        if type(body) is not int or not 0 <= body < len(tensors):
            raise FormatProblem(f"tensor reference {body!r} outside the tensor table")
        return tensors[body]
    if tag in ("l", "u", "d") and not isinstance(body, list):
        raise FormatProblem(f"state tree node {tag!r} without a list")
    if tag == "l":
        return [decode_tree(v, tensors, depth + 1) for v in body]
    if tag == "u":
        return tuple(decode_tree(v, tensors, depth + 1) for v in body)
    if tag == "d":
        result = {}
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2:
                raise FormatProblem("a dict item of the state tree is not a [key, value] pair")
            key = decode_tree(pair[0], [], depth + 1)
            if isinstance(key, (list, dict)):
                raise FormatProblem("a dict key of the state tree is not hashable")
            result[key] = decode_tree(pair[1], tensors, depth + 1)
        return result
    raise FormatProblem(f"unknown state tree tag {tag!r}")


def tensor_record(tensor: torch.Tensor, offset: int) -> dict[str, Any]:
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"tensors of dtype {tensor.dtype} cannot be kept in the memory tier")
    return {K_DTYPE: name, K_SHAPE: list(tensor.shape), K_OFFSET: offset,
            K_NBYTES: tensor.numel() * tensor.element_size(), K_DIGESTS: []}


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """(start, length) of the digested pieces of a tensor of ``nbytes`` bytes."""
    return [(start, min(PIECE_BYTES, nbytes - start)) for start in range(0, nbytes, PIECE_BYTES)]


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    digests: tuple[int, ...]


def check_tensors(records: Any, data_len: int) -> list[TensorSpec]:
    """The manifest's tensor table, each extent inside the data region, or FormatProblem."""
    if not isinstance(records, list):
        raise FormatProblem("the tensor table is not a list")
    specs, end = [], 0
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or set(rec) != {K_DTYPE, K_SHAPE, K_OFFSET, K_NBYTES,
                                                     K_DIGESTS}:
            raise FormatProblem(f"tensor {i}: not a tensor record")
        dtype = DTYPES.get(rec[K_DTYPE]) if isinstance(rec[K_DTYPE], str) else None
        shape, offset, nbytes, digests = rec[K_SHAPE], rec[K_OFFSET], rec[K_NBYTES], \
            rec[K_DIGESTS]
        if dtype is None:
            raise FormatProblem(f"tensor {i}: dtype {rec[K_DTYPE]!r} is not allowed")
        if not (isinstance(shape, list) and len(shape) <= 64
                and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
            raise FormatProblem(f"tensor {i}: shape {shape!r} is not a list of sizes")
        if not all(type(v) is int for v in (offset, nbytes)) or offset % ALIGN or \
                offset < end or offset + nbytes > data_len:
            raise FormatProblem(f"tensor {i}: extent {offset!r}+{nbytes!r} is misaligned, "
                                f"overlaps another or leaves the data region ({data_len} B)")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(shape) * itemsize != nbytes:
            raise FormatProblem(f"tensor {i}: {nbytes} bytes do not hold shape {shape}")
        if not (isinstance(digests, list) and len(digests) == len(pieces(nbytes))
                and all(type(d) is int and 0 <= d < 1 << 64 for d in digests)):
            raise FormatProblem(f"tensor {i}: digests do not match its size")
        specs.append(TensorSpec(dtype, tuple(shape), offset, nbytes, tuple(digests)))
        end = offset + nbytes
    return specs


@dataclass(frozen=True)
class Manifest:
    """A validated manifest (the state trees are still encoded)."""

    root: str
    rank: int
    world_size: int
    step: int
    timeline: str
    started: str | None
    committed: str | None
    root_id: str
    entries: dict[str, tuple[str, Any]]
    tensors: list[TensorSpec]
    rng: dict[str, Any]


def check_manifest(doc: Any, header: Header) -> Manifest:
    """The manifest of a slot whose header is ``header``, or FormatProblem."""
    keys = {K_VERSION, K_ROOT, K_RANK, K_WORLD, K_STEP, K_TIMELINE, K_STARTED, K_COMMITTED,
            K_ROOT_ID, K_ENTRIES, K_TENSORS, K_RNG}
    if not isinstance(doc, dict) or set(doc) != keys:
        raise FormatProblem("the manifest does not have the expected keys")
    if doc[K_VERSION] != FORMAT_VERSION or doc[K_STEP] != header.step:
        raise FormatProblem("the manifest's version or step contradicts the header")
    rank, world = doc[K_RANK], doc[K_WORLD]
    if type(rank) is not int or type(world) is not int or not 0 <= rank < world:
        raise FormatProblem(f"rank {rank!r} of world size {world!r}")
    for key in (K_ROOT, K_TIMELINE, K_ROOT_ID):
        if not isinstance(doc[key], str):
            raise FormatProblem(f"manifest {key!r} is not a string")
    for key in (K_STARTED, K_COMMITTED):
        if doc[key] is not None and not isinstance(doc[key], str):
            raise FormatProblem(f"manifest {key!r} is not a string or null")
    entries = doc[K_ENTRIES]
    if not isinstance(entries, dict) or not all(
            isinstance(e, dict) and set(e) == {K_KIND, K_TREE} and e[K_KIND] in KINDS
            for e in entries.values()):
        raise FormatProblem("the manifest's entries are malformed")
    if not isinstance(doc[K_RNG], dict):
        raise FormatProblem("the manifest's RNG states are malformed")
    return Manifest(doc[K_ROOT], rank, world, doc[K_STEP], doc[K_TIMELINE], doc[K_STARTED],
                    doc[K_COMMITTED], doc[K_ROOT_ID],
                    {k: (e[K_KIND], e[K_TREE]) for k, e in entries.items()},
                    check_tensors(doc[K_TENSORS], header.data_len), doc[K_RNG])


# ---------------------------------------------------------------------------- the choice

@dataclass(frozen=True)
class SlotSummary:
    """What a rank tells the others about one whole slot (small, JSON-able)."""

    step: int
    seq: int
    rank: int
    world_size: int
    started: str | None
    committed: str | None
    root_id: str


@dataclass(frozen=True)
class RootView:
    """What rank 0 read of the root when a load starts (small, JSON-able fields).

    ``latest``: the newest complete checkpoint of the live timeline (name, step), or None;
    ``root_id``: the root's id (``ROOT.json``), or None when it has none (never leased, or
    deleted since).
    """

    latest: tuple[str, int] | None
    root_id: str | None

    @property
    def latest_name(self) -> str | None:
        return self.latest[0] if self.latest is not None else None


def usable(summary: SlotSummary, rank: int, world_size: int, root: RootView) -> bool:
    """Whether a slot continues the root as ``root`` shows it, on this world.

    The slot must have been taken on this very root (its id: a root deleted and made again,
    or never leased since, has another or none), and record the root's newest complete
    checkpoint as the last save its Checkpointer started or the last one it knew committed;
    otherwise the root changed under it (another job, a rollback) and it is not used.
    """
    if summary.rank != rank or summary.world_size != world_size:
        return False
    if root.root_id is None or summary.root_id != root.root_id:
        return False
    name = root.latest_name
    return name == summary.committed or (summary.started is not None
                                         and name == summary.started)


def choose(per_rank: list[list[SlotSummary]], root: RootView) -> int | None:
    """The step to restore from memory on every rank, or None (use the DCP tiers).

    ``per_rank[r]`` are rank r's whole slots; ``root`` is what rank 0 read of the root. The
    step must be whole and usable on every rank and not older than the root's newest complete
    checkpoint; the newest such step wins.
    """
    world_size = len(per_rank)
    common: set[int] | None = None
    for rank, summaries in enumerate(per_rank):
        steps = {s.step for s in summaries if usable(s, rank, world_size, root)}
        common = steps if common is None else common & steps
    if not common:
        return None
    step = max(common)
    if root.latest is not None and step < root.latest[1]:
        return None
    return step
