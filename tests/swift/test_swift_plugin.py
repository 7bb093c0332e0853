"""The plugin file itself: identical copies, the transformers and Megatron branches, idempotency.

The probes (``_plugin_probe.py``) load the plugin as ms-swift does (``import_external_file``, hashed
module names) from both plugin paths in one process. ``megatron sft`` cannot run on a CPU machine
(``swift.megatron`` imports mcore-bridge, which imports Transformer Engine), so the Megatron probe
imports ``megatron.core`` (through the CPU compatibility layer) and a stand-in
``swift.megatron.callbacks`` carrying ms-swift's real ``MegatronCallback`` before the plugin, as
Megatron-SWIFT does, and drives the registered callback with a real 2-layer Megatron MoE stack.
The real ``megatron sft`` smoke run is in ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.swift, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed")


def test_checkout_plugin_file_is_the_packaged_one():
    """``patches/elastic_moe.py`` (checkout) is a link to the packaged ``swift/plugin/elastic_moe.py``
    (what ``plugin-path`` prints): one file, identical by construction."""
    from elastic_moe_plugin.swift import plugin_path

    packaged = plugin_path()
    assert packaged == ROOT / "elastic_moe_plugin" / "swift" / "plugin" / "elastic_moe.py"
    # alone in its directory: ms-swift puts that directory first on sys.path
    assert sorted(p.name for p in packaged.parent.iterdir() if p.suffix == ".py") == ["elastic_moe.py"]
    checkout = ROOT / "patches" / "elastic_moe.py"
    assert checkout.is_symlink() and checkout.resolve() == packaged.resolve()


def _probe(swift_runs, name: str) -> dict:
    result = swift_runs.result(name)
    assert result.returncode == 0, result.describe()
    data = result.probe()
    assert "error" not in data, data["error"]
    return data


@pytest.mark.swift_runs("probe_hf")
def test_hf_process_patches_transformers_once_and_leaves_megatron_alone(swift_runs):
    data = _probe(swift_runs, "probe_hf")
    assert len(set(data["plugin_modules"])) == 2
    assert all(name.startswith("_swift_external_") for name in data["plugin_modules"])
    assert data["hf_applied"] and "schedule='1-3'" in data["hf_config"]
    assert data["hf_router_wrap_depth"] == {"olmoe": 1, "qwen3_moe": 1}
    # one callback class, registered under one name, whichever copy of the plugin ran last
    assert data["hf_callback"].endswith("ElasticMoeCallback") and data["hf_callback_is_adapter_class"]
    assert data["hf_callback_classes_named_elastic"] == 1
    # `swift sft` never imports megatron-core or Megatron-SWIFT; the plugin must not either
    assert not data["megatron_core_imported"] and not data["swift_megatron_imported"]
    # the package directory (holding swift.py) never lands on sys.path: only plugin/ does
    assert not data["package_dir_on_sys_path"]


@pytest.mark.swift_runs("probe_hf")
def test_hf_callback_runs_first_and_logs_each_training_step(swift_runs):
    """The ``swift sft`` callback, driven as transformers' Trainer drives it (a tiny OLMoE, 1-3)."""
    data = _probe(swift_runs, "probe_hf")
    assert data["hf_callback_runs_first"]  # ahead of TensorBoard/W&B and swift's logging.jsonl writer
    logs = data["hf_logs"]
    assert logs["loss"] == 2.0 and logs["learning_rate"] == 1e-5
    tokens = data["hf_tokens_per_layer"]
    for layer in (0, 1):
        prefix = f"elastic_moe/layer_{layer}/"
        shares = [logs[f"{prefix}kappa_frac_{budget}"] for budget in (1, 2, 3)]
        assert sum(shares) == pytest.approx(1.0)
        assert all(share * tokens == pytest.approx(round(share * tokens)) for share in shares)
        assert abs(logs[f"{prefix}mean_kappa"] - 2.0) < 0.25  # 256 iid draws: standard error ≈ 0.05
        assert 0 < logs[f"{prefix}retained_weight_sum_mean"] < 1  # OLMoE: full_softmax gate
        assert 1.0 <= logs[f"{prefix}tokens_per_expert_max_over_mean"] < 8
    assert data["hf_log_history_has_metrics"]  # trainer_state.json's log_history gets them too
    assert not data["hf_second_log_has_kappa_frac"]  # histograms reset after each log
    assert data["hf_eval_and_summary_log_keys"] == [["eval_loss"], ["train_loss", "train_runtime"]]


