"""Guards that hold back the updates of model and optimizer tensors while a background copy
reads them (background staging of a save, a memory-tier snapshot copied in the background).

A copy of a model/optimizer entry's tensors is *held* from the moment its state is taken
until the copy is done. While any copy is held, the only operations that change those tensors
in a training loop wait: each optimizer's ``step`` (a step pre-hook) and, for models with
buffers (BatchNorm statistics change in ``forward``), the model's forward (a forward
pre-hook). Other in-place writes (an EMA update, a ``.data`` write, an optimizer that is not
in the state) are not guarded; :meth:`UpdateGuard.wait` is what a loop calls before them.

A copy that cannot exclude unguarded writes by waiting can detect them: a tensor's version
counter moves with every in-place write (``.data`` writes excepted), and
:meth:`Hold.then_verify` runs a check of them in the training thread after the copy, where any
write that thread started before the copy ended has finished.

Thread safety: :meth:`UpdateGuard.hold`, :meth:`UpdateGuard.wait` and the hooks run in the
training thread; a hold's release may come from any thread, once or more (the first counts).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .state import ModelState, ModuleEntry, OptimizerEntry


def guarded_keys(entries: Mapping[str, Any]) -> list[str]:
    """The keys of a resolved state's model and optimizer entries: the ones a background
    copy copies late, whose updates the guards can hold back."""
    return [key for key, value in entries.items()
            if isinstance(value, (ModelState, ModuleEntry, OptimizerEntry))]


class Hold:
    """One copy's hold on the updates (:meth:`UpdateGuard.hold`)."""

    def __init__(self, guard: UpdateGuard) -> None:
        self._guard = guard
        self._pid = os.getpid()  # (a forked child's guard does not count the parent's holds)
        self._released = threading.Lock()

    def release(self) -> None:
        """The copy is done (any thread; a second call changes nothing)."""
        if self._released.acquire(blocking=False) and self._pid == os.getpid():
            self._guard._release()

    def then_verify(self, verify: Callable[[], None]) -> None:
        """Run ``verify`` in the training thread once the holds are released: at its next
        guarded operation or :meth:`UpdateGuard.wait`, whichever comes first (any in-place
        write the thread started before has then finished, and moved its tensors' version
        counters). Training thread only."""
        self._guard._verifies.append(verify)


class UpdateGuard:
    """Hooks on the state's optimizers and models that wait while a copy is held."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._held = 0
        self._changed = threading.Condition()
        self._verifies: list[Callable[[], None]] = []
        self._hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def hold(self, entries: Iterable[Any]) -> Hold:
        """Hold back the updates of ``entries`` (ModelState-like: ``.model`` and
        ``.optimizers``) until the returned hold is released. Training thread only."""
        self._adopt()
        for entry in entries:
            self._install(entry)
        with self._changed:
            self._held += 1
        return Hold(self)

    @property
    def held(self) -> bool:
        return self._held > 0

    def wait(self) -> None:
        """Block until no copy is held, then run the verifications registered meanwhile.
        Training thread only."""
        if self._held:
            self._adopt()
            with self._changed:
                self._changed.wait_for(lambda: self._held == 0)
        while self._verifies:  # (the hooks' path every step: nothing held, nothing to run)
            self._verifies.pop(0)()

    def close(self) -> None:
        """Remove the hooks (a held copy's release still counts afterwards)."""
        for handles in list(self._hooks.values()):
            for handle in handles:
                handle.remove()
        self._hooks.clear()

    def _adopt(self) -> None:
        """In a forked child, forget the parent's holds: their copies run in the parent (a
        child waiting for them would wait forever)."""
        if self._pid != os.getpid():
            self._pid, self._held, self._verifies = os.getpid(), 0, []
            self._changed = threading.Condition()

    def _release(self) -> None:
        with self._changed:
            self._held -= 1
            self._changed.notify_all()

    def _install(self, entry: Any) -> None:
        def before(*_: Any) -> None:
            self.wait()

        for optimizer in entry.optimizers:
            if optimizer not in self._hooks:
                self._hooks[optimizer] = [optimizer.register_step_pre_hook(before)]
        model = entry.model
        if model not in self._hooks and any(True for _ in model.buffers()):
            self._hooks[model] = [model.register_forward_pre_hook(before)]


class VersionCheck:
    """Whether the tensors of a background copy were written to while it ran.

    Made in the training thread when the state is taken (it records each tensor's version
    counter); :meth:`copied` marks the copy done (or failed, or never to run); :meth:`verify`,
    in the training thread after that (its next guarded operation or wait:
    :meth:`Hold.then_verify`), compares the counters: there, every in-place write that thread
    started before the copy ended has finished and counted (on the copying thread a write
    still running at the copy's end would be missed). :meth:`changed`, on the copying
    thread, waits for that verdict; if the training thread does not come by within
    ``SELF_CHECK_AFTER_S`` of the copy (a script that ends, or evaluates, after its last
    snapshot), the copying thread compares the counters itself: only a write that started
    before the copy ended and runs that long after it would be missed.
    """

    SELF_CHECK_AFTER_S = 5.0

    def __init__(self, items: Iterable[tuple[torch.Tensor, str]]) -> None:
        self._items = list(items)  # (tensor, the key of its entry)
        self._versions = [_version(tensor) for tensor, _ in self._items]
        self._done = threading.Event()
        self._verdict = threading.Event()
        self._comparing = threading.Lock()
        self._changed: list[str] = []
        if not self._items:
            self._done.set()
            self._verdict.set()

    @classmethod
    def of(cls, entries: Mapping[str, Any]) -> VersionCheck:
        """The check of every tensor of ``entries`` ({key: state tree})."""
        return cls((tensor, key) for key, value in entries.items()
                   for tensor in tensor_leaves(value))

    def copied(self) -> None:
        """The live tensors are no longer read (any thread, idempotent)."""
        self._done.set()

    def verify(self) -> None:
        """Training thread, once :meth:`copied` (waits for it): compare the counters, once."""
        if self._verdict.is_set():
            return
        self._done.wait()
        with self._comparing:
            if not self._verdict.is_set():
                self._changed = sorted({key for (tensor, key), version in zip(
                    self._items, self._versions, strict=True) if _version(tensor) != version})
                self._items = []
                self._verdict.set()

    def changed(self) -> list[str]:
        """The keys of the entries whose tensors were written to during the copy (none: the
        copy is true); waits for :meth:`verify` (see the class doc for how long)."""
        if not self._verdict.wait(self.SELF_CHECK_AFTER_S):
            self.verify()
        return self._changed


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a state tree (dicts, lists, tuples), in order."""
    found: list[torch.Tensor] = []
    stack = [value]
    while stack:  # (a loop, not recursion: it runs in the training thread at every call)
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(reversed(item.values()))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return found


def _version(tensor: torch.Tensor) -> int:
    if type(tensor) is not torch.Tensor:  # a DTensor's writes land in its local tensor
        tensor = getattr(tensor, "_local_tensor", tensor)
    return tensor._version
