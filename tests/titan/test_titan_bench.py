"""`elastic-moe bench --only e2e --quick --launchers torchtitan`: torchtitan's trainer (``torchrun -m
torchtitan.train``, the door through ``--override.imports``) on its DeepSeek-V3 debug model, one
interleaved run of 7 steps whose blocks of 2 switch the door between ``static`` and ``1-5`` (~25 CPU-s).

Nothing about time is asserted (speed is measured, not tested): only that both rows are there with
every column well-formed (a ratio > 0 from the block pairs, the one process's peak RSS, the syncs
counted as an int, a mean κ for each mode), the elastic blocks' mean κ inside 1-5, and every static
step at exactly top-3 (also after an elastic block: the door switched back to ``static`` mid-run).
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from elastic_moe_plugin.tools.bench import schema

pytestmark = [pytest.mark.titan, pytest.mark.slow]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """(the e2e section, the interleaved run's console output)"""
    from elastic_moe_plugin.tools import bench
    from elastic_moe_plugin.tools.bench.e2e import E2EOptions

    work = tmp_path_factory.mktemp("bench_titan")
    options = bench.BenchOptions(e2e=E2EOptions(work=work, launchers=("torchtitan",)))
    (section,) = bench.run_suite(True, 1, ["e2e"], options)
    return section, (work / "torchtitan" / "interleaved_0" / "output.log").read_text(errors="replace")


def test_both_rows_have_every_figure(bench_run):
    from elastic_moe_plugin.tools import bench

    report = json.loads(json.dumps(bench.to_json([bench_run[0]], True, 1)))  # what --json prints
    schema.validate(report)
    assert report["environment"]["torchtitan"] == "0.3.0"
    rows = {row["variant"]: row for row in report["rows"] if row["scenario"] == "torchtitan"}
    assert list(rows) == ["static", "1-5"]
    static, elastic = rows["static"], rows["1-5"]
    params = static["params"]
    assert params == elastic["params"] and params["label"] == "torchtitan"
    assert (params["steps"], params["warmup"], params["rounds"], params["interleave_block"]) == (7, 2, 1, 2)
    assert (static["baseline"], elastic["baseline"]) == (None, "static")
    ratios = elastic["ratios"]
    assert math.isfinite(ratios["steps_per_second_ratio"]) and ratios["steps_per_second_ratio"] > 0
    pairs = elastic["metrics"]["pair_ratios"]
    assert len(pairs) >= 1 and ratios["steps_per_second_ratio"] == statistics.median(pairs)
    for row in (static, elastic):
        metrics = row["metrics"]
        assert math.isfinite(metrics["median_steps_per_second"]) and metrics["median_steps_per_second"] > 0
        assert metrics["peak_rss_bytes"] > 100 * 2**20  # a process that imported torch and trained
        # counted, not guessed: torchtitan reads its loss and gradient norm on the host at every step
        assert isinstance(metrics["syncs_per_step"], int) and metrics["syncs_per_step"] > 0
    assert static["metrics"]["peak_rss_bytes"] == elastic["metrics"]["peak_rss_bytes"]  # the one process's
    assert 1 <= elastic["metrics"]["mean_kappa"] <= 5  # realised experts per token of a 1-5 schedule
    assert static["metrics"]["mean_kappa"] == 3.0  # the door logs its static steps too: every token's top-3


def test_static_steps_log_exactly_top_3_and_elastic_ones_draw_within_1_5(bench_run):
    """Blocks of 2 after a 2-step warm-up: steps 1-2 static, 3-4 elastic, 5-6 static, 7 elastic. A
    static block after an elastic one logs top-3 too, not the elastic block's last record."""
    from elastic_moe_plugin.tools.bench.e2e_titan import logged_steps

    times, kappas = logged_steps(bench_run[1])
    assert sorted(times) == sorted(kappas) == list(range(1, 8))
    assert [kappas[step] for step in (1, 2, 5, 6)] == [3.0] * 4
    assert all(1 <= kappas[step] <= 5 for step in (3, 4, 7)) and len({kappas[3], kappas[4], kappas[7]}) > 1
    (result,) = bench_run[0].results
    assert result.summary()["static"]["mean_kappa"] == 3.0


def test_the_table_has_both_rows(bench_run):
    from elastic_moe_plugin.tools import bench
    from elastic_moe_plugin.tools.bench import e2e_report

    table = bench.format_results([bench_run[0]]).splitlines()
    print("\n".join(table))
    for column in e2e_report.COLUMNS:
        assert column in table[0]
    lines = [line.split() for line in table if line.startswith("torchtitan ")]
    assert [line[1] for line in lines] == ["static", "1-5"]
    assert [len(line) for line in lines] == [7, 9]  # the elastic row adds x static and its min-max
