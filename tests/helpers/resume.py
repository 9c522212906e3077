"""One resume oracle for every stateful reader (StreamLoader, ReplicaLoader, the
Checkpointer with a loader): resume from the start, a midpoint, the end of an epoch and
into the next epoch, and compare with one uninterrupted run.

A subject is anything with ``steps()`` (an iterator over the sample ids of each step from
the current state on, crossing epochs), ``state_dict()``, ``load_state_dict()`` and
``close()``; :class:`LoaderSubject` and :class:`ReplicaSubject` adapt the two loaders.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from streamcache.loading.loader import StreamLoader
from streamcache.replicas import ReplicaLoader


class Resumable(Protocol):
    def steps(self) -> Iterator[Sequence[int]]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class LoaderSubject:
    """A StreamLoader as a subject: each pass is an epoch; the next pass is the next one."""

    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader

    def steps(self) -> Iterator[list[int]]:
        while True:
            for batch in self.loader:
                yield np.asarray(batch["__id__"]).tolist()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()


class ReplicaSubject:
    """The loaders of every replica group of one run (one rank each), stepped together with
    every group committing: a step's ids are all groups' real samples (padding left out)."""

    def __init__(self, loaders: Sequence[ReplicaLoader]) -> None:
        self.loaders = list(loaders)

    def steps(self) -> Iterator[list[int]]:
        everyone = set(range(len(self.loaders)))
        while True:
            batches = [loader.next_batch() for loader in self.loaders]
            if batches[0] is None:  # an epoch without a step: the loaders moved on
                continue
            ids: list[int] = []
            for batch in batches:
                real = ~np.asarray(batch["__padding__"], dtype=bool)
                ids.extend(np.asarray(batch["__id__"])[real].tolist())
            for loader in self.loaders:  # commit before handing out: a state taken now
                loader.commit(everyone)  # is after this step
            yield ids

    def state_dict(self) -> dict[str, Any]:
        states = [loader.state_dict() for loader in self.loaders]
        assert all(s == states[0] for s in states), "replica groups disagree on the state"
        return states[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for loader in self.loaders:
            loader.load_state_dict(state)

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()


def take(subject: Resumable, count: int) -> list[list[int]]:
    """The ids of the next ``count`` steps (no step beyond them is asked for)."""
    steps = subject.steps()
    return [[int(i) for i in next(steps)] for _ in range(count)]


def resume_points(steps_per_epoch: int) -> dict[str, int]:
    """Where the oracle interrupts a run, in steps from the start."""
    return {"the start": 0, "a midpoint": steps_per_epoch // 2,
            "the end of an epoch": steps_per_epoch,
            "into the next epoch": steps_per_epoch + max(1, steps_per_epoch // 2)}


def check_resume(make: Callable[[], Resumable], *, steps_per_epoch: int,
                 epoch_samples: Collection[int] | None = None,
                 save: Callable[[Resumable], Any] | None = None,
                 load: Callable[[Resumable, Any], None] | None = None,
                 ) -> list[list[int]]:
    """Check that ``make()``'s subject resumes exactly; return the uninterrupted run.

    One uninterrupted run of two epochs is the reference: within each epoch no sample comes
    twice (and, given ``epoch_samples``, every one of them comes). Then, for each of
    :func:`resume_points`, a fresh subject takes the steps up to the point (they must be
    the reference's), its state is saved, and another fresh subject loads it and takes the
    rest: those steps must be the reference's too.

    Args:
        make: a fresh subject at the start of the first epoch.
        steps_per_epoch: steps of one epoch.
        epoch_samples: the ids every epoch must hold exactly once (None: only no repeats).
        save, load: how the state travels (default: ``state_dict`` / ``load_state_dict``;
            the Checkpointer tests save and load through a checkpoint instead).
    """
    total = 2 * steps_per_epoch
    first = make()
    try:
        reference = take(first, total)
    finally:
        first.close()
    for epoch in range(2):
        ids = [i for step in reference[epoch * steps_per_epoch:(epoch + 1) * steps_per_epoch]
               for i in step]
        assert len(ids) == len(set(ids)), f"epoch {epoch} repeats samples"
        if epoch_samples is not None:
            assert sorted(ids) == sorted(epoch_samples), f"epoch {epoch} misses samples"
    for where, point in resume_points(steps_per_epoch).items():
        before = make()
        try:
            head = take(before, point)
            state = before.state_dict() if save is None else save(before)
        finally:
            before.close()
        assert head == reference[:point], f"a run interrupted at {where} went another way"
        after = make()
        try:
            after.load_state_dict(state) if load is None else load(after, state)
            rest = take(after, total - point)
        finally:
            after.close()
        assert rest == reference[point:], f"resuming from {where} (step {point}) differs " \
                                          "from the uninterrupted run"
    return reference
