"""How the e2e bench reads Megatron-LM's and torchtitan's consoles (``tools/bench/e2e_megatron.py``,
``tools/bench/e2e_titan.py``), from hand-written log lines: the log interval it asks for and the
steady-state rate and mean κ it computes from them; and the torchtitan row where torchtitan is missing."""

import importlib.util
import json
from pathlib import Path

import pytest

from elastic_moe_plugin.tools.bench.e2e_megatron import MegatronLM


def _line(iteration: int, ms: float, kappa: float | None = None) -> str:
    routing = f" elastic_moe/mean_kappa: {kappa:.2f} |" if kappa is not None else ""
    return (f" [2026-12-02 03:00:00] iteration {iteration:8d}/      60 | consumed samples: {8 * iteration:12d} | "
            f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.0E-04 |{routing} loss scale: 1.0 |")


@pytest.mark.parametrize("steps, warmup, interval", [(60, 10, 10), (60, 5, 1), (55, 10, 1), (4, 2, 1), (10, 10, 1)])
def test_the_recipes_log_interval_only_when_the_timed_span_is_whole_intervals(steps, warmup, interval):
    assert MegatronLM().log_interval(steps, warmup) == interval
    args = MegatronLM().megatron_args(steps, interval)
    assert args[args.index("--log-interval") + 1] == str(interval)


def test_each_logged_mean_counts_for_the_iterations_since_the_previous_log():
    # iteration 1 logs too (Megatron-LM's first iteration); 10 is the warm-up's last
    lines = [_line(1, 900.0, 8.10), _line(10, 80.0, 8.00)]
    lines += [_line(iteration, ms, 8.00) for iteration, ms in ((20, 50.0), (30, 60.0), (40, 40.0))]
    reading = MegatronLM().read(Path("."), "\n".join(lines), warmup=10)
    # 30 timed iterations over 10 * (50 + 60 + 40) ms
    assert reading.steps_per_second == pytest.approx(30 / 1.5, rel=1e-12)
    assert reading.logged_steps == 40
    assert reading.mean_kappa == pytest.approx((8.10 + 4 * 8.00) / 5, rel=1e-12)


def test_at_log_interval_one_every_iteration_after_the_warm_up_is_timed():
    lines = [_line(iteration, 100.0 if iteration <= 2 else 25.0) for iteration in range(1, 7)]
    reading = MegatronLM().read(Path("."), "\n".join(lines), warmup=2)
    assert reading.steps_per_second == pytest.approx(4 / 0.1, rel=1e-12)
    assert reading.mean_kappa is None and reading.logged_steps == 6


def test_no_log_after_the_warm_up_is_an_error_naming_the_logged_iterations():
    with pytest.raises(RuntimeError, match=r"logged iterations \[1, 10\]: none after the warm-up's 10"):
        MegatronLM().read(Path("."), "\n".join([_line(1, 90.0), _line(10, 80.0)]), warmup=10)


def _titan_lines(step: int, second: float, kappa: float | None) -> list[str]:
    """torchtitan's step line (its colours included) and, where the door logs, the door's line before it."""
    stamp = f"2026-12-02 03:{int(second) // 60:02d}:{second % 60:06.3f}".replace(".", ",")
    lines = [f"[titan] {stamp} - elastic_moe_plugin.titan - INFO - elastic-moe: step {step}: mean_kappa {kappa:.4g}, "
             "topk_set_changed_frac 0.7"] if kappa is not None else []
    return [*lines, f"[titan] {stamp} - root - INFO - \x1b[31mstep: {step:2}  \x1b[32mloss:  6.72202  "
                    "\x1b[38;2;180;60;0mgrad_norm:  4.6156  \x1b[34mtps: 60"]


def test_torchtitan_steps_per_second_run_from_the_warm_up_s_step_line_to_the_last():
    from elastic_moe_plugin.tools.bench.e2e_titan import Torchtitan, logged_steps

    seconds = {1: 10.0, 2: 12.5, 3: 14.0, 4: 15.25, 5: 16.75}
    kappas = {1: 3.0, 2: 3.0, 3: 3.011, 4: 2.95, 5: 3.042}
    output = "\n".join(line for step in seconds for line in _titan_lines(step, seconds[step], kappas[step]))
    times, logged = logged_steps(output)
    assert logged == kappas and sorted(times) == [1, 2, 3, 4, 5]
    reading = Torchtitan().read(Path("."), output, warmup=2)
    assert reading.steps_per_second == pytest.approx(3 / 4.25, rel=1e-9)
    assert reading.mean_kappa == pytest.approx(sum(kappas.values()) / 5) and reading.logged_steps == 5
    with pytest.raises(RuntimeError, match=r"torchtitan logged steps \[1, 2, 3, 4, 5\]: need step 5"):
        Torchtitan().read(Path("."), output, warmup=5)


def test_torchtitan_interleaved_kappa_is_each_mode_s_steps(tmp_path):
    from elastic_moe_plugin.tools.bench.e2e_titan import Torchtitan

    rows = [[call, "static" if (call - 1) // 2 % 2 == 0 else "elastic", None if call in (3, 5, 7) else 1.0]
            for call in range(1, 8)]
    (tmp_path / "interleaved.json").write_text(json.dumps({"block": 2, "iterations": rows,
                                                            "syncs": {"static": 4, "elastic": 4}}))
    kappas = {1: 3.0, 2: 3.0, 3: 2.5, 4: 3.5, 5: 3.0, 6: 3.0, 7: 4.0}
    output = "\n".join(line for step in kappas for line in _titan_lines(step, float(step), kappas[step]))
    reading, by_mode = Torchtitan().read_interleaved(tmp_path, output, warmup=2)
    assert reading.elastic_iterations == {3, 4, 7}
    assert by_mode == {"static": 3.0, "elastic": pytest.approx(10 / 3)}


def test_the_torchtitan_row_is_left_out_with_its_reason_where_torchtitan_is_missing(tmp_path, monkeypatch):
    """Nothing runs: the table says why, the schema has no row of it, the other launchers are unaffected."""
    from elastic_moe_plugin.tools.bench import e2e, e2e_report

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchtitan" else find_spec(name, *a))
    logged = []
    (result,) = e2e.run_e2e(e2e.E2EOptions(launchers=("torchtitan",), work=tmp_path), quick=True, log=logged.append)
    assert result.unavailable is not None and result.runs == []
    assert result.unavailable.startswith("torchtitan is not importable here") and "PYTHONPATH" in result.unavailable
    assert logged == [f"e2e torchtitan: not run: {result.unavailable}"]
    assert f"-- torchtitan: not run: {result.unavailable}" in e2e_report.format_table([result]).splitlines()
    assert e2e_report.rows([result]) == []
    assert not (tmp_path / "torchtitan").exists() or not any((tmp_path / "torchtitan").rglob("output.log"))
