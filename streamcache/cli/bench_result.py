"""What one ``streamcache bench`` run measured: its totals, its per-step timeline (what
``--plot`` draws, cli/plots.py) and its diagnosis (``--explain``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..loading.explain import Diagnosis, diagnose
from ..loading.stats import LoaderStats


@dataclass(frozen=True)
class StepSample:
    """One step of a run, for the plots: when its batch arrived (seconds from the start),
    how long the loop waited for it, samples so far, and the cache's counters so far."""

    step: int
    at_s: float
    waited_s: float
    samples: int
    cache_hits: int | None = None
    cache_misses: int | None = None


@dataclass
class BenchResult:
    """One streaming run (``error``: why it stopped, when it failed)."""

    name: str
    steps: int = 0
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0
    first_batch_s: float = 0.0
    waited_s: float = 0.0
    peak_rss_mb: float = 0.0
    store: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None
    error: str | None = None
    loader_stats: LoaderStats | None = field(default=None, repr=False)  # after the 1st batch
    settings: dict[str, int] = field(default_factory=dict, repr=False)

    first_batch_samples: int = 0
    first_batch_bytes: int = 0
    timeline: list[StepSample] = field(default_factory=list, repr=False)

    @property
    def steady_s(self) -> float:
        """Seconds from the first batch to the end (start-up is ``first_batch_s``)."""
        return self.seconds - self.first_batch_s

    @property
    def samples_per_s(self) -> float:
        """Steady-state rate: samples after the first batch over :attr:`steady_s`."""
        counted = self.samples - self.first_batch_samples
        return counted / self.steady_s if self.steady_s > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        counted = self.bytes - self.first_batch_bytes
        return counted / 1e6 / self.steady_s if self.steady_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """Everything but the per-step timeline (that is what ``--plot`` draws)."""
        summary = {k: v for k, v in asdict(self).items()
                   if k not in ("timeline", "loader_stats", "settings")}
        if self.loader_stats is not None:
            summary["loader_stats"] = self.loader_stats.to_dict()
        return {**summary, "samples_per_s": self.samples_per_s, "mb_per_s": self.mb_per_s}

    def explain(self) -> Diagnosis | None:
        """Where this run's time went and what would help (streamcache runs only)."""
        if self.loader_stats is None or self.error is not None:
            return None
        return diagnose(self.loader_stats, self.steady_s, **self.settings)
