"""`elastic-moe bench`: one command for every measurement, one JSON schema for every mode.

- ``scripts/`` holds launch scripts only: every benchmark and probe is a bench mode;
- ``elastic-moe bench --help`` lists every mode with what it measures;
- every mode's ``--json`` follows the one schema (``tools/bench/schema.py``): the cheap modes run
  for real here (``routing``, ``kappa``, ``calls``, ``mcore-cuda`` at ``--quick``), the others'
  row builders run on results of their own types (their real runs are validated in
  test_bench.py, test_bench_hf.py and test_bench_e2e.py, slow);
- the schema's validator refuses what breaks it, each rule on its own.
"""

import contextlib
import copy
import io
import json
import math
import re
from pathlib import Path

import pytest

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.tools import bench
from elastic_moe_plugin.tools.bench import schema

REPO = Path(__file__).resolve().parents[2]
#: the launch scripts, the SLURM example and the shell helpers; no Python
SCRIPTS = {"_launch.sh", "olmoe_sft.sh", "pretrain.sh", "pretrain_titan.sh", "qwen3_sft.sh", "slurm_example.sbatch",
           "build_megatron_dataset_helpers.sh", "gpu_check.sh", "titan_upstream_tests.sh"}


def test_scripts_holds_no_python_file_only_the_launch_scripts():
    files = {path.name for path in (REPO / "scripts").iterdir() if path.is_file()}
    assert not [name for name in files if name.endswith(".py")]
    assert files == SCRIPTS


def test_gpu_check_measures_through_bench_modes():
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    assert "elastic_moe_plugin.cli bench --only mcore-cuda --json" in script
    assert not re.search(r"scripts/\w+\.py", script)  # no Python script of scripts/ is called


def test_help_lists_every_mode_with_what_it_measures(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    epilog = text[text.index("modes (--only"):]
    lines = {line.split()[0]: line for line in epilog.splitlines() if line.startswith("  ") and line.split()}
    for mode, what in bench.MODES.items():
        assert mode in lines, mode
        assert " ".join(epilog.split()).count(" ".join(what.split())) == 1, mode
    assert set(bench.DEFAULT_MODES) < set(bench.MODES)
    for name in ("kappa", "routing", "mcore-cuda", "e2e", "swift-profile", "hook-cost"):
        assert name in bench.MODES


def test_an_unknown_mode_and_bad_rounds_are_refused_before_anything_runs(capsys):
    with pytest.raises(ValueError, match="--only nosuch: expected some of router, routing, "):
        bench.check_options(["nosuch"], bench.BenchOptions())
    assert main(["bench", "--only", "kappa", "--rounds", "0"]) == 2
    assert "--rounds 0: at least 1 round, e.g. --rounds 3." in capsys.readouterr().err
    assert main(["bench", "--only", "swift-profile", "--profile", "6:3", "--steps", "8", "--quick"]) == 2
    assert "--profile 6:3 --steps 8: FIRST:COUNT with FIRST + COUNT <= --steps" in capsys.readouterr().err
    # before a mode that comes first runs (router would take seconds)
    assert main(["bench", "--only", "router", "swift-profile", "--profile", "6:3", "--steps", "8"]) == 2
    assert "--profile 6:3 --steps 8" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- every mode's JSON
@pytest.fixture(scope="module")
def cheap_report(mp_world):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "--quick", "--json", "--only", "routing", "kappa", "calls", "mcore-cuda"])
    report = json.loads(out.getvalue())
    return code, report


@pytest.mark.megatron
@pytest.mark.hf
def test_the_cheap_modes_json_follows_the_schema(cheap_report):
    code, report = cheap_report
    schema.validate(report)
    assert code == 0 and report["ok"] and report["quick"] is True
    assert report["modes"] == ["routing", "kappa", "calls", "mcore-cuda"]
    assert {row["mode"] for row in report["rows"]} == set(report["modes"])
    assert report["schema"] == schema.SCHEMA and report["schema_version"] == schema.SCHEMA_VERSION


