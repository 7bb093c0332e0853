"""How the e2e bench reads an interleaved run (``tools/bench/e2e_interleaved.py``), from hand-written
timing files of the step probe (``tools/bench/step_probe.py``), and the step probe's own block order
and timing, switched on by the child bootstrap and driven on a plain function."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_moe_plugin.tools.bench import e2e_interleaved
from elastic_moe_plugin.tools import child_bootstrap
from elastic_moe_plugin.tools.bench.e2e_megatron import MegatronLM


def _write(tmp_path: Path, block: int, seconds: dict[int, float | None], syncs=None) -> Path:
    rows = [[call, e2e_interleaved.MODES[((call - 1) // block) % 2], value] for call, value in sorted(seconds.items())]
    path = tmp_path / "interleaved.json"
    path.write_text(json.dumps({"block": block, "iterations": rows, "syncs": syncs or {"static": 5, "elastic": 5}}))
    return path


def test_block_means_pair_every_adjacent_block_after_the_warm_up(tmp_path):
    """Blocks of 3 after a 3-step warm-up; a block's time is the mean of its timed steps (the first,
    sync-counted, is null); every adjacent pair gives static s/it over elastic s/it."""
    times = {1: None, 2: 9.0, 3: 9.0,  # block 0, static: the warm-up
             4: None, 5: 0.10, 6: 0.14,  # block 1, elastic: mean 0.12
             7: None, 8: 0.09, 9: 0.11,  # block 2, static: 0.10
             10: None, 11: 0.13, 12: 0.11,  # block 3, elastic: 0.12
             13: None}  # the last call: no iteration follows it
    reading = e2e_interleaved.read(_write(tmp_path, 3, times, {"static": 7, "elastic": 9}), warmup=3)
    assert reading.block == 3
    assert reading.pair_ratios == pytest.approx((0.10 / 0.12, 0.10 / 0.12))  # blocks (1, 2) and (2, 3)
    assert reading.ratio == pytest.approx(0.10 / 0.12)
    assert reading.steps_per_second["static"] == pytest.approx(2 / 0.20)
    assert reading.steps_per_second["elastic"] == pytest.approx(4 / 0.48)
    assert reading.syncs == {"static": 7, "elastic": 9}
    assert reading.elastic_iterations == frozenset({4, 5, 6, 10, 11, 12})


def test_a_block_straddling_the_warm_up_is_left_out_and_too_few_blocks_is_an_error(tmp_path):
    times = {call: (None if (call - 1) % 2 == 0 else 0.1 * call) for call in range(1, 8)}
    # blocks of 2: 0 static (calls 1-2), 1 elastic (3-4: 0.4 s), 2 static (5-6: 0.6 s), 3 elastic (7, untimed)
    reading = e2e_interleaved.read(_write(tmp_path, 2, times), warmup=2)
    assert reading.pair_ratios == pytest.approx((0.6 / 0.4,))
    # a warm-up of 3 reaches into block 1, which is left out: block 2 has no timed neighbour
    with pytest.raises(RuntimeError, match=r"no two adjacent timed blocks of 2 steps after the warm-up's 3 \(blocks \[2\]\)"):
        e2e_interleaved.read(_write(tmp_path, 2, times), warmup=3)
    with pytest.raises(RuntimeError, match="is missing"):
        e2e_interleaved.read(tmp_path / "absent.json", warmup=1)


@pytest.mark.parametrize("warmup, block, pairs, steps", [(10, 10, 4, 91), (2, 2, 1, 7), (3, 10, 1, 31), (0, 5, 2, 21)])
def test_a_run_has_its_warm_up_then_whole_blocks_and_one_more_call(warmup, block, pairs, steps):
    assert e2e_interleaved.run_steps(warmup, block, pairs) == steps


def test_megatron_lm_logs_at_the_recipes_interval_when_every_block_holds_whole_intervals():
    assert MegatronLM().log_interval(91, 10, interleave_block=10) == 10
    assert MegatronLM().log_interval(7, 2, interleave_block=2) == 1


def test_the_step_probe_alternates_blocks_and_times_call_to_call(tmp_path):
    """The step probe, switched on by the child bootstrap (``EMOE_BOOTSTRAP=step_probe``), on a
    stand-in trainer module: calls alternate static/elastic in blocks
    (switching the real mcore patch, from the run's own config); after a warm-up of 2 the first call
    of each mode is sync-counted and carries no time; every other call's time runs to the next
    call's entry, the switch left out (a switch made 30 ms slower by a stand-in ``mcore.apply`` /
    ``mcore.remove``, outside every time)."""
    trainer = tmp_path / "fake_trainer.py"
    trainer.write_text("import time\ndef train_step():\n    time.sleep(0.01)\n")
    out = tmp_path / "interleaved.json"
    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "from elastic_moe_plugin import cpu_runtime\n"
        "cpu_runtime.enable()\n"
        "from elastic_moe_plugin import ElasticConfig, mcore\n"
        "mcore.apply(ElasticConfig(schedule='6-10'))\n"
        "import time\n"
        "apply, remove = mcore.apply, mcore.remove\n"
        "mcore.apply = lambda config: (time.sleep(0.03), apply(config))[1]\n"
        "mcore.remove = lambda: (time.sleep(0.03), remove())[1]\n"
        "import fake_trainer\n"
        "modes = []\n"
        "for _ in range(7):\n"
        "    fake_trainer.train_step(); modes.append(mcore.is_applied()); time.sleep(0.005)\n"
        "print(modes)\n"
    ) % str(tmp_path)
    env = {**os.environ, **child_bootstrap.environment(["step_probe"], str(Path.cwd())),
           "E2E_BENCH_TARGET": "fake_trainer:train_step", "E2E_BENCH_INTERLEAVE_BLOCK": "2",
           "E2E_BENCH_INTERLEAVE_OUT": str(out), "E2E_BENCH_SYNC_STEP": "2"}
    env.pop("RANK", None)
    pytest.importorskip("megatron.core")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == str([False, False, True, True, False, False, True])
    data = json.loads(out.read_text())
    assert data["block"] == 2
    assert [row[:2] for row in data["iterations"]] == [[1, "static"], [2, "static"], [3, "elastic"], [4, "elastic"],
                                                       [5, "static"], [6, "static"], [7, "elastic"]]
    timed = {row[0]: row[2] for row in data["iterations"]}
    # calls 3 and 5: the first of each mode after the warm-up; 7: the last, which no call follows
    assert [call for call, value in timed.items() if value is None] == [3, 5, 7]
    # 10 ms in the step + 5 ms after it; the 30 ms switches before calls 3, 5 and 7 are in none
    assert all(0.014 <= timed[call] < 0.040 for call in (1, 2, 4, 6)), timed
    assert set(data["syncs"]) == {"static", "elastic"} and statistics.fmean(data["syncs"].values()) == 0


def test_the_step_probe_switches_the_door_of_its_target(tmp_path):
    """torchtitan's ``Trainer.train_step`` switches the titan door (its static blocks: the door at
    ``schedule="static"``); a door the probe cannot switch is refused, naming the ones it can."""
    from elastic_moe_plugin.tools.bench import step_probe

    assert step_probe.TARGETS["torchtitan"] == ("torchtitan.trainer", "Trainer", "train_step")
    assert step_probe.DOORS == {"megatron_lm": "mcore", "megatron_swift": "mcore", "torchtitan": "titan"}
    with pytest.raises(ValueError, match=r"E2E_BENCH_DOOR='deepspeed': expected mcore or titan\."):
        step_probe._Interleaving(2, str(tmp_path / "interleaved.json"), door="deepspeed")
