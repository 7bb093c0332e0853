"""`elastic-moe bench --only e2e --quick`: one row per launcher (swift sft on OLMoE, megatron sft,
Megatron-LM's trainer; the DeepSeek-V3 row's command is checked without a run), each column filled,
from real runs of the three trainers on tiny models.

Nothing about time is asserted (the --quick runs overlap; speed is measured, not tested): only that
every launcher ran static and elastic (swift sft in two runs, the Megatron launchers interleaved in
one), that the figures are there and well-formed, and the exact ones: swift sft's static run logs a
mean κ of exactly 8, on either model (the interleaved runs log κ only in their elastic blocks), an elastic 6-10 run's
lies in [6, 10], a run's peak RSS is that of a process that imported torch, and a step's sync count
is a positive count (every trainer reads its loss on the host).
"""

import importlib.util
import json
import math
import shutil
import statistics

import pytest

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.tools.bench import schema

LABELS = {"swift_sft": "swift sft", "swift_sft_deepseek_v3": "swift sft DSv3", "megatron_sft": "megatron sft",
          "megatron_lm": "Megatron-LM", "torchtitan": "torchtitan"}
#: the launchers the quick run here runs: swift sft on DeepSeek-V3 is the OLMoE row's launcher on another
#: model, whose command is checked below without a run; torchtitan's row runs in the titan lane
#: (tests/titan/test_titan_bench.py), where torchtitan is importable
RUN = ("swift_sft", "megatron_sft", "megatron_lm")
HIDDEN = 64  # the swift sft rows' --hidden
INTERLEAVED = {"megatron_sft", "megatron_lm"}  # one run per round, static and elastic blocks of 2 steps
_MISSING = [name for name in ("swift", "mcore_bridge", "megatron.training", "transformers")
            if importlib.util.find_spec(name.split(".")[0]) is None or importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.slow, pytest.mark.swift, pytest.mark.megatron]
if _MISSING:
    pytestmark.append(pytest.mark.skip(reason=f"the e2e bench runs every launcher; missing {', '.join(_MISSING)}"))


def _megatron_core_016() -> bool:
    import importlib.metadata

    from packaging.version import Version

    return Version(importlib.metadata.version("megatron-core")) < Version("0.17")


@pytest.fixture(scope="module")
def sections(tmp_path_factory):
    """The bench's e2e section (its table, its rows, its results), run once with --quick."""
    if _megatron_core_016():
        pytest.skip("megatron-core 0.16.1 pass: the 0.16.1 wheel ships no megatron.training (Megatron-LM's row); "
                    "the bench runs on 0.19.2")
    from elastic_moe_plugin.tools import bench
    from elastic_moe_plugin.tools.bench.e2e import E2EOptions

    work = tmp_path_factory.mktemp("bench_e2e")
    # H=64 (--hidden 64): the swift sft rows' tiny OLMoE at a quarter of the bench's width, whose 4 steps
    # of 64 experts on one CPU process would otherwise cost more than the start-up; the figures are the same
    return bench.run_suite(True, 1, ["e2e"], bench.BenchOptions(e2e=E2EOptions(work=work, launchers=RUN, hidden=HIDDEN)))


@pytest.fixture(scope="module")
def report(sections):
    from elastic_moe_plugin.tools import bench

    return json.loads(json.dumps(bench.to_json(sections, True, 1)))  # what --json prints


def _launcher_rows(report):
    """{launcher: {schedule: row}}"""
    rows = {}
    for row in report["rows"]:
        rows.setdefault(row["scenario"], {})[row["variant"]] = row
    return rows