@pytest.mark.megatron
@pytest.mark.hf
def test_mcore_cuda_keeps_every_check_of_the_gpu_script(cheap_report):
    """Without CUDA: tiny shapes on the CPU runtime. The dispatcher checks pass for every dispatcher,
    capacity mode and sampling; the flex indices too; syncs are counted per variant and the layer timed."""
    from elastic_moe_plugin.tools.bench import mcore_cuda

    _, report = cheap_report
    rows = [row for row in report["rows"] if row["mode"] == "mcore-cuda"]
    checks = {(row["scenario"], row["variant"]): row for row in rows if "passed" in row["metrics"]}
    expected = {(f"dispatch-{case}", sampling) for case in mcore_cuda.DISPATCH_CASES for sampling in ("iid", "balanced")}
    assert set(checks) == expected | {("flex-indices", "elastic")}
    assert all(row["metrics"]["passed"] for row in checks.values())
    assert all(row["metrics"]["max_abs_error"] <= 1e-4 for key, row in checks.items() if key[0] != "flex-indices")
    syncs = {row["variant"]: row for row in rows if row["scenario"] == "syncs"}
    assert list(syncs) == ["stock", "iid", "balanced"]
    for variant, row in syncs.items():
        metrics = row["metrics"]
        assert isinstance(metrics["local_scalar_dense"], int) and isinstance(metrics["event_synchronize"], int)
        assert 6 <= metrics["mean_kappa"] <= 10
        assert row["ratios"] == ({} if variant == "stock" else {"syncs_added": 0})  # κ is drawn on the host
    assert syncs["balanced"]["metrics"]["mean_kappa"] == 8.0  # Σκ = T·k exactly
    timing = {row["variant"]: row for row in rows if row["scenario"] == "timing"}
    assert list(timing) == ["stock", "iid", "balanced"]
    assert all(math.isfinite(row["ratios"]["time_ratio"]) for row in timing.values() if row["baseline"])


