"""`elastic-moe bench --only e2e --quick`: one row per launcher (swift sft on OLMoE and on DeepSeek-V3,
megatron sft, Megatron-LM's trainer), each column filled, from real runs of the three trainers on tiny
models.

Nothing about time is asserted (the --quick runs overlap; speed is measured, not tested): only that
every launcher ran static and elastic (swift sft in two runs, the Megatron launchers interleaved in
one), that the figures are there and well-formed, and the exact ones: swift sft's static run logs a
mean κ of exactly 8, on either model (the interleaved runs log κ only in their elastic blocks), an elastic 6-10 run's
lies in [6, 10], a run's peak RSS is that of a process that imported torch, and a step's sync count
is a positive count (every trainer reads its loss on the host).
"""

import contextlib
import importlib.util
import io
import json
import math
import shutil
import statistics

import pytest

from elastic_moe_plugin.cli import main

LABELS = {"swift_sft": "swift sft", "swift_sft_deepseek_v3": "swift sft DSv3", "megatron_sft": "megatron sft",
          "megatron_lm": "Megatron-LM"}
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
def report(tmp_path_factory):
    if _megatron_core_016():
        pytest.skip("megatron-core 0.16.1 pass: the 0.16.1 wheel ships no megatron.training (Megatron-LM's row); "
                    "the bench runs on 0.19.2")
    work = tmp_path_factory.mktemp("bench_e2e")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--only", "e2e", "--quick", "--json", "--work", str(work)]) == 0
    return json.loads(out.getvalue())


def test_every_launcher_has_a_row_with_every_figure(report):
    rows = {row["launcher"]: row for row in report["e2e"]}
    assert list(rows) == list(LABELS)
    for key, row in rows.items():
        assert row["label"] == LABELS[key]
        assert row["schedules"] == {"static": "static", "elastic": "6-10"}
        assert (row["steps"], row["warmup"], row["rounds"]) == ((7, 2, 1) if key in INTERLEAVED else (4, 2, 1))
        assert sorted((run["schedule"], run["round"]) for run in row["runs"]) == [("6-10", 0), ("static", 0)]
        assert math.isfinite(row["ratio_median"]) and row["ratio_median"] > 0
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
        for schedule in ("static", "elastic"):
            column = row[schedule]
            assert math.isfinite(column["median_steps_per_second"]) and column["median_steps_per_second"] > 0
            assert column["peak_rss_bytes"] > 100 * 2**20  # a process that imported torch and trained
            assert isinstance(column["syncs_per_step"], int) and column["syncs_per_step"] > 0, (key, schedule)
        # static keeps every token's top-8: ms-swift logs exactly 8; the interleaved static blocks log nothing
        assert row["static"]["mean_kappa"] == (None if key in INTERLEAVED else 8.0)
        if key in INTERLEAVED:
            (elastic,) = [run for run in row["runs"] if run["schedule"] == "6-10"]
            assert len(elastic["pair_ratios"]) >= 1 and row["ratio_median"] == statistics.median(elastic["pair_ratios"])
            assert len({run["peak_rss_bytes"] for run in row["runs"]}) == 1  # the one process's
        assert 6 <= row["elastic"]["mean_kappa"] <= 10  # realised experts per token of a 6-10 schedule


def test_the_table_has_every_row_and_column(report, capsys):
    from elastic_moe_plugin.tools.bench import e2e

    results = []
    for row in report["e2e"]:
        result = e2e.E2EResult(row["launcher"], row["label"], row["model"], row["schedules"]["static"],
                               row["schedules"]["elastic"],
                               row["steps"], row["warmup"], row["timing"],
                               [e2e.E2ERun(**run) for run in row["runs"]])
        results.append(result)
    table = e2e.format_table(results).splitlines()
    print("\n".join(table))
    header = table[0]
    for column in e2e.COLUMNS:
        assert column in header
    for label in LABELS.values():
        # "swift sft DSv3" starts with "swift sft ": a row's label is followed by its schedule
        lines = [line for line in table if line.startswith(label + " ") and
                 line.split()[len(label.split())] in ("static", "6-10")]
        assert [line.split()[len(label.split())] for line in lines] == ["static", "6-10"], table
        for line in lines:
            assert len(line.split()) >= len(label.split()) + 6  # schedule, steps/s, x, peak, syncs, κ


def test_the_cli_offers_every_launcher_of_the_bench():
    from elastic_moe_plugin.cli import bench as cli_bench
    from elastic_moe_plugin.tools.bench import e2e

    assert cli_bench.LAUNCHERS == e2e.LAUNCHERS == tuple(LABELS)


def test_the_deepseek_v3_row_runs_swift_sft_on_deepseek_v3_with_its_template_and_no_aux_loss(tmp_path):
    from elastic_moe_plugin.tools.bench import e2e, e2e_swift

    (launcher,) = e2e._launchers(e2e.E2EOptions(launchers=("swift_sft_deepseek_v3",), hidden=64))
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
    (launcher,) = e2e._launchers(e2e.E2EOptions(launchers=("megatron_lm",)))
    assert e2e._run_plan(launcher, e2e.E2EOptions(steps=31, warmup=10), quick=False) == (31, 10, 10)
    assert e2e._run_plan(launcher, e2e.E2EOptions(steps=15, warmup=10, separate=True), quick=False) == (15, 10, None)