def test_every_launcher_has_a_row_with_every_figure(report):
    schema.validate(report)
    assert report["modes"] == ["e2e"] and report["environment"]["ms_swift"]
    launchers = _launcher_rows(report)
    assert list(launchers) == list(RUN)
    for key, rows in launchers.items():
        assert list(rows) == ["static", "6-10"]
        static, elastic = rows["static"], rows["6-10"]
        params = static["params"]
        assert params == elastic["params"] and params["label"] == LABELS[key] and params["launcher"] == key
        assert (params["steps"], params["warmup"], params["rounds"]) == ((7, 2, 1) if key in INTERLEAVED else (4, 2, 1))
        assert (static["baseline"], elastic["baseline"]) == (None, "static")
        ratios = elastic["ratios"]
        assert math.isfinite(ratios["steps_per_second_ratio"]) and ratios["steps_per_second_ratio"] > 0
        assert ratios["steps_per_second_ratio_min"] <= ratios["steps_per_second_ratio"] <= ratios["steps_per_second_ratio_max"]
        for row in (static, elastic):
            metrics = row["metrics"]
            assert len(metrics["round_steps_per_second"]) == 1  # one round
            assert math.isfinite(metrics["median_steps_per_second"]) and metrics["median_steps_per_second"] > 0
            assert metrics["peak_rss_bytes"] > 100 * 2**20  # a process that imported torch and trained
            assert isinstance(metrics["syncs_per_step"], int) and metrics["syncs_per_step"] > 0, (key, row["variant"])
        # static keeps every token's top-8: ms-swift logs exactly 8; the interleaved static blocks log nothing
        assert static["metrics"]["mean_kappa"] == (None if key in INTERLEAVED else 8.0)
        if key in INTERLEAVED:
            pairs = elastic["metrics"]["pair_ratios"]
            assert len(pairs) >= 1 and ratios["steps_per_second_ratio"] == statistics.median(pairs)
            assert static["metrics"]["peak_rss_bytes"] == elastic["metrics"]["peak_rss_bytes"]  # the one process's
        assert 6 <= elastic["metrics"]["mean_kappa"] <= 10  # realised experts per token of a 6-10 schedule


def test_the_table_has_every_row_and_column(sections):
    from elastic_moe_plugin.tools import bench
    from elastic_moe_plugin.tools.bench import e2e_report

    table = bench.format_results(sections).splitlines()
    print("\n".join(table))
    header = table[0]
    for column in e2e_report.COLUMNS:
        assert column in header
    for label in (LABELS[key] for key in RUN):
        # a row's label is followed by its schedule
        lines = [line for line in table if line.startswith(label + " ") and
                 line.split()[len(label.split())] in ("static", "6-10")]
        assert [line.split()[len(label.split())] for line in lines] == ["static", "6-10"], table
        for line in lines:
            assert len(line.split()) >= len(label.split()) + 6  # schedule, steps/s, x, peak, syncs, κ


def test_the_cli_offers_every_launcher_of_the_bench(capsys):
    from elastic_moe_plugin.tools.bench import e2e

    assert e2e.LAUNCHERS == tuple(LABELS)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "--launchers{" + ",".join(LABELS) + "}" in capsys.readouterr().out.replace("\n", "").replace(" ", "")


def test_the_deepseek_v3_row_runs_swift_sft_on_deepseek_v3_with_its_template_and_no_aux_loss(tmp_path):
    from elastic_moe_plugin.tools.bench import e2e, e2e_swift

    (launcher,) = e2e.launchers(e2e.E2EOptions(launchers=("swift_sft_deepseek_v3",), hidden=64))
    assert (launcher.key, launcher.label) == ("swift_sft_deepseek_v3", "swift sft DSv3")
    assert launcher.model["hidden_size"] == launcher.model["moe_intermediate_size"] == 64  # --hidden sets both
    assert "DeepSeek-V3" in launcher.describe() and "8 groups (top 4)" in launcher.describe()
    launcher.model_dir, launcher.dataset = tmp_path / "model", tmp_path / "train.jsonl"
    argv = launcher.command("6-10", 4, tmp_path / "run", sync_step=2).argv
    assert argv[argv.index("--model_type") + 1] == "deepseek_v3"
    assert argv[argv.index("--template") + 1] == "deepseek_v2_5"
    assert "--router_aux_loss_coef" not in argv  # DeepSeek-V3 has no aux loss; the OLMoE row keeps 0.01
    olmoe = e2e_swift.SwiftSft()
    olmoe.model_dir, olmoe.dataset = launcher.model_dir, launcher.dataset
    argv = olmoe.command("6-10", 4, tmp_path / "run", sync_step=2).argv
    assert argv[argv.index("--model_type") + 1] == "olmoe" and "--router_aux_loss_coef" in argv
    assert "--experts_impl" not in argv  # transformers' own default
    (eager,) = e2e.launchers(e2e.E2EOptions(launchers=("swift_sft",), experts_impl="eager"))  # --experts-impl
    eager.model_dir, eager.dataset = launcher.model_dir, launcher.dataset
    argv = eager.command("6-10", 4, tmp_path / "run", sync_step=2).argv
    assert argv[argv.index("--experts_impl") + 1] == "eager" and "experts eager" in eager.describe()


def test_bad_options_are_refused_before_anything_runs(capsys):
    assert main(["bench", "--only", "e2e", "--rounds", "0"]) == 2
    assert "--rounds 0: at least 1 round, e.g. --rounds 3." in capsys.readouterr().err
    assert main(["bench", "--only", "e2e", "--steps", "4", "--warmup", "4"]) == 2
    assert "--steps 4 --warmup 4: the warm-up must leave timed steps" in capsys.readouterr().err


