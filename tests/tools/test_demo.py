"""``elastic-moe demo --quick``: the CPU training demo end to end, in a fresh process.

The demo runs as a subprocess (what ``make demo`` runs, minus the budget): it enables the CPU
compatibility layer and Megatron's model-parallel state itself, which must not meet the
session-wide set-up of ``tests/megatron_support.py``. Runs under megatron-core 0.19.2 and, with
``PYTHONPATH=.mcore-0.16.1``, 0.16.1 (the subprocess inherits the environment).
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.core.schedule import BudgetSchedule

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def slow_megatron(test):
    """End-to-end demo runs: need megatron-core; marked megatron and slow."""
    test = pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core")(test)
    return pytest.mark.megatron(pytest.mark.slow(test))


K = 4
LAYERS = 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(demo_quick):
    return demo_quick  # tests/tools/conftest.py: the one quick demo run of the session


@slow_megatron
def test_table_has_every_field(quick):
    _, _, stdout, stderr = quick
    for field in (
        "final train loss", "held-out loss (static top-4)", "inference top-k' sweep", "top-2", "top-6",
        "<- trained k", "realised mean κ per layer", "exposure P(κ ≥ r)", "tokens-per-expert imbalance",
        "load-balancing loss", "train throughput", "wall time (s)", "seed 0", "1B-30B scale",
        "static", "elastic 2-6", "megatron-core",
    ):
        assert field in stdout, field
    for layer in range(LAYERS):
        assert f"layer {layer} (elastic)" in stdout
    # Progress is on stderr (a final line per run when not a TTY), never in the table.
    assert "static [" in stderr and "elastic [" in stderr and "tok/s" in stderr
    assert "tok/s  loss" not in stdout


@slow_megatron
def test_static_run_routes_exactly_k_everywhere(quick):
    static = quick[1]["runs"]["static"]
    assert static["schedule"] == "static" and static["elastic_layers"] == []
    for layer in range(LAYERS):
        kappa = static["kappa"][str(layer)]
        assert kappa["source"] == "routing_maps"
        assert kappa["mean"] == K and kappa["min"] == kappa["max"] == K
        assert kappa["histogram"] == {str(K): kappa["tokens"]}
        assert static["exposure"][str(layer)]["observed"] == [1.0] * K + [0.0] * (len(static["exposure"]["0"]["observed"]) - K)


@slow_megatron
def test_elastic_run_matches_the_schedule(quick):
    summary = quick[1]
    elastic = summary["runs"]["elastic"]
    schedule = BudgetSchedule.parse("2-6", K, 1.5)
    assert elastic["elastic_layers"] == list(range(LAYERS))
    tokens = summary["settings"]["tokens"]
    for layer in range(LAYERS):
        kappa = elastic["kappa"][str(layer)]
        assert kappa["source"] == "budget_histograms" and kappa["tokens"] == tokens
        assert kappa["histogram_matches_routing_maps"] is True
        assert abs(kappa["mean"] - K) <= 0.03 * K, kappa
        assert kappa["min"] == 2 and kappa["max"] == 6
        observed = elastic["exposure"][str(layer)]["observed"]
        assert observed[:2] == [1.0, 1.0] and observed[6:] == [0.0] * (len(observed) - 6)
        for r, value in enumerate(observed, start=1):
            assert value == pytest.approx(schedule.survival(r), abs=0.02), (layer, r)


@slow_megatron
def test_summary_sweep_and_files(quick):
    out, summary, _, _ = quick
    for name in ("static", "elastic"):
        run = summary["runs"][name]
        assert sorted(run["topk_sweep"]) == ["2", "3", "4", "5", "6"]
        assert run["heldout_loss"] == run["topk_sweep"]["4"]
        # the quick run learns something: below the uniform loss ln(vocab)
        assert run["heldout_loss"] < 0.8 * math.log(summary["data"]["vocab_size"])
        assert set(run["imbalance"]["train"]) == {str(layer) for layer in range(LAYERS)}
        assert all(value >= 1.0 for value in run["imbalance"]["train"].values())
        assert run["wall_time_s"] > 0 and run["tokens"] == summary["settings"]["tokens"]
        assert len(run["history"]["loss"]) == summary["settings"]["steps"]
    for png in ("loss_curves.png", "topk_sweep.png", "kappa_histogram.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5_000, png
    config = json.loads((out / "model_config.json").read_text())
    assert config["transformer_config"]["num_moe_experts"] == 16
    assert config["transformer_config"]["moe_router_topk"] == K
    assert config["runs"]["elastic"]["elastic_config"]["schedule"] == "2-6"
    import torch

    static, elastic = (torch.load(out / f"{name}.pt", weights_only=True) for name in ("static", "elastic"))
    assert static.keys() == elastic.keys() and len(static) > 0
    assert any(key.endswith("mlp.router.weight") for key in static)


def _text_file(path: Path) -> Path:
    rng = random.Random(0)
    words = ["the", "router", "sends", "each", "token", "to", "its", "top", "experts", "while", "elastic",
             "training", "samples", "a", "budget"]
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)))
    return path


@slow_megatron
def test_layer_subset_json_and_data_file(run_demo, tmp_path):
    """--layers 1-2: layers 0 and 3 of the elastic run stay exactly top-k; --json prints the
    summary; --data trains on a text file as bytes."""
    text = _text_file(tmp_path / "text.txt")
    out = tmp_path / "out"
    summary, stdout, _ = run_demo(out, "--layers", "1-2", "--steps", "15", "--json", "--data", str(text))
    assert json.loads(stdout) == json.loads((out / "summary.json").read_text()) == summary
    assert summary["data"]["vocab_size"] == 256 and "byte-level" in summary["data"]["description"]
    assert summary["settings"]["steps"] == 15 and summary["settings"]["layers"] == "1-2"
    elastic = summary["runs"]["elastic"]
    assert elastic["elastic_layers"] == [1, 2]
    for layer in (0, 3):
        kappa = elastic["kappa"][str(layer)]
        assert not kappa["elastic"] and kappa["source"] == "routing_maps"
        assert kappa["mean"] == K and kappa["min"] == kappa["max"] == K
    for layer in (1, 2):
        kappa = elastic["kappa"][str(layer)]
        assert kappa["elastic"] and kappa["source"] == "budget_histograms"
        assert abs(kappa["mean"] - K) <= 0.03 * K and kappa["min"] < K < kappa["max"]
    for layer in range(LAYERS):
        assert summary["runs"]["static"]["kappa"][str(layer)]["mean"] == K


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "6-10"], "--schedule 6-10 does not contain the model's top-4"),
        (["--schedule", "1-9"], "not 4"),
        (["--layers", "2-7"], "selects layer(s) [4, 5, 6, 7]"),
        (["--sigma", "0"], "--sigma 0.0 is invalid"),
        (["--steps", "0"], "--steps=0 is invalid"),
        (["--data", "/nonexistent/corpus.txt"], "no such file"),
    ],
)
def test_bad_settings_exit_2_before_training(capsys, tmp_path, argv, message):
    assert main(["demo", "--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_without_megatron_core_the_demo_names_the_extra(tmp_path):
    """An environment without the [megatron] extra (megatron made unimportable in a fresh interpreter)."""
    code = (
        "import importlib.abc, sys\n"
        "class WithoutMegatron(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'megatron' or name.startswith('megatron.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, WithoutMegatron())\n"
        "from elastic_moe_plugin.cli import main\n"
        "sys.exit(main(['demo', '--quick', '--out', sys.argv[1]]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "pip install 'elastic-moe-plugin[megatron]'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
