"""The `elastic-moe` CLI: the figures the issue pins, JSON output, errors and the plot."""

import json
import subprocess
import sys

import pytest

from elastic_moe_plugin.cli import main


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_schedule_json_reports_the_paper_figures(capsys):
    report = _json(capsys, ["schedule", "6-10", "--center", "8", "--json"])
    assert [round(q, 3) for q in report["pmf"]] == [0.120, 0.234, 0.292, 0.234, 0.120]
    assert f"{report['mean']:.3f}" == "8.000"
    assert report["budgets"] == [6, 7, 8, 9, 10]
    assert report["mean_abs_deviation"] == pytest.approx(0.9481, abs=5e-5)
    assert report["off_center_share"] == pytest.approx(1 - 0.2921, abs=5e-5)
    assert sum(report["survival"]) == pytest.approx(report["mean"])
    assert report["survival"][:6] == [1.0] * 6 and report["survival"][10:] == [0.0, 0.0]
    assert [round(q, 3) for q in _json(capsys, ["schedule", "7-9", "--json"])["pmf"]] == [0.308, 0.384, 0.308]
    assert [round(q, 3) for q in _json(capsys, ["schedule", "5-11", "--json"])["pmf"]] == [
        0.037, 0.111, 0.217, 0.271, 0.217, 0.111, 0.037,
    ]


def test_schedule_table(capsys):
    assert main(["schedule", "7-9", "--center", "8", "--sigma", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "schedule 7-9 around k=8 (sigma=1.5)" in out
    assert "E[kappa]          = 8.0000" in out
    assert "E|kappa - k|      = 0.6156" in out
    assert "       9   0.3078" in out  # the pmf row for budget 9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["schedule", "11-5"], "low=11 > high=5"),
        (["schedule", "1-4", "--center", "2"], "mean 2.2729, not 2"),
        # echoed as typed, in the command's own spelling (it used to print "sigma=0.0")
        (["schedule", "6-10", "--sigma", "0"], "--sigma 0 is invalid"),
        (["schedule", "6-10", "--experts", "9"], "only 9 experts"),
    ],
)
def test_schedule_errors_exit_2_with_message(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_schedule_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "schedule.png"
    report = _json(capsys, ["schedule", "6-10", "--json", "--plot", str(out)])
    assert report["plot"] == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_console_script_is_installed():
    result = subprocess.run(
        [sys.executable, "-m", "elastic_moe_plugin.cli", "schedule", "static", "--center", "4", "--json"],
        capture_output=True, text=True, check=True,
    )
    assert json.loads(result.stdout)["pmf"] == [1.0]
