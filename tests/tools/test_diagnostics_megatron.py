"""``elastic-moe diagnose`` on Megatron checkpoints in the CPU demo's format, loaded by Megatron on CPU.

The fast tests build demo-format folders themselves (``demo.model_config`` / ``demo.build_model``,
a static and an elastic run of 3 Adam steps each, ``static.pt`` / ``elastic.pt``,
``model_config.json`` and the ``summary.json`` fields the κ plot reads), because the real
``elastic-moe demo --quick`` takes minutes on shared CI cores. The ``slow`` test diagnoses the output
of the session's one real quick demo (``demo_quick``, tests/tools/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, cli
from elastic_moe_plugin.tools import diagnose as diagnostics
from elastic_moe_plugin import cpu_runtime

pytestmark = pytest.mark.megatron

cpu_runtime.disable_torch_compile()
with cpu_runtime.enabled(force=True):
    pytest.importorskip("megatron.core")

from elastic_moe_plugin.tools import demo

LAYERS, EXPERTS, TOPK, SEQ = 3, 8, 2, 16
RUNS = {"static": "static", "elastic": "1-3"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _forget_moe_tracker():
    """Megatron's process-global MoE tracker sizes an entry at its first record; an entry left by
    another test's model with fewer layers would not fit this one."""
    try:
        from megatron.core.transformer.moe.moe_logging import (
            destroy_moe_metrics_tracker,
        )
    except ImportError:  # 0.16: a module-level dict
        from megatron.core.transformer.moe.moe_utils import (
            get_moe_layer_wise_logging_tracker,
        )

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def _train(config, schedule: str):
    from elastic_moe_plugin import mcore

    _forget_moe_tracker()
    with mcore.patched(ElasticConfig(schedule=schedule)):
        torch.manual_seed(0)
        model = demo.build_model(config)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(1)
        mask = demo.causal_mask(SEQ)
        positions = torch.arange(SEQ).expand(4, SEQ)
        for _ in range(3):
            batch = torch.randint(0, demo.SYNTHETIC_VOCAB, (4, SEQ + 1), generator=generator)
            optimizer.zero_grad()
            model(batch[:, :-1], positions, mask, labels=batch[:, 1:]).mean().backward()
            optimizer.step()
        histograms = {layer: h.clone() for layer, h in mcore.budget_histograms(model).items()}
    _forget_moe_tracker()
    return model.state_dict(), histograms


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """A folder in ``elastic-moe demo``'s output format with a static and an elastic run."""
    out = tmp_path_factory.mktemp("demo")
    settings = demo.DemoSettings(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_experts=EXPERTS,
                                 topk=TOPK, expert_ffn_hidden_size=32, seq_len=SEQ)
    config = demo.model_config(settings, demo.SYNTHETIC_VOCAB)
    runs, kappa = {}, {}
    with diagnostics.megatron_session():
        for name, schedule in RUNS.items():
            state, histograms = _train(config, schedule)
            torch.save(state, out / f"{name}.pt")
            runs[name] = {"checkpoint": f"{name}.pt", "elastic_config": {"schedule": schedule}}
            kappa[name] = {str(layer): {"histogram": {str(b): int(c) for b, c in enumerate(h.tolist()) if c},
                                        "elastic": True} for layer, h in histograms.items()}
    (out / "model_config.json").write_text(json.dumps(config | {"format": demo.FORMAT, "runs": runs}))
    schedule = ElasticConfig(schedule="1-3").budget_schedule(TOPK)
    summary = {"format": demo.FORMAT, "schedule": {"budgets": list(schedule.budgets), "pmf": list(schedule.pmf)},
               "runs": {name: {"elastic_layers": [] if name == "static" else list(range(LAYERS)), "kappa": kappa[name]}
                        for name in RUNS}}
    (out / "summary.json").write_text(json.dumps(summary))
    probe = out / "probe.pt"
    torch.save(demo.SyntheticLanguages().sequences(seed=7, count=6, length=SEQ), probe)
    return out, probe


def _assert_png(path):
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert float(image[..., :3].std()) > 0.01, f"{path} is blank"


def _check_outputs(out, pair="static vs elastic", k=TOPK, sweep=None):
    results = json.loads((out / "diagnostics.json").read_text())
    summary = results["pairs"][pair]
    assert [row["layer"] for row in summary["layers"]] == list(range(len(summary["layers"])))
    assert summary["boundary_layers"] == [0, len(summary["layers"]) - 1]
    assert 0 < summary["D1"] <= 1 and 0 < summary["Dk"] <= 1 and summary["js_mean"] > 0
    assert summary["Dk_experts"] == pytest.approx(k * summary["Dk"])
    if sweep is not None:
        assert set(results["topk_sweep"]["static"]["k"]) == {str(v) for v in sweep}
    for name in ("divergence_by_layer.png", "disagreement.png", "topk_sweep.png", "kappa_histogram.png"):
        _assert_png(out / name)
    for name in ("divergence_by_layer.csv", "pairs.csv", "topk_sweep.csv", "kappa.csv"):
        assert (out / name).stat().st_size > 0
    return results


