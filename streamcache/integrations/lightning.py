"""``StreamStats``: a Lightning callback that logs the train loader's input statistics.

    trainer = L.Trainer(callbacks=[StreamStats()])     # one line

Every ``every_n_steps`` training batches it logs what happened since its previous report
(:meth:`~streamcache.loading.stats.LoaderStats.metrics`: the loop's wait per step, the
fraction of batches ready when asked, prefetch depth, bytes fetched, cache hit rate,
retries, stalls) through ``LightningModule.log_dict``, so they reach whatever logger the
Trainer has (TensorBoard, W&B, CSV, ...) at the Trainer's own step. The loader is the
Trainer's train loader when it is a :class:`~streamcache.StreamLoader`, or the one given.

Only this module imports ``lightning``.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from ..errors import ConfigError
from ..loading.loader import StreamLoader
from ..loading.stats import LoaderStats


class StreamStats(L.Callback):
    """Logs a StreamLoader's statistics from the training loop (see the module docstring).

    Args:
        loader: the loader (default: the Trainer's train loader, found when training starts).
        every_n_steps: batches between two reports (>= 1).
        prefix: put before each metric's name.
    """

    def __init__(self, loader: StreamLoader | None = None, *, every_n_steps: int = 50,
                 prefix: str = "streamcache/") -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or \
                every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        self.loader = loader
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self._last: LoaderStats | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.loader is None:
            found = getattr(trainer, "train_dataloader", None)
            if not isinstance(found, StreamLoader):
                raise ConfigError("StreamStats found no StreamLoader as the Trainer's train "
                                  f"loader (it is a {type(found).__name__}): pass it, "
                                  "StreamStats(loader)")
            self.loader = found
        self._last = self.loader.stats()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.loader is None or self._last is None or \
                (batch_idx + 1) % self.every_n_steps:
            return
        now = self.loader.stats()
        metrics = now.since(self._last).metrics()
        self._last = now
        pl_module.log_dict({self.prefix + k: float(v) for k, v in metrics.items()},
                           on_step=True, on_epoch=False)


__all__ = ["StreamStats"]
