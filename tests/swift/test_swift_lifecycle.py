"""The SFT lifecycle of any MoE model with ms-swift, from real processes: train with no settings at all,
then infer and export with no settings, and infer where the plugin is not installed.

Runs (``conftest.RUNS``; the infer/export runs start as soon as the training run they read has
finished):

- ``swift sft ... --plugin elastic_moe`` with no ``ELASTIC_MOE_*`` variable on tiny top-2 (OLMoE)
  and top-8 (Qwen3-MoE, 16 experts) models, 2 steps and a checkpoint each. The schedule is resolved
  from each model: 1-3 and 6-10 (the rule for every k: ``tests/core``). The top-8 run is typed in
  the venv the Makefile sets up (its ``swift-hook`` step installs the start-up hook), the top-2 one
  from the checkout with the hook made active as the wheel installs it;
- ``swift infer`` (transformers backend, 2 prompts) and ``swift export --to_ollama true`` (builds the
  model, writes a Modelfile) on the top-8 checkpoint with no variable set and ``--plugin
  elastic_moe`` typed, where the plugin loads and does nothing (``swift infer`` without the flag
  and the plugin installed: ``test_swift_sft.py``, on the GPT-OSS checkpoint);
- ``swift infer`` on the top-2 checkpoint in ``no_plugin_venv``: ms-swift without elastic-moe-plugin;
- a dense Qwen3 with ``--plugin elastic_moe``: refused at start-up, naming its model type.
"""

from __future__ import annotations

import json
import math

import pytest

from elastic_moe_plugin.swift import plugin_path

pytestmark = [pytest.mark.swift, pytest.mark.slow]

#: run -> (top-k, the schedule resolved from the model, gate)
AUTO_RUNS = {"auto_top2": (2, "1-3", "olmoe", "full_softmax"),
             "auto_top8": (8, "6-10", "qwen3_moe", "renormalized")}
RESOLVED = "schedule resolved from the model (auto: k-2..k+2 around its top-k, within its experts)"


def _assert_ok(result):
    assert result.returncode == 0, result.describe()


def _runs(names):
    """One parameter per run, marked so that every selected run starts with the first one asked for."""
    return [pytest.param(name, marks=pytest.mark.swift_runs(name), id=name) for name in names]


def _checkpoint(result):
    return result.output_dir / "checkpoint-2"  # conftest.AUTO_STEPS


@pytest.mark.parametrize("run", _runs(AUTO_RUNS))
def test_no_settings_train_elastically_with_the_schedule_of_the_model(swift_runs, run):
    result = swift_runs.result(run)
    _assert_ok(result)
    assert not [key for key in result.env if key.startswith("ELASTIC_MOE_")]
    topk, schedule, family, gate = AUTO_RUNS[run]
    low, high = map(int, schedule.split("-"))
    assert "elastic-moe: plugin elastic_moe: passing it to ms-swift as --external_plugins" in result.output
    plan = (f"elastic-moe plan (transformers, 2 MoE layers): elastic {schedule} around k={topk} (σ=1.5), "
            f"{family} softmax_topk rule, {gate} gate, iid sampling: layers 0-1; static: none; {RESOLVED}")
    assert result.output.count(plan) == 1, result.describe()
    # the settings were checked against the model's config.json at start-up, before the model was built
    loaded = result.output.index("[INFO:elastic_moe] rank 0/1: plugin loaded")
    assert "schedule='auto'" in result.output[loaded:loaded + 600]
    assert result.output.index(f"(top-{topk} of ", loaded) < result.output.index("model_kwargs:")
    rows = result.training_rows()
    assert [row["global_step/max_steps"] for row in rows] == ["1/2", "2/2"], result.describe()
    for row in rows:
        shares = {budget: row[f"elastic_moe/layer_0/kappa_frac_{budget}"] for budget in range(low, high + 1)}
        assert f"elastic_moe/layer_0/kappa_frac_{high + 1}" not in row and f"elastic_moe/layer_0/kappa_frac_{low - 1}" not in row
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
        assert min(shares.values()) > 0  # every budget of the support drawn (> 1700 tokens per step)
        # iid: the mean over > 1700 draws is within 5% of k (more than 4 standard errors, test_swift_sft.py)
        assert abs(row["elastic_moe/mean_kappa"] - topk) <= 0.05 * topk, row["elastic_moe/mean_kappa"]
        assert math.isfinite(row["loss"])


