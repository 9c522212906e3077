"""Checkpoint interval and expected goodput: pure functions and ``streamcache goodput``.

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

import argparse
import math
import re
from dataclasses import dataclass

from .errors import StreamcacheError

SECONDS_PER_DAY = 86400.0
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h|d)?\s*$")


class GoodputError(StreamcacheError, ValueError):
    """Inputs to the goodput model are impossible (negative, zero failure rate, ...)."""


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1.5d"``."""
    match = _DURATION_RE.match(text)
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


def duration_argument(text: str) -> float:
    """:func:`parse_duration` for ``argparse``, with a unit required: ``--interval 2`` could
    mean 2 s or 2 h, so a bare number other than 0 is a usage error that says how to write
    one (as is anything that is no duration)."""
    try:
        seconds = parse_duration(text)
    except GoodputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    match = _DURATION_RE.match(text)
    if match is not None and match.group(2) is None and seconds != 0:
        number = match.group(1)
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit: write {number}s, {number}m or {number}h")
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--failures-per-day", type=float, required=True,
                        help="failures of the whole job per day (e.g. 8.6)")
    parser.add_argument("--interval", type=duration_argument,
                        help="checkpoint interval with its unit (e.g. 30m, 2h, 90s); omit it "
                             "for a recommendation (with --save-cost) or a table")
    parser.add_argument("--save-cost", type=duration_argument, default=0.0,
                        help="time one save blocks training (measured; e.g. 0.9s; default 0)")
    parser.add_argument("--restart-cost", type=duration_argument, default=0.0,
                        help="time from a failure to training again (e.g. 5m; default 0)")
    parser.add_argument("--plot", metavar="FILE",
                        help="draw goodput against the checkpoint interval into FILE (PNG, "
                             "SVG or PDF; needs matplotlib: pip install matplotlib)")


def assumptions(save_cost: float, restart_cost: float) -> str | None:
    """The line that says which costs the report takes as zero, or None when none is."""
    free = [name for name, cost in (("saves", save_cost), ("restarts", restart_cost))
            if cost == 0]
    if not free:
        return None
    flags = " and ".join(f"--{name[:-1]}-cost" for name in free)
    return (f"note: assuming {' and '.join(free)} cost nothing; pass the measured {flags} "
            f"to count {'them' if len(free) > 1 else 'it'}")


#: Intervals shown when there is neither an interval nor a save cost to recommend one from.
TABLE_INTERVALS = (5 * 60.0, 15 * 60.0, 30 * 60.0, 3600.0, 2 * 3600.0, 4 * 3600.0)


def format_table(failures_per_day: float, restart_cost: float) -> list[str]:
    """Expected goodput at :data:`TABLE_INTERVALS` (saves taken as free), one line each."""
    mtbf = mtbf_from_failures_per_day(failures_per_day)
    lines = [f"mean time between failures: {format_duration(mtbf)}",
             "interval  expected goodput (saves taken as free)"]
    for interval in TABLE_INTERVALS:
        goodput = expected_goodput(interval, mtbf, 0.0, restart_cost)
        lines.append(f"{format_duration(interval):>8}  {goodput:.1%}")
    lines.append("note: with free saves the shortest interval always wins; pass the measured "
                 "--save-cost (the blocking time of one save, e.g. 0.9s) for a recommended "
                 "interval, or --interval to see one")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.plot:
        from .cli.plots import require_matplotlib

        require_matplotlib()
    if args.interval is None and args.save_cost == 0:
        if args.plot:
            raise GoodputError("--plot marks the recommended interval, which needs the "
                               "measured --save-cost (e.g. 0.9s); or pass --interval")
        print("\n".join(format_table(args.failures_per_day, args.restart_cost)))
        return 0
    result = report(args.failures_per_day, interval=args.interval, save_cost=args.save_cost,
                    restart_cost=args.restart_cost)
    print(f"mean time between failures: {format_duration(result.mtbf)}")
    if result.young is not None and result.daly is not None:
        print(f"Young's interval: {format_duration(result.young)}, Daly's: "
              f"{format_duration(result.daly)}")
    label = "recommended interval" if result.recommended else "interval"
    print(f"{label}: {format_duration(result.interval)}")
    print(f"expected goodput: {result.goodput:.1%}  (lost to saves {result.save_overhead:.1%}, "
          f"to recomputation {result.lost_work:.1%}, to restarts {result.restart_overhead:.1%})")
    note = assumptions(args.save_cost, args.restart_cost)
    if note:
        print(note)
    if args.plot:
        from .cli.plots import plot_goodput

        plot_goodput(result, args.save_cost, args.restart_cost, args.plot)
        print(f"plot: {args.plot}")
    return 0