def test_cli_compare_on_demo_checkpoints(demo_dir, tmp_path, capsys):
    folder, probe = demo_dir
    out = tmp_path / "out"
    assert cli.main(["diagnose", "compare", str(folder), "--probe", str(probe), "--topk-sweep", "1-4",
                     "--out", str(out)]) == 0
    assert "static vs elastic" in capsys.readouterr().out
    results = _check_outputs(out, sweep=range(1, 5))
    assert [m["kind"] for m in results["models"]] == ["megatron-demo", "megatron-demo"]
    # the κ plot uses the elastic run's training histograms from summary.json, against the pmf
    assert set(results["kappa"]) == {"elastic"}
    assert set(results["kappa"]["elastic"]["pmf"]) == {"1", "2", "3"}


def test_demo_sweep_at_the_native_k_is_the_static_eval_loss(demo_dir):
    folder, probe = demo_dir
    with diagnostics.megatron_session():
        model = diagnostics.MegatronDemoModel(str(folder), "static", "static")
        task = diagnostics.load_probe(probe)
        results = diagnostics.compare([model], [task], diagnostics.CompareSettings(sweep=(1, 3)))
        ids = torch.stack(task.sequences)
        for k in (1, 2, 3):
            with model.topk(k):
                expected = demo.evaluate(model.model, ids)  # Megatron's own per-token loss
            assert results["topk_sweep"]["static"]["k"][str(k)]["loss"] == pytest.approx(expected, rel=1e-5)
        # the override is undone
        assert all(router.topk == TOPK for router in model.routers.values())
        assert model.routers[0].config.moe_router_topk == TOPK


def test_router_swap_on_demo_checkpoints(demo_dir, tmp_path):
    folder, probe = demo_dir
    out = tmp_path / "swapped"
    assert cli.main(["diagnose", "swap", "--router-from", f"{folder}:elastic", "--into", f"{folder}/static.pt",
                     "--out", str(out), "--layers", "1-2"]) == 0
    swapped = torch.load(out / "swapped.pt", weights_only=True)
    elastic = torch.load(folder / "elastic.pt", weights_only=True)
    static = torch.load(folder / "static.pt", weights_only=True)
    for key, value in swapped.items():
        from_elastic = key.startswith(("decoder.layers.1.mlp.router.", "decoder.layers.2.mlp.router."))
        expected = elastic[key] if from_elastic else static[key]
        assert (value is None and expected is None) or torch.equal(value, expected), key  # _extra_state: None
    assert not torch.equal(static["decoder.layers.1.mlp.router.weight"], elastic["decoder.layers.1.mlp.router.weight"])
    # the swapped folder is itself a demo-format checkpoint: layer 0's router is static's, and the
    # inputs to layer 0's router are static's, so layer 0 shows zero divergence against static
    diag = tmp_path / "diag"
    assert cli.main(["diagnose", "compare", f"static={folder}:static", str(out), "--probe", str(probe),
                     "--topk-sweep", "off", "--no-plots", "--out", str(diag)]) == 0
    pair = json.loads((diag / "diagnostics.json").read_text())["pairs"]["static vs swapped"]
    assert pair["layers"][0]["js"] == 0.0 and pair["layers"][0]["d1"] == 0.0
    assert pair["layers"][1]["js"] > 0


def test_demo_layer_range_outside_the_model_fails_cleanly(demo_dir, tmp_path, capsys):
    folder, _ = demo_dir
    code = cli.main(["diagnose", "swap", "--router-from", f"{folder}:elastic", "--into", f"{folder}:static",
                     "--out", str(tmp_path / "x"), "--layers", "2-5"])
    assert code == 2
    err = capsys.readouterr().err
    assert "selects layer(s) [3, 4, 5], but the model has 3 layers" in err and "Traceback" not in err
    assert cli.main(["diagnose", "compare", f"{folder}:nope", "--probe", "x.pt"]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_end_to_end_on_the_real_demo_output(demo_quick, tmp_path):
    """``diagnose compare`` on the output of ``elastic-moe demo --quick`` (the session's one run)."""
    folder = demo_quick[0]
    env = {"TORCH_COMPILE_DISABLE": "1"}
    probe = tmp_path / "probe.pt"
    torch.save(demo.SyntheticLanguages().sequences(seed=9, count=16, length=64), probe)
    out = tmp_path / "diag"
    result = subprocess.run([sys.executable, "-m", "elastic_moe_plugin.cli", "diagnose", "compare", str(folder),
                             "--probe", str(probe), "--out", str(out)], env={**os.environ, **env},
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    config = json.loads((folder / "model_config.json").read_text())
    k = config["transformer_config"]["moe_router_topk"]
    _check_outputs(out, k=k, sweep=range(k - 2, k + 3))