@needs_megatron
@pytest.mark.megatron
@pytest.mark.swift_runs("probe_megatron")
def test_megatron_process_patches_topk_router_once(swift_runs):
    data = _probe(swift_runs, "probe_megatron")
    assert len(set(data["plugin_modules"])) == 2
    assert data["mcore_applied"] and "schedule='1-3'" in data["mcore_config"]
    assert data["routing_marked"]
    assert data["routing_wrap_depth"] == 1 and data["init_wrap_depth"] == 1
    assert data["hf_router_wrap_depth"] == {"olmoe": 1, "qwen3_moe": 1}
    assert data["hf_callback_classes_named_elastic"] == 1


@needs_megatron
@pytest.mark.megatron
@pytest.mark.swift_runs("probe_megatron")
def test_megatron_process_fixes_the_alltoall_dispatcher_once(swift_runs):
    """Dropless alltoall sizes its permutation as T·k; elastic routing needs the realised count."""
    data = _probe(swift_runs, "probe_megatron")
    assert data["alltoall_preprocess_marked"]
    assert data["alltoall_preprocess_wrap_depth"] == 1


@needs_megatron
@pytest.mark.megatron
@pytest.mark.swift_runs("probe_megatron")
def test_megatron_callback_is_registered_and_logs_routing_metrics(swift_runs):
    data = _probe(swift_runs, "probe_megatron")
    assert data["megatron_callback"].endswith("ElasticMoeMegatronCallback")
    assert data["megatron_callback_is_megatron_callback"]
    logs = data["megatron_logs"]
    assert logs["loss"] == 1.0 and logs["grad_norm"] == 0.5
    tokens = data["megatron_tokens_per_layer"]
    # moe_per_layer_logging unset (Megatron's default): the layer means only, as Megatron-SWIFT logs
    # its MoE losses; each mean share is two layers' counts over 2·tokens
    assert not [key for key in logs if key.startswith("elastic_moe/layer_")], sorted(logs)
    # nor the schedule's constants a(r); the observed exposure stays
    assert not [key for key in logs if "survival_rank" in key] and "elastic_moe/exposure_rank_3" in logs
    mean_shares = [logs[f"elastic_moe/kappa_frac_{budget}"] for budget in (1, 2, 3)]
    assert sum(mean_shares) == pytest.approx(1.0)
    assert all(share * 2 * tokens == pytest.approx(round(share * 2 * tokens)) for share in mean_shares)
    assert abs(logs["elastic_moe/mean_kappa"] - 2.0) < 0.2
    assert logs["elastic_moe/mean_kappa"] == pytest.approx(sum(b * q for b, q in zip((1, 2, 3), mean_shares)))
    assert logs["elastic_moe/retained_weight_sum_mean"] == pytest.approx(1.0, abs=1e-5)
    assert 1.0 <= logs["elastic_moe/tokens_per_expert_max_over_mean"] < 8
    # with the switch (a second forward): every layer's values and their means
    logs = data["megatron_logs_per_layer"]
    for layer in (0, 1):  # Megatron's 1-based layer_number 1, 2
        prefix = f"elastic_moe/layer_{layer}/"
        shares = [logs[f"{prefix}kappa_frac_{budget}"] for budget in (1, 2, 3)]
        assert sum(shares) == pytest.approx(1.0)
        assert all(share * tokens == pytest.approx(round(share * tokens)) for share in shares)
        # iid 1-3 around 2 (σ_q ≈ 0.78) over 512 tokens: standard error ≈ 0.035
        assert abs(logs[f"{prefix}mean_kappa"] - 2.0) < 0.2
        assert logs[f"{prefix}retained_weight_sum_mean"] == pytest.approx(1.0, abs=1e-5)  # renormalised
        assert 1.0 <= logs[f"{prefix}tokens_per_expert_max_over_mean"] < 8
        assert f"{prefix}survival_rank_3" in logs  # a layer's values keep a(r) next to its exposure
    assert logs["elastic_moe/mean_kappa"] == pytest.approx(
        (logs["elastic_moe/layer_0/mean_kappa"] + logs["elastic_moe/layer_1/mean_kappa"]) / 2)
    assert not data["megatron_second_log_has_kappa_frac"]  # histograms reset after each log
    assert data["megatron_eval_log_keys"] == ["eval_loss"]  # evaluation logs are left alone
    assert data["megatron_plan_lines"] == [
        "elastic-moe plan (megatron-core, 2 MoE layers): elastic 1-3 around k=2 (σ=1.5), renormalized gate, "
        "iid sampling: layers 0-1; static: none"]
