"""`elastic-moe compare`: the study's orchestration (pairing, resume, the results file) with a
closed-form stand-in for training, and one real `--quick` study of the demo model end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.tools.compare import report, stats
from elastic_moe_plugin.tools.compare.study import StudyPlan, run_study
from elastic_moe_plugin.tools.demo.settings import DemoSettings

SETTINGS = DemoSettings(steps=3)


def _closed_form(settings: DemoSettings, folder: Path) -> dict:
    """A run's measurements as a closed form of its seed and arm: elastic 2-6 is 0.01 lower on every seed."""
    loss = 2.0 + 0.1 * settings.seed - (0.01 if settings.schedule == "2-6" else 0.0)
    return {"heldout_loss": loss, "topk_sweep": {"3": loss + 0.2, "4": loss}, "task_losses": {"copy": loss / 2},
            "imbalance": 1.5, "final_train_loss": loss, "history": {}, "topk": 4}  # fmt: skip


def test_a_study_pairs_by_seed_and_resumes_where_it_stopped(tmp_path):
    plan = StudyPlan(("static", "2-6"), (0, 1, 2), SETTINGS)
    trained: list[tuple[int, str]] = []

    def train(settings, folder):
        trained.append((settings.seed, settings.schedule))
        if len(trained) == 4:
            raise KeyboardInterrupt  # stopped during seed 1's elastic run
        return _closed_form(settings, folder)

    with pytest.raises(KeyboardInterrupt):
        run_study(plan, tmp_path, log=lambda line: None, train=train)
    assert sorted(json.loads((tmp_path / "results.json").read_text())["runs"]) == [
        "2-6/seed0", "static/seed0", "static/seed1"]  # fmt: skip
    lines: list[str] = []
    data = run_study(plan, tmp_path, log=lines.append, train=lambda s, f: trained.append((s.seed, s.schedule)) or
                     _closed_form(s, f))  # fmt: skip
    assert "3 of 6 runs done" in lines[0]
    assert trained[4:] == [(1, "2-6"), (2, "static"), (2, "2-6")]
    rows = {row["quantity"]: row for row in report.comparisons(data)}
    assert rows["heldout_loss@k=4"]["differences"] == pytest.approx([-0.01] * 3)
    assert rows["heldout_loss@k=4"]["verdict"] == "elastic lower (better)"
    assert rows["heldout_loss@k'=3"]["differences"] == pytest.approx([-0.01] * 3)
    assert rows["imbalance(max/mean)"]["differences"] == [0.0, 0.0, 0.0]
    assert rows["imbalance(max/mean)"]["verdict"] == "no difference detectable (an interval contains 0)"


def test_another_plan_on_the_same_results_is_refused(tmp_path):
    run_study(StudyPlan(("static", "2-6"), (0, 1), SETTINGS), tmp_path, log=lambda line: None, train=_closed_form)
    with pytest.raises(ConfigError, match=r"holds another study \(its seeds differ\)"):
        run_study(
            StudyPlan(("static", "2-6"), (0, 1, 2), SETTINGS), tmp_path, log=lambda line: None, train=_closed_form
        )


@pytest.mark.parametrize(
    ("arms", "message"),
    [(("2-6", "static"), "expected 'static' first"), (("static",), "nothing to compare"),
     (("static", "2-6", "2-6"), "distinct schedules")],
)  # fmt: skip
def test_plans_are_checked(arms, message):
    with pytest.raises(ConfigError, match=message):
        StudyPlan(arms, (0, 1), SETTINGS)


@pytest.mark.slow
def test_a_quick_study_of_the_demo_model(tmp_path):
    """What CI runs: 2 seeds of static and 2-6 on the demo's quick settings, cut to 12 steps, the
    router measures and the plots; the printed comparisons are the statistics of the runs' own
    numbers, paired by seed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "elastic_moe_plugin.cli", "compare", "--quick", "--steps", "12",
               "--out", str(tmp_path), "--json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert sorted(data["runs"]) == ["2-6/seed0", "2-6/seed1", "static/seed0", "static/seed1"]
    printed = {row["quantity"]: row for row in json.loads(done.stdout[done.stdout.index("[") :])}
    heldout = printed["heldout_loss@k=4"]
    expected = [data["runs"][f"2-6/seed{s}"]["heldout_loss"] - data["runs"][f"static/seed{s}"]["heldout_loss"]
                for s in (0, 1)]  # fmt: skip
    assert heldout["differences"] == pytest.approx(expected, abs=1e-15)
    assert heldout["t_interval"] == pytest.approx(list(vars(stats.t_interval(expected)).values()))
    assert {f"task_loss[{task}]" for task in ("copy", "reverse", "addition")} <= set(printed)
    assert all((tmp_path / f"seed{s}" / f"{arm}.pt").exists() for s in (0, 1) for arm in ("static", "2-6"))
    # each seed's routers compared by diagnose's own pass; D1 and Dk are shares in [0, 1]
    assert sorted(data["routers"]) == ["2-6/seed0", "2-6/seed1"]
    for measures in data["routers"].values():
        assert 0.0 <= measures["Dk"] <= 1.0 and 0.0 <= measures["D1"] <= 1.0
        assert measures["D1-Dk"] == pytest.approx(measures["D1"] - measures["Dk"], abs=1e-15)
    assert printed["router D1"]["differences"] == [data["routers"][f"2-6/seed{s}"]["D1"] for s in (0, 1)]
    assert {path.name for path in tmp_path.glob("*.png")} == {"paired_differences.png", "topk_sweep.png",
                                                             "training_curves.png"}  # fmt: skip
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert "resuming" in again.stdout + again.stderr and "4 of 4 runs done" in again.stdout + again.stderr
