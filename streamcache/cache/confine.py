"""Paths below the cache folder that never lead out of it.

``cache_dir`` is shared by every process of a node, and anyone who may write there may plant a
symbolic link (``locks/`` pointing at another user's folder). The cache therefore makes and
opens its folders and lock files without following a link below ``cache_dir``: files by
descriptor-relative opens with ``O_NOFOLLOW`` (no window between a check and the use), folders
by checking each component. ``cache_dir`` itself is the user's choice and may be a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from ..errors import CacheError

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_below(root: str, relative: str, flags: int, mode: int = 0o644) -> int:
    """A descriptor of the file ``root/relative``, opened with ``flags``; the folders on the
    way are made as needed (``root`` too). No component below ``root`` is followed if it is
    a symbolic link: each folder is opened relative to the one above with ``O_NOFOLLOW``, so
    a link planted in a shared cache folder (even between a check and the use) can never
    make the cache create or lock files elsewhere. ``root`` itself is the user's choice and
    may be a link.

    Raises:
        CacheError: a component below ``root`` is a symbolic link (or not a folder).
    """
    parts = [p for p in relative.split(os.sep) if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"{relative!r} is not a plain path below the cache folder")
    try:
        fd = os.open(root, _FOLDER_FLAGS)
    except FileNotFoundError:  # the cache folder was removed: make it again
        os.makedirs(root, exist_ok=True)
        fd = os.open(root, _FOLDER_FLAGS)
    try:
        for depth, part in enumerate(parts[:-1]):
            child = _enter(fd, part, root, parts[:depth + 1])
            os.close(fd)
            fd = child
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise link_error(root, parts) from error
            raise
    finally:
        os.close(fd)


def _enter(parent: int, name: str, root: str, parts: list[str]) -> int:
    """A descriptor of the folder ``name`` of the folder ``parent`` (made if missing), not
    following a link."""
    try:
        try:
            return os.open(name, _FOLDER_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=parent)
            return os.open(name, _FOLDER_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise link_error(root, parts) from error
        raise


def check_folder_below(root: str, relative: str) -> str:
    """Make the folder ``root/relative`` (and those above it) if missing, refusing any
    component below ``root`` that is a symbolic link or not a folder; returns its path.

    Raises:
        CacheError: a component is a symbolic link (planted: the cache would write, and
            remove stale copies, wherever it points).
    """
    parts = [p for p in relative.split(os.sep) if p]
    os.makedirs(root, exist_ok=True)
    path = root
    for depth, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o755)
            st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise link_error(root, parts[:depth + 1])
    return path


def link_error(root: str, parts: list[str]) -> CacheError:
    path = os.path.join(root, *parts)
    target = os.path.realpath(path)
    return CacheError(
        f"{path} is a symbolic link to {target} (or not a folder of its own); the cache "
        "writes only into folders of its own and never follows links out of cache_dir: "
        "remove the link (or use another cache_dir)")


__all__ = ["check_folder_below", "link_error", "open_below"]