def test_a_failed_check_makes_the_report_not_ok_and_the_command_exit_1(monkeypatch, capsys):
    failed = schema.row("mcore-cuda", "dispatch-x", "", "iid", metrics={"max_abs_error": 0.5, "passed": False})
    sections = [bench.Section(("mcore-cuda",), "table", [failed])]
    monkeypatch.setattr(bench, "run_suite", lambda *args, **kwargs: sections)
    assert main(["bench", "--only", "mcore-cuda", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    schema.validate(report)
    assert report["ok"] is False


def _scenario_result(mode, scenario, implementation=None):
    from elastic_moe_plugin.tools.bench import hf, measure

    variant = {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0, "peak_bytes": 10, "syncs_per_forward": 0,
               "expected_pairs": 8, "realised_pairs": 8}
    if implementation is None:
        result = measure.ScenarioResult(scenario, "E=4 k=2", params={"experts": 4}, mode=mode)
        result.variants = {name: measure.VariantResult(**variant) for name in measure.VARIANTS}
    else:
        result = hf.ExpertsScenarioResult(scenario, "E=4 k=2", params={"implementation": implementation}, mode=mode,
                                          implementation=implementation)
        result.variants = {name: hf.ExpertsVariantResult(**variant, dispatched_pairs=8) for name in measure.VARIANTS}
    return result


def _every_modes_rows():
    """Per mode, rows built by its own row builder from results of its own types."""
    from elastic_moe_plugin.tools.bench import (calls, e2e, e2e_report, hook_cost, kappa, log_metrics, mcore_cuda,
                                                swift_profile)

    e2e_result = e2e.E2EResult("swift_sft", "swift sft", "OLMoE-shaped", "static", "6-10", 4, 2, "from logs",
                               [e2e.E2ERun("static", 0, 1.0, 2**30, 7, 8.0, 30.0),
                                e2e.E2ERun("6-10", 0, 1.1, 2**30, 7, 8.01, 31.0)])
    profile = swift_profile.ProfileResult("2:1", 4, "OLMoE-shaped", {
        "static": {"aten::mm": [100.0, 4], "aten::cat": [50.0, 2]},
        "6-10": {"aten::mm": [90.0, 4], "aten::index": [20.0, 3]}})
    times = {"python -c pass": {"bare": [0.010, 0.011], "wheel": [0.0101, 0.0112]},
             "swift launcher process": {"wheel": [0.0001, 0.0002]}}
    draws = [kappa.KappaDrawResult("iid", 1, path, 64, 2.0, 1.5, 1.0, 3.0, 100, 5, stream)
             for path, stream in (("before", ""), ("megatron", "TrackedStream"))]
    return {
        "router": [r for s in ("router",) for r in _scenario_result("router", s).rows()],
        "routing": _scenario_result("routing", "routing").rows(),
        "layer": [r for s in ("layer-allgather", "layer-droppad") for r in _scenario_result("layer", s).rows()],
        "gpt": _scenario_result("gpt", "gpt-step").rows(),
        "hf": [r for impl in ("eager", "grouped_mm") for r in _scenario_result("hf", "olmoe-block", impl).rows()],
        "kappa": kappa.rows(draws),
        "calls": calls.rows([calls.RouterCallResult("megatron", variant, 64, 5.0, 4.0, 6.0) for variant in calls.VARIANTS]),
        "mcore-cuda": [schema.row("mcore-cuda", "flex-indices", "", "elastic", metrics={"passed": True}),
                       *_mcore_cuda_rows(mcore_cuda)],
        "e2e": e2e_report.rows([e2e_result]),
        "swift-profile": swift_profile.rows(profile),
        "hook-cost": hook_cost.rows(times),
        "log-metrics": log_metrics.rows(log_metrics.LogMetricsResult(4, "cpu", 256, {"layers": [0.02, 0.03],
                                                                                      "means": [0.002, 0.003]},
                                                                     {"layers": 129, "means": 21})),
    }


@pytest.mark.hf
def test_log_metrics_writes_the_scalars_of_each_layout_and_times_both(capsys):
    """At L MoE layers a logging step of ``layers`` writes 31 scalars per layer and 5 means (31 L + 5),
    ``means`` the 21 scalars of the layer means; both are timed in every round."""
    from elastic_moe_plugin.tools.bench import log_metrics

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "--quick", "--json", "--only", "log-metrics", "--rounds", "2", "--threads", "1"])
    report = json.loads(out.getvalue())
    schema.validate(report)
    rows = {row["variant"]: row for row in report["rows"]}
    layers = log_metrics.QUICK_LAYERS
    assert code == 0 and rows["layers"]["params"]["layers"] == layers
    assert rows["layers"]["metrics"]["scalars"] == 31 * layers + 5 and rows["means"]["metrics"]["scalars"] == 21
    assert all(row["params"]["rounds"] == 2 and row["metrics"]["median_ms"] > 0 for row in rows.values())
    assert rows["means"]["baseline"] == "layers" and rows["means"]["ratios"]["time_ratio"] > 0


def _mcore_cuda_rows(mcore_cuda):
    return [schema.row(mcore_cuda.MODE, "timing", "tiny", variant, metrics={"median_ms": 1.0},
                       baseline=None if variant == "stock" else "stock",
                       ratios=None if variant == "stock" else {"time_ratio": 1.0}) for variant in mcore_cuda.VARIANTS]


def test_every_modes_row_builder_follows_the_one_schema():
    built = _every_modes_rows()
    assert set(built) == set(bench.MODES)  # a new mode must come with its rows
    for mode, rows in built.items():
        assert rows and {row["mode"] for row in rows} == {mode}, mode
        report = schema.report(False, [mode], {"torch": "x"}, rows)
        schema.validate(json.loads(json.dumps(report)))  # as --json prints it
    everything = schema.report(False, list(built), {}, [row for rows in built.values() for row in rows])
    assert everything["ok"] and len(everything["rows"]) == sum(len(rows) for rows in built.values())


