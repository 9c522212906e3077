"""``streamcache goodput``: the checkpoint interval and expected goodput of a job, printed
(and drawn with ``--plot``) from the model in streamcache/goodput.py."""

from __future__ import annotations

import argparse

from ..goodput import (
    DURATION_RE,
    GoodputError,
    expected_goodput,
    format_duration,
    mtbf_from_failures_per_day,
    parse_duration,
    report,
)


def duration_argument(text: str) -> float:
    """:func:`parse_duration` for ``argparse``, with a unit required: ``--interval 2`` could
    mean 2 s or 2 h, so a bare number other than 0 is a usage error that says how to write
    one (as is anything that is no duration)."""
    try:
        seconds = parse_duration(text)
    except GoodputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    match = DURATION_RE.match(text)
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
        from .plots import require_matplotlib

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
        from .plots import plot_goodput

        plot_goodput(result, args.save_cost, args.restart_cost, args.plot)
        print(f"plot: {args.plot}")
    return 0
