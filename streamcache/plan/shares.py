"""A mixture's weights as integer shares ``a_s`` (``sum a_s = D``, the period of its quota
sequence, plan/quota.py). Pure, no I/O.

Weights that have a small common denominator are exact (a float is read as the simplest
fraction close to it: 0.7 is 7/10); others are rounded to shares of :data:`MAX_PERIOD`, an error
below ``1 / MAX_PERIOD`` per source (docs/mixtures.md).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, SupportsFloat

from ._util import PlanError

#: The longest period of the quota sequence; weights whose exact ratio needs a longer one are
#: rounded to shares of this period (an error below 1/MAX_PERIOD per source).
MAX_PERIOD = 1 << 16


def shares_of(weights: Sequence[float | int | Fraction | numbers.Real]) -> tuple[int, ...]:
    """Integer shares with the weights' ratios (reduced), their sum at most :data:`MAX_PERIOD`.

    A float is read as the simplest fraction within 1e-9 of it (0.7 is 7/10), so common
    weights are exact; otherwise shares of ``MAX_PERIOD`` by largest remainder. The cost grows
    with the number of weights, not with their product: exact integers where the weights
    have a small common denominator, else float ratios, computed exactly only for the few
    shares that a float could decide wrongly (the result is the exact one either way).

    Raises:
        PlanError: no weights, a weight that is not a finite number > 0, or a weight below
            ``1 / MAX_PERIOD`` of the total (no share can represent it).
    """
    if not weights:
        raise PlanError("a mixture needs at least one source")
    fractions = [_fraction(weight) for weight in weights]
    ratios = _float_ratios(fractions)
    exact = _Exact(fractions)
    for s, (weight, ratio) in enumerate(zip(weights, ratios, strict=True)):
        if ratio * MAX_PERIOD < 1 + _CLOSE and exact.numerators[s] * MAX_PERIOD < exact.total:
            raise PlanError(
                f"source {s}'s weight {weight!r} is {ratio:.3g} of the total weight; a mixture "
                f"represents shares down to 1/{MAX_PERIOD} of it (one sample in "
                f"{MAX_PERIOD:,}): give that source a weight of at least "
                f"{_least_weight(fractions):.3g}, or leave it out")
    return _small_period_shares(ratios, exact) or _rounded_shares(ratios, exact)


_CLOSE = 1e-9  # floats within this of a boundary are decided exactly (their error is < 1e-10)


def _fraction(weight: Any) -> Fraction:
    """A weight as an exact fraction (a float as the simplest fraction within 1e-9 of it)."""
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or \
            not 0 < _float_or_inf(weight) < math.inf:  # (NaN fails it too)
        raise PlanError(f"a weight must be a finite number > 0 that a float can hold, got "
                        f"{weight!r}")
    if isinstance(weight, numbers.Integral):
        return Fraction(int(weight))
    if isinstance(weight, Fraction):
        return weight
    return _float_fraction(float(weight))


@functools.lru_cache(maxsize=4096)
def _float_fraction(weight: float) -> Fraction:
    """(cached: a mixture of many sources repeats its weights)"""
    exact = Fraction(weight)
    simple = exact.limit_denominator(10**9)
    # a weight far below 1 has no simple fraction that close: keep it as it is
    return simple if simple and abs(simple - exact) <= exact / 10**9 else exact


class _Exact:
    """The weights over their least common denominator (numerators, and their sum), made
    when first asked for: with many weights of unrelated denominators these are integers of
    thousands of digits, needed only where a float cannot decide."""

    def __init__(self, fractions: list[Fraction]) -> None:
        self.fractions = fractions

    @functools.cached_property
    def numerators(self) -> list[int]:
        common = 1
        for fraction in self.fractions:  # big % small and big * small: linear in the digits
            common = common // math.gcd(common, fraction.denominator) * fraction.denominator
        return [f.numerator * (common // f.denominator) for f in self.fractions]

    @functools.cached_property
    def total(self) -> int:
        return sum(self.numerators)


def _float_or_inf(value: SupportsFloat) -> float:
    """``float(value)``, or inf where the value is past the largest float (an int or a
    Fraction can be: ``float`` raises OverflowError for them)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _float_ratios(fractions: list[Fraction]) -> list[float]:
    """Each weight's part of the total weight, as floats (every weight a float can hold).

    The weights are scaled by the power of two that brings the largest into [0.5, 1) before
    they are summed: exact, so each ratio is the one of the weights as they are, to the last
    bit, and weights whose sum passes the largest float (two of 1e308) have ratios too. (Only
    a weight below 2**-1022 of the largest loses bits, and no share can represent it.)
    """
    values = [float(f) for f in fractions]
    _, exponent = math.frexp(max(values))
    scaled = [math.ldexp(value, -exponent) for value in values]
    total = math.fsum(scaled)
    return [value / total for value in scaled]


def _least_weight(fractions: list[Fraction]) -> float:
    """The least weight a source can have beside these (a share of one in
    :data:`MAX_PERIOD`), for a message: inf where it is past the largest float."""
    return _float_or_inf(sum(fractions) / (MAX_PERIOD - 1))


def _small_period_shares(ratios: list[float], exact: _Exact) -> tuple[int, ...] | None:
    """The exact shares when the ratios repeat within :data:`MAX_PERIOD` positions, else
    None: candidate shares from the float ratios, checked in exact integers."""
    period = 1
    candidates = []
    for ratio in ratios:
        candidates.append(Fraction(ratio).limit_denominator(MAX_PERIOD))
        period = period // math.gcd(period, candidates[-1].denominator) * \
            candidates[-1].denominator
        if period > MAX_PERIOD:
            return None
    shares = [int(c * period) for c in candidates]
    if sum(shares) != period or any(
            a * period != share * exact.total
            for a, share in zip(exact.numerators, shares, strict=True)):
        return None
    divisor = math.gcd(*shares)
    return tuple(share // divisor for share in shares)


def _rounded_shares(ratios: list[float], exact: _Exact) -> tuple[int, ...]:
    """Shares of :data:`MAX_PERIOD` by largest remainder (ties to the lower index), reduced:
    floors and remainders from the floats, made exact where a float is within
    :data:`_CLOSE` of a boundary (an integer, or the remainder where the cut falls)."""
    floors: list[int] = []
    remainders: list[float | Fraction] = []
    for ratio in ratios:
        scaled = ratio * MAX_PERIOD
        floors.append(math.floor(scaled))
        remainders.append(scaled - floors[-1])

    def make_exact(s: int) -> None:
        floor, rest = divmod(exact.numerators[s] * MAX_PERIOD, exact.total)
        floors[s], remainders[s] = floor, Fraction(rest, exact.total)

    for s, rest in enumerate(remainders):
        if rest < _CLOSE or rest > 1 - _CLOSE:
            make_exact(s)
    by_remainder = sorted(range(len(ratios)), key=lambda s: (-remainders[s], s))
    extra = MAX_PERIOD - sum(floors)
    if 0 < extra < len(ratios):
        cut = float(remainders[by_remainder[extra]])
        near = [s for s in range(len(ratios)) if abs(float(remainders[s]) - cut) < _CLOSE]
        if len({exact.fractions[s] for s in near}) > 1:  # equal weights tie exactly already
            for s in near:
                make_exact(s)
            by_remainder = sorted(range(len(ratios)), key=lambda s: (-remainders[s], s))
    shares = floors
    for s in by_remainder[:extra]:
        shares[s] += 1
    divisor = math.gcd(*shares)
    return tuple(share // divisor for share in shares)



__all__ = ["MAX_PERIOD", "shares_of"]
