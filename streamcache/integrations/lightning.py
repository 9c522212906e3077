"""``StreamStats``: a Lightning callback that logs the train loader's input statistics.

    trainer = L.Trainer(callbacks=[StreamStats()])     # one line

At the Trainer's logging cadence (``Trainer(log_every_n_steps=50)`` by default) it logs what
happened since its previous report (:meth:`~streamcache.loading.stats.LoaderStats.metrics`:
the loop's wait per step, the fraction of batches ready when asked, prefetch depth, bytes
fetched, cache hit rate, retries, stalls) through ``LightningModule.log_dict``, so they reach
whatever logger the Trainer has (TensorBoard, W&B, CSV, ...) at the Trainer's own step. The
loader is the Trainer's train loader when it is a :class:`~streamcache.StreamLoader`, or the
one given.

Lightning writes logged values to its loggers only every ``log_every_n_steps`` steps and
drops the others. So reports follow the Trainer's step (``trainer.global_step``, which
Lightning's cadence counts, across epochs and resumes); an explicit ``every_n_steps`` must be
a multiple of ``log_every_n_steps`` when the Trainer has a logger (else a ``ConfigError``
when training starts, rather than reports silently lost).

Only this module imports ``lightning``.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from ..errors import ConfigError
from ..loading.loader import StreamLoader
from ..loading.stats import LoaderStats

#: Steps between reports where neither ``every_n_steps`` nor the Trainer sets them
#: (``log_every_n_steps=0``: Lightning writes no step values, callback_metrics still get them).
_DEFAULT_EVERY_N_STEPS = 50


class StreamStats(L.Callback):
    """Logs a StreamLoader's statistics from the training loop (see the module docstring).

    Args:
        loader: the loader (default: the Trainer's train loader, found when training starts).
        every_n_steps: the Trainer's steps between two reports (>= 1); None (default): the
            Trainer's ``log_every_n_steps``. With a logger, a multiple of it.
        prefix: put before each metric's name.

    Raises:
        ConfigError: ``every_n_steps`` is no integer >= 1 (when made); when training starts,
            no StreamLoader was given or found, or ``every_n_steps`` is not a multiple of
            ``log_every_n_steps`` while the Trainer has a logger (Lightning would drop the
            reports between).
    """

    def __init__(self, loader: StreamLoader | None = None, *, every_n_steps: int | None = None,
                 prefix: str = "streamcache/") -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or
                                          not isinstance(every_n_steps, int) or
                                          every_n_steps < 1):
            raise ConfigError(f"every_n_steps must be an integer >= 1, or None for the "
                              f"Trainer's log_every_n_steps; got {every_n_steps!r}")
        self.loader = loader
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self._cadence = every_n_steps or _DEFAULT_EVERY_N_STEPS
        self._last: LoaderStats | None = None
        self._reported_step = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.loader is None:
            found = getattr(trainer, "train_dataloader", None)
            if not isinstance(found, StreamLoader):
                raise ConfigError("StreamStats found no StreamLoader as the Trainer's train "
                                  f"loader (it is a {type(found).__name__}): pass it, "
                                  "StreamStats(loader)")
            self.loader = found
        self._cadence = self._steps_between_reports(trainer)
        self._last = self.loader.stats()
        self._reported_step = int(trainer.global_step)

    def _steps_between_reports(self, trainer: Any) -> int:
        """``every_n_steps``, checked against the steps at which Lightning writes to its
        loggers; else the Trainer's ``log_every_n_steps`` (else the default)."""
        writes_every = int(getattr(trainer, "log_every_n_steps", 0) or 0)
        if self.every_n_steps is None:
            return writes_every or _DEFAULT_EVERY_N_STEPS
        if writes_every and getattr(trainer, "loggers", None) and \
                self.every_n_steps % writes_every:
            raise ConfigError(
                f"StreamStats(every_n_steps={self.every_n_steps}) would report at steps the "
                f"Trainer's logger never sees: Lightning writes logged values every "
                f"log_every_n_steps={writes_every} steps and drops the others. Leave "
                "every_n_steps out (reports follow the Trainer), give a multiple of "
                f"{writes_every}, or set Trainer(log_every_n_steps={self.every_n_steps})")
        return self.every_n_steps

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = int(trainer.global_step)  # a batch that accumulates gradients keeps it
        if self.loader is None or self._last is None or step == self._reported_step or \
                step % self._cadence:
            return
        now = self.loader.stats()
        metrics = now.since(self._last).metrics()
        self._last, self._reported_step = now, step
        pl_module.log_dict({self.prefix + k: float(v) for k, v in metrics.items()},
                           on_step=True, on_epoch=False)


__all__ = ["StreamStats"]
