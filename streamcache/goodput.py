"""Checkpoint interval and expected goodput: the model, as pure functions (the command
``streamcache goodput`` is cli/goodput.py).

The model (first order, the textbook one): a job checkpoints every ``interval`` seconds of
training, each save blocks training for ``save_cost``, failures arrive at random with mean
time between failures ``mtbf``, and each failure costs ``restart_cost`` plus the work done
since the last checkpoint, on average half a period. Then

    goodput = interval / (interval + save_cost) * (1 - (restart_cost + period / 2) / mtbf)

with ``period = interval + save_cost``. Its exact optimum is
``sqrt(2 * save_cost * (mtbf - restart_cost)) - save_cost``, which is what ``streamcache
goodput`` recommends; Young's ``sqrt(2 * save_cost * mtbf)`` and Daly's higher-order
interval are printed beside it, and agree with it when costs are small against the MTBF.
With an asynchronous checkpointer, ``save_cost`` is the time the training loop is blocked,
not the time until the checkpoint is durable.

Example (no save or restart cost): 8.6 failures a day and a checkpoint every 2 h give 64%
goodput; every 30 min, 91%.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import StreamcacheError

SECONDS_PER_DAY = 86400.0
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h|d)?\s*$")


class GoodputError(StreamcacheError, ValueError):
    """Inputs to the goodput model are impossible (negative, zero failure rate, ...)."""


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1.5d"``."""
    match = DURATION_RE.match(text)
    if match is None:
        raise GoodputError(f"{text!r} is not a duration: use a number with s, m, h or d "
                           "(e.g. 30m, 2h, 0.9s)")
    return float(match.group(1)) * _UNITS[match.group(2) or ""]


def mtbf_from_failures_per_day(failures_per_day: float) -> float:
    """Mean time between failures in seconds."""
    if failures_per_day <= 0:
        raise GoodputError(f"failures per day must be positive, not {failures_per_day}")
    return SECONDS_PER_DAY / failures_per_day


def young_interval(save_cost: float, mtbf: float) -> float:
    """Young's optimal checkpoint interval, ``sqrt(2 * save_cost * mtbf)`` (seconds)."""
    _check(save_cost=save_cost, mtbf=mtbf)
    return math.sqrt(2.0 * save_cost * mtbf)


def daly_interval(save_cost: float, mtbf: float) -> float:
    """Daly's higher-order optimal interval (seconds); the MTBF when saves cost >= 2 MTBF."""
    _check(save_cost=save_cost, mtbf=mtbf)
    if save_cost >= 2.0 * mtbf:
        return mtbf
    ratio = save_cost / (2.0 * mtbf)
    return math.sqrt(2.0 * save_cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_cost


def optimal_interval(save_cost: float, mtbf: float, restart_cost: float = 0.0) -> float:
    """The interval that maximizes :func:`expected_goodput` (seconds).

    Raises:
        GoodputError: the restart cost is not below the MTBF (no interval makes progress) or
            the save cost is zero (every interval is worse than a shorter one).
    """
    _check(save_cost=save_cost, mtbf=mtbf, restart_cost=restart_cost)
    if restart_cost >= mtbf:
        raise GoodputError(f"a restart ({restart_cost:.0f} s) takes longer than the mean time "
                           f"between failures ({mtbf:.0f} s): no interval makes progress")
    if save_cost <= 0:
        raise GoodputError("with free saves the shortest interval is best: pass the measured "
                           "--save-cost (the blocking time of one save, e.g. 0.9s)")
    period = math.sqrt(2.0 * save_cost * (mtbf - restart_cost))
    return max(period - save_cost, save_cost)


def expected_goodput(
    interval: float, mtbf: float, save_cost: float = 0.0, restart_cost: float = 0.0
) -> float:
    """Fraction of wall time spent on training that is kept (0..1), first-order model."""
    _check(save_cost=save_cost, mtbf=mtbf, restart_cost=restart_cost)
    if interval <= 0:
        raise GoodputError(f"the checkpoint interval must be positive, not {interval} s")
    period = interval + save_cost
    kept = 1.0 - (restart_cost + period / 2.0) / mtbf
    return max(0.0, interval / period * kept)


@dataclass(frozen=True)
class GoodputReport:
    mtbf: float
    interval: float
    recommended: bool
    young: float | None
    daly: float | None
    goodput: float
    save_overhead: float
    lost_work: float
    restart_overhead: float


def report(
    failures_per_day: float,
    *,
    interval: float | None = None,
    save_cost: float = 0.0,
    restart_cost: float = 0.0,
) -> GoodputReport:
    """Goodput at ``interval``, or at the model's optimal interval when it is None."""
    mtbf = mtbf_from_failures_per_day(failures_per_day)
    args_interval = interval
    young = daly = None
    if save_cost > 0:
        young, daly = young_interval(save_cost, mtbf), daly_interval(save_cost, mtbf)
    if interval is None:
        if daly is None:
            raise GoodputError(
                "without --interval a save cost is needed to recommend one: pass "
                "--save-cost (the measured blocking time of one save, e.g. 0.9s)"
            )
        interval = optimal_interval(save_cost, mtbf, restart_cost)
    period = interval + save_cost
    return GoodputReport(
        mtbf=mtbf,
        interval=interval,
        recommended=args_interval is None,
        young=young,
        daly=daly,
        goodput=expected_goodput(interval, mtbf, save_cost, restart_cost),
        save_overhead=save_cost / period,
        lost_work=period / 2.0 / mtbf,
        restart_overhead=restart_cost / mtbf,
    )


def format_duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


def _check(**values: float) -> None:
    for name, value in values.items():
        if value < 0 or (name == "mtbf" and value <= 0) or math.isnan(value):
            raise GoodputError(f"{name.replace('_', ' ')} must be positive, not {value}")
