"""One fork guard for the objects that own locks, threads, pools or connections.

A child made by ``fork()`` (DataLoader worker processes) inherits every lock in the state its
parent's threads left it, held ones included, but none of those threads. An object that may be
used in a child registers here and gets a fresh start there: :func:`register` calls its
``_after_fork_in_child()`` in every child forked while it is alive. Module-level state is
reset with :func:`at_fork` hooks, which run before the objects' own.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None:
        """Replace this process's locks, threads and pools (they belong to the parent)."""


_objects: weakref.WeakSet[Any] = weakref.WeakSet()
_before: list[Callable[[], None]] = []
_after_in_child: list[Callable[[], None]] = []


def register(obj: ForkAware) -> None:
    """Have ``obj._after_fork_in_child()`` called in every child forked while ``obj`` lives."""
    _objects.add(obj)


def live(kind: type[T]) -> list[T]:
    """The registered objects of ``kind`` still alive (made here or inherited by a fork)."""
    return [obj for obj in list(_objects) if isinstance(obj, kind)]


def at_fork(*, before: Callable[[], None] | None = None,
            after_in_child: Callable[[], None] | None = None) -> None:
    """Run ``before`` in the parent just before each fork, ``after_in_child`` in each child."""
    if before is not None:
        _before.append(before)
    if after_in_child is not None:
        _after_in_child.append(after_in_child)


def _run_before() -> None:
    for hook in _before:
        hook()


def _run_after_in_child() -> None:
    for hook in _after_in_child:
        hook()
    for obj in list(_objects):
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_run_before, after_in_child=_run_after_in_child)


__all__ = ["ForkAware", "at_fork", "live", "register"]