# ---------------------------------------------------------------------------------- the validator
def _good():
    rows = [schema.row("router", "router", "E=4", "stock", metrics={"median_ms": 1.0}),
            schema.row("router", "router", "E=4", "iid", metrics={"median_ms": 1.1, "laps": [1.0, None]},
                       baseline="stock", ratios={"time_ratio": 1.1})]
    return json.loads(json.dumps(schema.report(True, ["router"], {"torch": "2"}, rows)))


def _broken(change):
    report = _good()
    change(report)
    return report


BREAKS = {
    "a missing field": (lambda r: r["rows"][0].pop("params"), "fields"),
    "an extra report field": (lambda r: r.update(extra=1), "fields"),
    "another version": (lambda r: r.update(schema_version=schema.SCHEMA_VERSION + 1), "version"),
    "a mode not among the report's": (lambda r: r["rows"][0].update(mode="calls"), "not among the report's modes"),
    "a nested metric": (lambda r: r["rows"][0]["metrics"].update(x={"a": 1}), "is not an allowed value"),
    "a NaN metric": (lambda r: r["rows"][0]["metrics"].update(x=float("nan")), "is not an allowed value"),
    "a string ratio": (lambda r: r["rows"][1]["ratios"].update(x="1"), "is not an allowed value"),
    "ratios without a baseline": (lambda r: r["rows"][1].update(baseline=None), "need the baseline"),
    "a baseline without its row": (lambda r: r["rows"][1].update(baseline="balanced"), "no row of variant 'balanced'"),
    "a duplicate row": (lambda r: r["rows"].append(copy.deepcopy(r["rows"][0])), "a second row"),
    "a check that is no boolean": (lambda r: r["rows"][0]["metrics"].update(passed="yes"), "a boolean"),
    "ok against a failed check": (lambda r: r["rows"][0]["metrics"].update(passed=False), "report.ok"),
    "an empty variant": (lambda r: r["rows"][0].update(variant=""), "non-empty string"),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_the_validator_refuses_what_breaks_the_schema(name):
    schema.validate(_good())
    change, message = BREAKS[name]
    with pytest.raises(schema.SchemaError, match=message):
        schema.validate(_broken(change))


def test_the_json_schema_names_the_same_fields():
    assert schema.JSON_SCHEMA["required"] == list(schema.BenchReport.__annotations__)
    row = schema.JSON_SCHEMA["properties"]["rows"]["items"]
    assert row["required"] == list(schema.BenchRow.__annotations__) == sorted(row["properties"], key=row["required"].index)
    assert schema.JSON_SCHEMA["properties"]["schema_version"] == {"const": schema.SCHEMA_VERSION}


def test_a_measurement_that_came_out_nan_is_null_and_its_ratio_left_out():
    """A failed check's NaN error (mcore-cuda) must not break the report it fails."""
    rows = [schema.row("mcore-cuda", "dispatch-x", "", "iid", metrics={"passed": False, "max_abs_error": math.nan,
                                                                         "laps": [1.0, math.inf]}),
            schema.row("mcore-cuda", "timing", "", "stock", metrics={"median_ms": 0.0}),
            schema.row("mcore-cuda", "timing", "", "iid", metrics={"median_ms": 1.0}, baseline="stock",
                       ratios={"time_ratio": math.inf, "added_ms": 1.0})]
    report = json.loads(json.dumps(schema.report(True, ["mcore-cuda"], {}, rows)))
    schema.validate(report)
    assert report["ok"] is False
    assert report["rows"][0]["metrics"] == {"passed": False, "max_abs_error": None, "laps": [1.0, None]}
    assert report["rows"][2]["ratios"] == {"added_ms": 1.0}
