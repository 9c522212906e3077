"""A reference model of a weighted mixture, written from its specification (docs/mixtures.md)
and not from the plan's code: the tests compare the plan and the loader with it.

- The quota: position ``n`` belongs to the source whose next sample's window
  ``[floor(j D / a), ceil((j + 1) D / a))`` has opened and closes first (ties to the lower
  index), decided position by position, with no period table.
- A source's ``k``-th sample over the run is position ``k mod E`` of its epoch ``k div E``;
  a source epoch is ``ceil(E / N)`` passes, each the source's own single-dataset order
  (:class:`~streamcache.plan.EpochOrder`, the trusted part) with the source's seed.
- Finite: epoch ``e`` restarts the quota and ends where the first source has read ``E``
  samples; steps of ``B`` from the cursor, a shorter rest dropped (the epoch is over once
  its last whole step is read). Infinite: one quota for
  ever, read in consecutive runs of ``B`` positions whatever the batch sizes (nothing
  skipped); with tail "drop" an epoch is ``floor(L / B)`` steps, so epoch ``k`` begins at
  ``k * floor(L / B) * B`` for an uninterrupted run with one global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from streamcache.plan import EpochOrder, ShuffleOptions
from streamcache.plan.mixture import source_seed

Sample = tuple[int, int]  # (source, id within the source)


@dataclass
class MixtureModel:
    rows: list[list[int]]  # each source's shard row counts
    shares: tuple[int, ...]  # integer weights
    seed: int
    shuffle: ShuffleOptions
    epochs: list[int] | None = None  # each source's epoch size (default: its sample count)
    _orders: dict[tuple[int, int], EpochOrder] = field(default_factory=dict, repr=False)

    @property
    def sizes(self) -> list[int]:
        return [sum(r) for r in self.rows]

    @property
    def epoch_sizes(self) -> list[int]:
        return list(self.epochs or self.sizes)

    def owners(self, count: int) -> list[int]:
        """The source of each of the first ``count`` positions of a quota begun afresh."""
        total, taken, out = sum(self.shares), [0] * len(self.shares), []
        for position in range(count):
            open_ = [(-(-(taken[s] + 1) * total // a), s) for s, a in enumerate(self.shares)
                     if taken[s] * total // a <= position]
            _, source = min(open_)
            out.append(source)
            taken[source] += 1
        return out

    def sample(self, source: int, k: int) -> int:
        """The id (within its source) of source ``source``'s ``k``-th sample over the run."""
        size, epoch_size = self.sizes[source], self.epoch_sizes[source]
        epoch, within = divmod(k, epoch_size)
        number = epoch * -(-epoch_size // size) + within // size
        order = self._orders.get((source, number))
        if order is None:
            order = EpochOrder(np.asarray(self.rows[source], dtype=np.int64),
                               source_seed(self.seed, source), number, self.shuffle)
            self._orders[source, number] = order
        return int(order.sample_ids_at(np.array([within % size]))[0])

    def epoch_length(self) -> int:
        """Positions of a finite epoch (also the length of an infinite one)."""
        counts, position = [0] * len(self.shares), 0
        total = sum(self.shares)  # some source has read its epoch by then
        owners = self.owners(min(e * total // a + total
                                 for e, a in zip(self.epoch_sizes, self.shares, strict=True)))
        while all(c < e for c, e in zip(counts, self.epoch_sizes, strict=True)):
            counts[owners[position]] += 1
            position += 1
        return position

    def sequence(self, count: int) -> list[Sample]:
        """An infinite mixture's first ``count`` positions."""
        taken = [0] * len(self.shares)
        out = []
        for source in self.owners(count):
            out.append((source, self.sample(source, taken[source])))
            taken[source] += 1
        return out

    def finite_epoch(self, epoch: int) -> list[Sample]:
        """A finite mixture's epoch ``epoch``, whole."""
        taken = [epoch * e for e in self.epoch_sizes]
        out = []
        for source in self.owners(self.epoch_length()):
            out.append((source, self.sample(source, taken[source])))
            taken[source] += 1
        return out

    def batches(self, infinite: bool, plan: list[tuple[int, int]]) -> list[list[Sample]]:
        """The global batches of a run that reads ``steps`` steps of ``batch`` for each
        ``(batch, steps)`` of ``plan`` in turn (a resume between them; tail "drop")."""
        if infinite:
            total = sum(b * n for b, n in plan)
            flat, out, at = self.sequence(total), [], 0
            for batch, steps in plan:
                for _ in range(steps):
                    out.append(flat[at:at + batch])
                    at += batch
            return out
        length, epoch, consumed, out = self.epoch_length(), 0, 0, []
        current = self.finite_epoch(0)
        for batch, steps in plan:
            for _ in range(steps):
                if length - consumed < batch:  # a rest shorter than a batch is dropped
                    epoch, consumed = epoch + 1, 0
                    current = self.finite_epoch(epoch)
                out.append(current[consumed:consumed + batch])
                consumed += batch
                if length - consumed < batch:  # the epoch's last step: the epoch is over
                    epoch, consumed = epoch + 1, 0
                    current = self.finite_epoch(epoch)
        return out

    def infinite_epoch_start(self, epoch: int, batch: int) -> int:
        """Where an uninterrupted infinite run with global batch ``batch`` (tail "drop")
        begins epoch ``epoch``."""
        return epoch * (self.epoch_length() // batch) * batch


__all__ = ["MixtureModel", "Sample"]
