"""`elastic-moe compare`'s report beyond the demo's losses: router measures, a study read from
`elastic-moe eval` summaries (the cluster path), the command's refusals, and the plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.tools.compare import report, stats
from elastic_moe_plugin.tools.compare.evals import study_from_evaluations
from elastic_moe_plugin.tools.compare.routers import pair_measures
from elastic_moe_plugin.tools.eval.summary import SUMMARY_SCHEMA

D1 = {0: 0.30, 1: 0.26, 2: 0.34}
DK = {0: 0.20, 1: 0.21, 2: 0.22}


def test_router_rows_estimate_each_measure_over_seeds_and_call_prioritisation():
    pairs = {s: {"D1": D1[s], "Dk": DK[s], "prioritisation": {"top1_reorder_share": 0.5}} for s in D1}
    data = {"plan": {"arms": ["static", "2-6"]}, "runs": {},
            "routers": {f"2-6/seed{s}": pair_measures(pair) for s, pair in pairs.items()}}  # fmt: skip
    rows = {row["quantity"]: row for row in report.comparisons(data)}
    gap = rows["router D1-Dk"]
    assert gap["differences"] == pytest.approx([0.10, 0.05, 0.12])
    assert gap["mean_difference"] == pytest.approx(0.09)
    # t_{0.975, 2} = 4.302652729911275; s = sqrt(((0.01)^2 + (0.04)^2 + (0.03)^2) / 2) = sqrt(0.0013)
    half = 4.302652729911275 * 0.0013**0.5 / 3**0.5
    assert gap["t_interval"] == pytest.approx([0.09 - half, 0.09 + half])
    assert gap["verdict"] == "D1 > Dk: reorders inside the top-k set"
    assert rows["router D1"]["mean_difference"] == pytest.approx(0.30)
    assert rows["router top1_reorder_share"]["verdict"] == "level (static vs elastic routers)"


def test_a_difference_is_called_on_the_better_or_worse_side_only_where_both_intervals_exclude_zero():
    lower = stats.compare("x", {0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.9, 1: 1.89, 2: 2.91})
    assert report.difference_verdict(lower) == "elastic lower (better)"
    assert report.difference_verdict(lower, higher_is_better=True) == "elastic lower (worse)"
    mixed = stats.compare("x", {0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.9, 1: 2.1, 2: 3.0})
    assert report.difference_verdict(mixed) == report.UNDETECTED


def _summary(average: float, copy: float, topk: int | None, suite: str = "avg9") -> dict:
    """An `elastic-moe eval` summary.json with the fields a study reads (native top-8)."""
    return {"schema": SUMMARY_SCHEMA, "run": "r", "suite": suite, "suite_average_label": "Avg(2)", "topk": topk,
            "topk_native": 8, "average": average, "average_complete": True,
            "scores": {"copy": copy, "ppl": 10.0 + copy},
            "tasks": [{"name": "copy", "higher_is_better": True},
                      {"name": "ppl", "higher_is_better": False}]}  # fmt: skip


def _write(root: Path, relative: str, summary: dict) -> None:
    folder = root / relative
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))


def _cluster_study(root: Path) -> None:
    """Recipes pretrain/top8 and pretrain/6-10, seeds 0-2, native top-8 and a k'=6 sweep point."""
    for seed, base in enumerate((50.0, 52.0, 51.0)):
        _write(root, f"pretrain/top8/seed{seed}/native", _summary(base, base - 1, None))
        _write(root, f"pretrain/top8/seed{seed}/topk6", _summary(base - 3, 0.0, 6))
        _write(root, f"pretrain/6-10/seed{seed}/native", _summary(base + 1 + seed / 10, base, None))
        _write(root, f"pretrain/6-10/seed{seed}/topk6", _summary(base - 1, 0.0, 6))


def test_a_cluster_study_is_read_from_eval_summaries_laid_out_by_arm_and_seed(tmp_path):
    _cluster_study(tmp_path)
    data = study_from_evaluations(tmp_path, None)
    assert data["plan"]["arms"] == ["pretrain/top8", "pretrain/6-10"]  # top<k> of the native top-8 is the baseline
    assert data["plan"]["seeds"] == [0, 1, 2]
    rows = {row["quantity"]: row for row in report.comparisons(data)}
    assert rows["Avg(2)@k=8"]["differences"] == pytest.approx([1.0, 1.1, 1.2])
    assert rows["Avg(2)@k=8"]["verdict"] == "elastic higher (better)"
    assert rows["Avg(2)@k'=6"]["differences"] == pytest.approx([2.0, 2.0, 2.0])
    assert rows["copy@k=8"]["differences"] == pytest.approx([1.0, 1.0, 1.0])
    assert rows["ppl@k=8"]["verdict"] == "elastic higher (worse)"  # perplexity: lower is better


def test_the_arms_can_be_chosen_and_a_bad_layout_is_named(tmp_path):
    _cluster_study(tmp_path)
    assert study_from_evaluations(tmp_path, ["pretrain/6-10", "pretrain/top8"])["plan"]["arms"][0] == "pretrain/6-10"
    with pytest.raises(ConfigError, match=r"no evaluations of pretrain/7-9 \(found: pretrain/6-10, pretrain/top8\)"):
        study_from_evaluations(tmp_path, ["pretrain/top8", "pretrain/7-9"])
    _write(tmp_path, "pretrain/6-10/seed0/again", _summary(1.0, 1.0, None))
    with pytest.raises(ConfigError, match="two evaluations of pretrain/6-10 seed 0 at top-8; keep one"):
        study_from_evaluations(tmp_path, None)
    _write(tmp_path / "flat", "run-a", _summary(1.0, 1.0, None))
    with pytest.raises(ConfigError, match=r"is not laid out as ROOT/<arm>/seed<N>/\.\.\./summary\.json"):
        study_from_evaluations(tmp_path / "flat", None)


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--report", "--from-eval", "."], "--report and --from-eval exclude each other"),
     (["--report"], "no results of elastic-moe compare there; run the study first (without --report)"),
     (["--from-eval", "nosuch"], "--from-eval nosuch: no such folder")],
)  # fmt: skip
def test_the_command_refuses_conflicting_or_missing_inputs(flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", *flags, "--out", str(tmp_path)]) != 0
    assert message in capsys.readouterr().err


def test_the_command_reports_a_cluster_study_with_its_plots(tmp_path, capsys):
    _cluster_study(tmp_path / "evals")
    main(["compare", "--from-eval", str(tmp_path / "evals"), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "3 seeds x 2 arms (pretrain/top8, pretrain/6-10)" in printed
    assert "Avg(2)@k=8" in printed and "elastic higher (better)" in printed
    for name in ("paired_differences.png", "topk_sweep.png"):
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["source"] == "eval" and len(saved["comparisons"]) == len(report.comparisons(saved))
