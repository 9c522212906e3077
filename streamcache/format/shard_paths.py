"""Shard-path confinement: an index names shards under its own folder, and never on another
filesystem.

Everything read back from an index is untrusted: :func:`check_shard_paths` refuses a shard
path that leaves the index's folder (``..``, an absolute path, a URL) unless the reader opts
in, and even then one of another protocol, so an index on an object store can never name a
local file. :func:`check_same_filesystem` applies the same rule when an index is built.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import IndexFormatError, SourceError
from ..remote import storage
from .arrow_arrays import contains, numpy_values, string_buffers
from .shard_table import ShardTable


def check_shard_paths(table: ShardTable, url: str, root: str, *,
                      allow_external_paths: bool = False) -> None:
    """Refuse shard paths of ``table`` (the index at ``url``) that leave the dataset's folder
    ``root``.

    A relative path must stay under the index's folder (no ``..`` above it); an absolute path
    or URL must lie under that folder too, unless ``allow_external_paths``; even then it must
    use the index's own protocol, so an index on an object store can never name a local file.

    Raises:
        IndexFormatError: naming the first offending path and the option.
    """
    if table.paths_outside == 0:  # counted when the table was verified: all plain names
        return
    paths = table.paths()
    root_protocol, root_path = _split_url(root)
    for k in _named_outside(paths):
        path = paths[int(k)].as_py()
        if not storage.is_absolute_url(path):
            if posixpath.normpath(path).split("/")[0] == "..":
                raise IndexFormatError(
                    f"{url}: shard path {path!r} leaves the dataset's folder with '..'; "
                    "name files under the index's folder (or, with allow_external_paths=True, "
                    "by their absolute path or URL)"
                )
            continue
        protocol, location = _split_url(path)
        if protocol == root_protocol and _under(location, root_path):
            continue
        if not allow_external_paths:
            raise IndexFormatError(
                f"{url}: shard path {path!r} is outside the dataset's folder "
                f"{root}; pass allow_external_paths=True to read shards elsewhere on "
                f"the index's own filesystem ({root_protocol}://)"
            )
        if protocol != root_protocol:
            raise IndexFormatError(
                f"{url}: shard path {path!r} is on {protocol}://, the index on "
                f"{root_protocol}://; an index may name external shards on its own filesystem "
                "only, even with allow_external_paths=True: copy the shards beside the index"
            )


def local_escape(url: str, root: str) -> str | None:
    """Where a local file ``url`` really is, links resolved, when that is outside the local
    folder ``root`` (links resolved too); None when it is inside, or either is not local.

    Names are checked when an index is loaded (:func:`check_shard_paths`); links only on the
    disk they are on, when a shard is opened: a file of a dataset folder may be a symbolic
    link to any other file of the machine.
    """
    path, folder = _local(url), _local(root)
    if path is None or folder is None:
        return None
    real, real_folder = os.path.realpath(path), os.path.realpath(folder)
    return None if _under(real, real_folder) else real


def _local(url: str) -> str | None:
    if url.startswith("file://"):
        return url.removeprefix("file://")
    return None if "://" in url else url


def count_outside(paths: Any) -> int:
    """How many of ``paths`` (an Arrow string array) are absolute, URLs or climb with '..'
    (the paths that :func:`check_shard_paths` must look at; a table with none is confined
    wherever its index lives)."""
    return int(_named_outside(paths).size)


def _named_outside(paths: Any) -> np.ndarray:
    """The indices of the paths that are absolute, URLs or climb with '..'."""
    import pyarrow.compute as pc
    if not paths.null_count:  # the usual case, on the bytes: no '://' or '..' anywhere
        offsets, data = string_buffers(paths)
        if not (contains(data, b"://") or contains(data, b"..")):
            nonempty = offsets[:-1] < offsets[1:]
            first = np.zeros(len(paths), np.uint8)
            first[nonempty] = data[offsets[:-1][nonempty]]
            return np.flatnonzero(first == ord("/")).astype(np.int64)
    suspicious = pc.or_(pc.or_(pc.starts_with(paths, "/"), pc.match_substring(paths, "://")),
                        pc.match_substring_regex(paths, r"(^|/)\.\.(/|$)"))
    return numpy_values(pc.indices_nonzero(suspicious))


def _split_url(url: str) -> tuple[str, str]:
    """(protocol, normalized path): local paths and ``file://`` URLs are ``file``."""
    protocol, sep, rest = url.partition("://")
    if not sep:
        protocol, rest = "file", url
    protocol = "file" if protocol == "local" else protocol
    rest = posixpath.normpath("/" + rest.lstrip("/")) if protocol != "file" else \
        posixpath.normpath(rest)
    return protocol, rest


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_same_filesystem(output: str, files: str,
                          storage_options: Mapping[str, Any] | None) -> None:
    """Refuse an index at ``output`` that would name the files at ``files`` on another
    filesystem (see :func:`check_shard_paths`).

    Raises:
        SourceError: the two are on different protocols.
    """
    out_fs, out_path = storage.filesystem(output, storage_options)
    out_protocol, files_protocol = (_split_url(storage.unstrip(out_fs, out_path))[0],
                                    _split_url(files)[0])
    if out_protocol != files_protocol:
        raise SourceError(
            f"an index at {output} ({out_protocol}://) could not name files on "
            f"{files_protocol}:// ({files}): an index names shards on its own filesystem "
            "only; write the index beside the files, or copy them"
        )