def test_a_work_folder_holding_an_earlier_benchs_runs_is_refused_with_a_fix_that_is_accepted(tmp_path, capsys):
    from elastic_moe_plugin.tools.bench import e2e

    (tmp_path / "megatron_sft" / "assets").mkdir(parents=True)  # the tiny model alone: reused, accepted
    e2e.E2EOptions(work=tmp_path).check()
    (tmp_path / "megatron_sft" / "interleaved_0").mkdir()
    assert main(["bench", "--only", "e2e", "--work", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (f"--work {tmp_path}: it holds the runs of an earlier bench ({tmp_path / 'megatron_sft' / 'interleaved_0'}): "
            f"pass a new or empty folder, e.g. --work {tmp_path / 'next'}, or remove {tmp_path / 'megatron_sft'}.") in err
    e2e.E2EOptions(work=tmp_path / "next").check()  # the fix it spells is accepted
    e2e.E2EOptions(work=tmp_path, launchers=("swift_sft",)).check()  # another launcher's runs are no clash
    (tmp_path / "megatron_lm" / "interleaved_0").mkdir(parents=True)  # two launchers' runs: both folders named
    with pytest.raises(ValueError, match=r"and 1 more\): .* or remove \S*megatron_lm \S*megatron_sft\.$"):
        e2e.E2EOptions(work=tmp_path).check()
    shutil.rmtree(tmp_path / "megatron_lm")
    shutil.rmtree(tmp_path / "megatron_sft")
    e2e.E2EOptions(work=tmp_path).check()  # the other fix, the folders removed, is accepted too


def test_an_interleaved_run_too_short_for_two_blocks_is_refused_with_a_fix_that_is_accepted(capsys):
    from elastic_moe_plugin.tools.bench import e2e

    assert main(["bench", "--only", "e2e", "--launchers", "swift_sft", "megatron_lm", "--steps", "21",
                 "--warmup", "10"]) == 2  # swift sft's blocks of 4 fit in 21 steps; Megatron-LM's of 10 do not
    assert ("--steps 21 --warmup 10: Megatron-LM interleaves blocks of 10 steps and needs two whole blocks after "
            "the warm-up; pass --steps 31 or more (or --separate-runs).") in capsys.readouterr().err
    (launcher,) = e2e.launchers(e2e.E2EOptions(launchers=("megatron_lm",)))
    assert e2e.run_plan(launcher, e2e.E2EOptions(steps=31, warmup=10), quick=False) == (31, 10, 10)
    assert e2e.run_plan(launcher, e2e.E2EOptions(steps=15, warmup=10, separate=True), quick=False) == (15, 10, None)


def test_swift_profile_reports_self_cpu_by_op_for_both_schedules(tmp_path):
    """`--only swift-profile --quick`: two profiled swift sft runs; every op row has both schedules, the
    elastic one against static, and the totals are the sums of the ops' self CPU."""
    if _megatron_core_016():
        pytest.skip("megatron-core 0.16.1 pass: swift sft does not use megatron-core; it runs on the 0.19.2 pass")
    from elastic_moe_plugin.tools import bench
    from elastic_moe_plugin.tools.bench.e2e import E2EOptions

    options = bench.BenchOptions(e2e=E2EOptions(work=tmp_path, hidden=HIDDEN))
    (section,) = bench.run_suite(True, 1, ["swift-profile"], options)
    report = json.loads(json.dumps(bench.to_json([section], True, 1)))
    schema.validate(report)
    (result,) = section.results
    assert result.window == "2:1" and set(result.tables) == {"static", "6-10"}
    assert all(table for table in result.tables.values())  # the profiler wrote each run's ops
    rows = {(row["params"]["op"], row["variant"]): row for row in report["rows"]}
    ops = {op for op, _ in rows}
    assert "all ops" in ops and len(ops) > 5
    for op in ops:
        static, elastic = rows[op, "static"], rows[op, "6-10"]
        assert elastic["baseline"] == "static" and static["baseline"] is None
        assert elastic["ratios"]["self_cpu_ms_added"] == pytest.approx(
            elastic["metrics"]["self_cpu_ms"] - static["metrics"]["self_cpu_ms"])
    totals = result.totals_ms()
    assert rows["all ops", "static"]["metrics"]["self_cpu_ms"] == pytest.approx(totals["static"])
    assert "swift sft under torch.profiler" in section.table
