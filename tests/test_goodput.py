"""Goodput model: the textbook example, Young/Daly, properties, and the CLI."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from streamcache.cli.main import main as cli_main
from streamcache.goodput import (
    GoodputError,
    daly_interval,
    expected_goodput,
    mtbf_from_failures_per_day,
    parse_duration,
    report,
    young_interval,
)

MTBF_8_6 = mtbf_from_failures_per_day(8.6)


def test_textbook_example_64_and_91_percent() -> None:
    assert expected_goodput(parse_duration("2h"), MTBF_8_6) == pytest.approx(0.642, abs=0.001)
    assert expected_goodput(parse_duration("30m"), MTBF_8_6) == pytest.approx(0.910, abs=0.001)


def test_young_and_daly() -> None:
    mtbf = 10_000.0
    assert young_interval(2.0, mtbf) == pytest.approx(200.0)
    # Daly's correction is small for small save costs and stays below the MTBF
    assert daly_interval(2.0, mtbf) == pytest.approx(200.0 * (1 + 0.01 / 3 + 0.0001 / 9) - 2)
    assert daly_interval(3 * mtbf, mtbf) == mtbf


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "1.5m", "2h", "1d", ".5s")] == [
        90, 90, 90, 7200, 86400, 0.5]
    with pytest.raises(GoodputError, match="not a duration"):
        parse_duration("2 hours")


@given(
    failures=st.floats(0.1, 100),
    save_cost=st.floats(0.01, 600),
    restart_cost=st.floats(0, 3000),
)
def test_recommended_interval_is_near_the_best(failures: float, save_cost: float,
                                               restart_cost: float) -> None:
    mtbf = mtbf_from_failures_per_day(failures)
    assume(restart_cost + 2 * save_cost < mtbf)  # otherwise nothing is worth recommending
    best = report(failures, save_cost=save_cost, restart_cost=restart_cost)
    assert 0.0 <= best.goodput <= 1.0
    # no interval on a wide grid does better than the recommended one
    grid = [best.interval * 2 ** (k / 8) for k in range(-24, 25)]
    best_on_grid = max(expected_goodput(t, mtbf, save_cost, restart_cost) for t in grid)
    assert best.goodput >= best_on_grid - 1e-12
    # and Young's and Daly's intervals are nearly as good while costs are small
    if save_cost + restart_cost < 0.01 * mtbf:
        assert best.young is not None and best.daly is not None
        for interval in (best.young, best.daly):
            assert expected_goodput(interval, mtbf, save_cost, restart_cost) == pytest.approx(
                best.goodput, abs=2e-3)


@given(interval=st.floats(1, 1e5), failures=st.floats(0.01, 50))
def test_more_failures_never_help(interval: float, failures: float) -> None:
    fewer = expected_goodput(interval, mtbf_from_failures_per_day(failures))
    more = expected_goodput(interval, mtbf_from_failures_per_day(failures * 2))
    assert more <= fewer
    assert math.isfinite(fewer)


def test_invalid_inputs() -> None:
    with pytest.raises(GoodputError, match="positive"):
        mtbf_from_failures_per_day(0)
    with pytest.raises(GoodputError, match="save cost is needed"):
        report(8.6)
    with pytest.raises(GoodputError, match="no interval makes progress"):
        report(100, save_cost=1, restart_cost=3600)


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["goodput", "--failures-per-day", "8.6", "--interval", "2h"]) == 0
    assert "expected goodput: 64.2%" in capsys.readouterr().out
    assert cli_main(["goodput", "--failures-per-day", "8.6", "--interval", "30m"]) == 0
    assert "expected goodput: 91.0%" in capsys.readouterr().out
    assert cli_main(["goodput", "--failures-per-day", "8.6", "--save-cost", "0.9s",
                     "--restart-cost", "5m"]) == 0
    out = capsys.readouterr().out
    assert "recommended interval: 2.2 min" in out and "Young's interval: 2.2 min" in out


def test_cli_without_interval_or_save_cost_prints_a_table(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["goodput", "--failures-per-day", "8.6"]) == 0  # was: exit 1
    out = capsys.readouterr().out
    assert " 2.00 h  64.2%" in out and "30.0 min  91.0%" in out and "--save-cost" in out


@pytest.mark.parametrize("flag", ["--interval", "--save-cost", "--restart-cost"])
def test_cli_refuses_a_duration_without_unit(flag: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # --interval 2 was taken as 2 seconds
        cli_main(["goodput", "--failures-per-day", "8.6", flag, "2"])
    assert exited.value.code == 2
    assert "'2' has no unit: write 2s, 2m or 2h" in capsys.readouterr().err
    assert cli_main(["goodput", "--failures-per-day", "8.6", "--interval", "2h",
                     flag, "0"] if flag != "--interval" else
                    ["goodput", "--failures-per-day", "8.6", flag, "90s"]) == 0


def test_cli_says_when_it_assumes_free_saves_and_restarts(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["goodput", "--failures-per-day", "8.6", "--interval", "2h"]) == 0
    out = capsys.readouterr().out
    assert "assuming saves and restarts cost nothing" in out and "--save-cost" in out
    assert cli_main(["goodput", "--failures-per-day", "8.6", "--interval", "2h",
                     "--save-cost", "1s", "--restart-cost", "5m"]) == 0
    assert "assuming" not in capsys.readouterr().out


def test_cli_plot_draws_the_goodput_curve(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "goodput.png"
    assert cli_main(["goodput", "--failures-per-day", "8.6", "--save-cost", "0.9s",
                     "--restart-cost", "5m", "--plot", str(path)]) == 0
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 10_000
    assert str(path) in capsys.readouterr().out


def test_cli_plot_without_matplotlib_is_one_clear_line(
        tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert cli_main(["goodput", "--failures-per-day", "8.6", "--interval", "2h", "--plot",
                     str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    # the extra is named only for a checkout: no index serves streamcache
    assert len(err) == 1 and "pip install matplotlib" in err[0]
    assert "pip install 'streamcache[plot]'" not in err[0]
    assert not (tmp_path / "g.png").exists()