@pytest.mark.parametrize("run", _runs(AUTO_RUNS))
def test_the_checkpoint_does_not_ask_ms_swift_to_replay_the_plugin(swift_runs, run):
    """args.json (the run's, and the checkpoint's copy) keeps the plugin out of external_plugins and
    records it under a key ms-swift does not read."""
    result = swift_runs.result(run)
    _assert_ok(result)
    for args_json in (result.output_dir / "args.json", _checkpoint(result) / "args.json"):
        saved = json.loads(args_json.read_text())
        assert saved["external_plugins"] == [], args_json
        record = saved["elastic_moe_plugin"]
        assert record["external_plugins"] == [str(plugin_path())]
        assert record["config"]["schedule"] == "auto" and "swift infer" in record["note"]
        assert saved["callbacks"] == ["elastic_moe"]
    assert (_checkpoint(result) / "model.safetensors").is_file()


INFER_RUNS = {"infer_top8": ("auto_top8", True),
              "no_plugin_infer_top2": ("auto_top2", False)}


def _assert_inferred(result):
    _assert_ok(result)
    rows = [json.loads(line) for line in result.result_file.read_text().splitlines() if line.strip()]
    assert len(rows) == 2 and all(isinstance(row["response"], str) for row in rows), rows
    assert "Traceback" not in result.output


@pytest.mark.parametrize("run", _runs(name for name in INFER_RUNS if not name.startswith("no_plugin")))
def test_infer_needs_no_settings(swift_runs, run):
    result = swift_runs.result(run)
    assert not [key for key in result.env if key.startswith("ELASTIC_MOE_")]
    _assert_inferred(result)
    if INFER_RUNS[run][1]:  # --plugin elastic_moe typed: loaded, and nothing patched
        assert "--plugin" in result.argv
        assert "plugin loaded in `swift infer`, which does not train: nothing patched, ELASTIC_MOE_* not read" in result.output
        assert "hf patched" not in result.output
    else:  # the checkpoint's args.json asks for no plugin
        assert "Successfully imported external_plugins" not in result.output and "elastic_moe" not in result.output


@pytest.mark.parametrize("run", _runs(name for name in INFER_RUNS if name.startswith("no_plugin")))
def test_infer_where_the_plugin_is_not_installed(swift_runs, run, no_plugin_venv):
    result = swift_runs.result(run)
    assert result.argv[0] == str(no_plugin_venv["bin"] / "swift") and "PYTHONPATH" not in result.env
    _assert_inferred(result)
    assert "elastic_moe" not in result.output


@pytest.mark.parametrize("run", _runs(["export_top8"]))
def test_export_needs_no_settings(swift_runs, run):
    result = swift_runs.result(run)
    _assert_ok(result)
    modelfile = result.result_file.read_text()
    assert modelfile.startswith("FROM ") and "checkpoint-2" in modelfile.splitlines()[0]
    if "--plugin" in result.argv:
        assert "plugin loaded in `swift export`, which does not train: nothing patched" in result.output


@pytest.mark.swift_runs("dense_refused")
def test_a_dense_model_is_refused_at_start_up(swift_runs):
    result = swift_runs.result("dense_refused")
    assert result.returncode != 0, result.describe()
    message = "elastic-moe: error: the model "
    assert message in result.output and "(model_type='qwen3') declares no experts in its config.json" in result.output
    assert "covers the transformers router families olmoe, qwen3_moe" in result.output
    assert "ELASTIC_MOE_ENABLED=0" in result.output
    assert result.output.index(message) < result.output.index("Traceback")
    assert "model_kwargs:" not in result.output and result.training_rows() == []


def test_a_model_without_a_covered_router_is_refused_when_training_starts():
    """Where ``--model`` is no local folder (a hub id), the callback refuses at the start of training:
    a dense model has no covered router, and so no plan."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from elastic_moe_plugin import ElasticConfig, hf
    from elastic_moe_plugin.core.errors import NoMoERouterError
    from elastic_moe_plugin.swift import require_covered_routers

    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64))
    with hf.patched(ElasticConfig.from_env({})):
        plans = hf.model_plans(dense)[0]
        assert plans == {}
        with pytest.raises(NoMoERouterError, match=r"Qwen3ForCausalLM \(model_type='qwen3'\) has no router the plugin "
                                                   r"covers.*ELASTIC_MOE_ENABLED=0"):
            require_covered_routers(dense, hf.active_config(), "transformers", plans)
    require_covered_routers(dense, ElasticConfig(enabled=False), "transformers", {})  # off: nothing to refuse
