"""Send a loader's input statistics to the logger a training job already has, in one line.

    loader.log_stats(SummaryWriter("runs/x"))          # TensorBoard (add_scalar)
    loader.log_stats(wandb)                            # Weights & Biases (log), or a run
    loader.log_stats(trainer.logger)                   # a Lightning logger (log_metrics)
    loader.log_stats(lambda metrics, step: print(step, metrics))

Lightning users can also add ``streamcache.integrations.lightning.StreamStats()`` to the
Trainer's callbacks. Every ``every_n_steps`` received batches the loader sends what happened
since the last report (:meth:`LoaderStats.metrics` of the difference: the loop's wait per
step, the fraction of batches that were ready, bytes fetched, cache hit rate, retries,
stalls, prefetch depth), named ``prefix + name``, at its own step count.

The logger is called on the training loop's thread, right after a batch is received, so it
needs no locking; its time is counted in ``LoaderStats.log_s``. A logger that raises is
reported once as a warning and then no longer called: a metrics backend that goes away
does not stop training. None of the logging packages is imported here: the target is
recognised by what it can do.
"""

from __future__ import annotations

import time
import types
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .stats import LoaderStats

if TYPE_CHECKING:
    from .stats import StepCounters

MetricsSink = Callable[[Mapping[str, float], int], object]


def metrics_sink(target: Any) -> MetricsSink:
    """A function ``(metrics, step)`` that hands metrics to ``target``.

    Raises:
        ConfigError: ``target`` is none of the kinds the module docstring lists.
    """
    if hasattr(target, "log_metrics"):  # Lightning loggers (TensorBoard, W&B, CSV, MLflow...)
        return lambda metrics, step: target.log_metrics(dict(metrics), step=step)
    if hasattr(target, "add_scalar"):  # torch.utils.tensorboard.SummaryWriter, tensorboardX
        def add_scalars(metrics: Mapping[str, float], step: int) -> None:
            for name, value in metrics.items():
                target.add_scalar(name, value, step)
        return add_scalars
    if _is_wandb(target):
        # wandb (the module or a Run): commit=False adds the numbers to the job's next
        # wandb.log, at the job's own step, instead of advancing wandb's step counter.
        return lambda metrics, step: target.log(dict(metrics), commit=False)
    if callable(target):
        return target
    raise ConfigError(
        f"log_stats takes a Lightning logger (log_metrics), a TensorBoard SummaryWriter "
        f"(add_scalar), wandb or a wandb Run (log), or a function (metrics, step); got "
        f"{type(target).__name__}")


def _is_wandb(target: Any) -> bool:
    """The wandb module, or an object of one of its classes (a Run)."""
    name = target.__name__ if isinstance(target, types.ModuleType) else type(target).__module__
    return str(name).split(".")[0] == "wandb" and hasattr(target, "log")


class StatsLogger:
    """Reports a loader's statistics to one logger every ``every_n_steps`` steps.

    Made by :meth:`StreamLoader.log_stats`; :meth:`close` stops it.

    Thread safety: :meth:`step` runs on the loop's thread only.
    """

    def __init__(self, sink: MetricsSink, snapshot: Callable[[], LoaderStats],
                 counters: StepCounters, *, every_n_steps: int, prefix: str) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or \
                every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if not isinstance(prefix, str):
            raise ConfigError(f"prefix must be a string, got {type(prefix).__name__}")
        self._sink = sink
        self._snapshot = snapshot
        self._counters = counters
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self._last = snapshot()
        self.closed = False
        self.failure: BaseException | None = None

    def step(self, steps: int) -> None:
        """Called after the loop received its ``steps``-th batch."""
        if self.closed or steps % self.every_n_steps:
            return
        started = time.perf_counter()
        try:
            now = self._snapshot()
            metrics = {self.prefix + name: value
                       for name, value in now.since(self._last).metrics().items()}
            self._last = now
            self._sink(metrics, steps)
        except Exception as error:  # the job goes on without its data metrics
            self.failure = error
            self.closed = True
            warnings.warn(f"streamcache: the stats logger raised {type(error).__name__}: "
                          f"{error}; it is not called again (training goes on)",
                          RuntimeWarning, stacklevel=2)
        finally:
            self._counters.log_s += time.perf_counter() - started

    def close(self) -> None:
        self.closed = True


__all__ = ["MetricsSink", "StatsLogger", "metrics_sink"]
