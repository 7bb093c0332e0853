"""How the e2e bench reads Megatron-LM's console (``tools/bench/e2e_megatron.py``), from hand-written
log lines: the log interval it asks for and the steady-state rate it computes from them."""

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
