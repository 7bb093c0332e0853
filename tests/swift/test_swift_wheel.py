"""``swift sft --plugin elastic_moe`` as a user runs it: the wheel installed non-editable into a fresh
venv (``wheel_venv``), from a folder outside the checkout, CPU, a tiny local OLMoE/Qwen3-MoE.

Checked (runs in ``conftest.RUNS``, launched together):

- ``--plugin elastic_moe`` with ``NPROC_PER_NODE=2`` (ms-swift re-launches under torchrun, two CPU
  ranks, gloo): the plugin file is the wheel's, loaded on both ranks before the model is built, and
  the run trains with the routing metrics in ``logging.jsonl`` (``mean_kappa`` varying per step);
- a swift YAML with ``plugin: elastic_moe`` and the schedule in its ``ENV:`` block;
- ``--plugin nosuch`` exits non-zero naming the known plugins;
- with ``ELASTIC_MOE_SWIFT_HOOK=0`` ms-swift gets ``--plugin`` as typed and fails as ms-swift fails.

A bad schedule's message is the same code from the wheel as from the checkout, where
``test_swift_sft.py`` checks it.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.swift, pytest.mark.slow]


def _loaded_before_the_model(output: str, rank: int = 0, world: int = 1) -> bool:
    loaded = output.find(f"[INFO:elastic_moe] rank {rank}/{world}: plugin loaded")
    model = output.find("model_kwargs:")
    return 0 <= loaded < model


@pytest.mark.swift_runs("wheel_yaml")
def test_plugin_key_in_a_swift_yaml(swift_runs):
    result = swift_runs.result("wheel_yaml")
    assert result.returncode == 0, result.describe()
    assert "plugin: elastic_moe" in open(result.argv[-1]).read()
    rows = result.training_rows()
    assert len(rows) == 3 and all(abs(row["elastic_moe/mean_kappa"] - 4) < 0.3 for row in rows), result.describe()
    assert "elastic_moe/layer_0/kappa_frac_6" in rows[0]  # 2-6 from the YAML's ENV: block


@pytest.mark.swift_runs("wheel_unknown_plugin")
def test_unknown_plugin_name_lists_the_known_ones(swift_runs):
    result = swift_runs.result("wheel_unknown_plugin")
    assert result.returncode == 2, result.describe()
    assert "elastic-moe: error: --plugin 'nosuch': no such plugin. Known plugins: elastic_moe (" in result.output
    assert "Traceback" not in result.output


@pytest.mark.swift_runs("wheel_off_switch")
def test_off_switch_leaves_plugin_to_ms_swift(swift_runs):
    result = swift_runs.result("wheel_off_switch")
    assert result.returncode != 0, result.describe()
    assert "remaining_argv: ['--plugin', 'elastic_moe']" in result.output, result.describe()
    assert "elastic-moe: plugin elastic_moe: passing it" not in result.output


@pytest.mark.swift_runs("wheel_two_ranks")
def test_plugin_flag_from_the_installed_wheel_on_two_torchrun_ranks(swift_runs, wheel_venv):
    result = swift_runs.result("wheel_two_ranks")
    assert result.returncode == 0, result.describe()
    assert "--plugin" in result.argv and "--external_plugins" not in result.argv
    site = str(wheel_venv["site"])
    assert f"Successfully imported external_plugins: ['{site}/elastic_moe_plugin/swift/plugin/elastic_moe.py']" in result.output
    assert "torch.distributed.run --nproc_per_node 2" in result.output
    for rank in (0, 1):
        assert _loaded_before_the_model(result.output, rank, 2), result.describe()
    # rank 0 (and only rank 0) reports the rewrite
    assert result.output.count("elastic-moe: plugin elastic_moe: passing it to ms-swift") == 1
    rows = result.training_rows()
    assert [row["global_step/max_steps"] for row in rows] == ["1/3", "2/3", "3/3"], result.describe()
    means = [row["elastic_moe/mean_kappa"] for row in rows]
    assert len(set(means)) == 3, means  # iid budgets: a different realised mean every step
    assert all(abs(mean - 2) < 0.2 for mean in means), means  # 1-3 around OLMoE's top-2
    assert "elastic_moe/layer_1/kappa_frac_3" in rows[0]
