"""End to end: real ``swift sft`` runs (subprocesses, CPU, offline) with the plugin file.

Checked per run (see ``conftest.RUNS``): 3 training steps logged, the realised mean κ read back from
the run's ``logging.jsonl`` (and, for one run, its TensorBoard event file) centred on the model's
top-k, per-layer κ histograms / retained gate weight / load-imbalance keys with sane values, a
swift YAML whose ``ENV:`` block alone selects the schedule, and a bad schedule stopping the run
before training with the plugin's message.

How close the mean must be: with ``sampling=iid`` every routed token draws κ independently from
the schedule's pmf q, so the logged mean over N tokens has standard error σ_q / √N. One step here
routes at least ``tiny_assets.min_tokens_per_step`` (8 rows, over 1,900 tokens) per layer, so the 5%
tolerance is more than 4 standard errors per layer (:func:`_assert_tolerance_is_safe` checks this
from the numbers). ``sampling=balanced`` makes the per-step mean exact.

Three more of the transformers door's routing styles, trained with ``swift sft --plugin
elastic_moe`` under their own ms-swift model types and templates and no settings (``conftest.RUNS``:
``auto_deepseek_v4``, ``auto_gpt_oss``, ``auto_minimax_m2``; 2 steps, one checkpoint), each top-2
of 8 experts:

- DeepSeek-V4 (``deepseek_v4`` / ``deepseek_v4``; 3 layers: ``hash_moe``, ``moe``, ``moe``): its
  hash-routed first layer takes its experts from a token-id table, so it has no ranking to cut at
  κ and stays static by construction; the plan line says so, with the reason, and nothing is
  recorded or logged for it (tests/hf shows it stays stock bit for bit); layers 1-2
  (``DeepseekV4TopKRouter``: the sqrt-softplus activation, selection on it plus the correction
  bias) draw κ over the whole schedule;
- GPT-OSS (``GptOssTopKRouter`` at ``mlp.router``: top-k on the logits, softmax over the kept),
  the run that reports to TensorBoard;
- MiniMax-M2 (``minimax_m2`` / ``minimax_m2``: sigmoid, selection on the scores plus the
  correction bias its block passes to the router).

Checked: the plan line (the family's rule and gate, which layers are elastic and which static, and
why), κ over the whole 1-3 schedule at its pmf in every elastic layer, finite losses, the aux loss
(all three models return a load-balancing loss), and ``swift infer`` (transformers backend, the
run's checkpoint, no settings) generating on the DeepSeek-V4 and MiniMax-M2 checkpoints
(``infer_deepseek_v4``, ``infer_minimax_m2``).

What these runs replaced, for the CI's time (each ms-swift process costs about 20 CPU-seconds): a
DeepSeek-V3 run (sigmoid + correction bias within 2 of 4 groups), whose group-limited rule
tests/hf proves in process (the rule against its hand-written reference, the group reach, the plan
line), and ``swift infer`` on the GPT-OSS checkpoint: a checkpoint is stock whatever the routing
style (``test_swift_lifecycle.py`` shows it on OLMoE and Qwen3-MoE), so inference is checked where
it is new: the two model types, their templates' inference prompts and response prefixes.
Gemma 4, the third family new to the transformers door, cannot be built by ms-swift on this CPU
machine (its processor needs torchvision, whose PyPI wheels do not import beside the CPU torch);
``tests/hf/test_hf_trainer.py`` trains it with a plain ``transformers.Trainer`` instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.plan import RESOLVED_FROM_MODEL

pytestmark = [pytest.mark.swift, pytest.mark.slow]

TOLERANCE = 0.05  # relative, on the centre
MIN_STANDARD_ERRORS = 4.0
LAYERS = (0, 1)
NUM_EXPERTS = 8

#: run name -> (model, top-k, schedule, sampling)
TRAINING_RUNS = {
    "olmoe_iid": ("olmoe", 2, "1-3", "iid"),
    "qwen3_moe_yaml_balanced": ("qwen3_moe", 4, "2-6", "balanced"),
}
#: the plan line's static part where every MoE layer ranks its experts
NO_STATIC = "static: none"


@dataclasses.dataclass(frozen=True)
class FamilyRun:
    """One ``auto_*`` run of :data:`FAMILY_RUNS`: the model, its ms-swift model type and template,
    the family's routing rule (all three renormalise over the kept experts), its number of MoE
    layers, those that route elastically (the layers the logs carry), and the plan line's static
    part."""

    model: str
    model_type: str
    template: str
    rule: str
    moe_layers: int = 2
    elastic: tuple[int, ...] = (0, 1)
    static: str = NO_STATIC


#: every family here returns a load-balancing loss, so swift logs an aux_loss for each
FAMILY_RUNS = {
    "auto_deepseek_v4": FamilyRun(
        "deepseek_v4", "deepseek_v4", "deepseek_v4", "activation_bias", moe_layers=3, elastic=(1, 2),
        static="static top-2 (hash-routed: experts from a token-id table, no ranking to cut at κ): layers 0"),
    "auto_gpt_oss": FamilyRun("gpt_oss", "gpt_oss", "gpt_oss", "logits_topk"),
    "auto_minimax_m2": FamilyRun("minimax_m2", "minimax_m2", "minimax_m2", "sigmoid_bias"),
}
FAMILY_TOPK = 2
#: the schedule no settings resolve for top-2 of 8 (k-2..k+2, within the experts)
FAMILY_SCHEDULE = "1-3"


def _schedule(schedule: str, topk: int):
    return ElasticConfig(schedule=schedule).resolve(num_experts=NUM_EXPERTS, topk=topk, num_layers=len(LAYERS))


def _pmf_std(schedule) -> float:
    budgets, pmf = schedule.budgets, schedule.pmf
    mean = sum(b * q for b, q in zip(budgets, pmf))
    return math.sqrt(sum(q * (b - mean) ** 2 for b, q in zip(budgets, pmf)))


def _assert_tolerance_is_safe(schedule, tokens: int) -> float:
    """The standard error of a per-layer mean κ over ``tokens`` iid draws; 5% must be >= 4 of them."""
    standard_error = _pmf_std(schedule) / math.sqrt(tokens)
    assert TOLERANCE * schedule.center >= MIN_STANDARD_ERRORS * standard_error, (
        f"test design: {tokens} tokens give a standard error of {standard_error:.4f} on the mean κ, too close "
        f"to the 5% tolerance ({TOLERANCE * schedule.center:.3f}); raise the batch size")
    return standard_error


def _check_training_run(result, tiny_assets, model: str, topk: int, schedule_text: str, sampling: str):
    from elastic_moe_plugin.swift import plugin_path

    assert result.returncode == 0, result.describe()
    # the path form loads the checkout's file as typed; a name loads the package's file
    loaded = "patches/elastic_moe.py" if "patches/elastic_moe.py" in result.argv else str(plugin_path())
    assert f"Successfully imported external_plugins: [{loaded!r}]" in result.output, result.describe()
    assert "[INFO:elastic_moe] rank 0/1: plugin loaded" in result.output, result.describe()
    sampling_text = f"{sampling} sampling"
    gate = "full_softmax" if model == "olmoe" else "renormalized"
    plan = (f"elastic-moe plan (transformers, 2 MoE layers): elastic {schedule_text} around k={topk} (σ=1.5), "
            f"{model} softmax_topk rule, {gate} gate, {sampling_text}: layers 0-1; static: none")
    assert result.output.count(plan) == 1, result.describe()
    rows = result.training_rows()
    assert [row.get("global_step/max_steps") for row in rows] == ["1/3", "2/3", "3/3"], result.describe()
    schedule = _schedule(schedule_text, topk)
    assert schedule.center == topk
    standard_error = _assert_tolerance_is_safe(schedule, tiny_assets.min_tokens_per_step)
    for row in rows:
        assert math.isfinite(row["loss"]) and row["loss"] > 0
        # router_aux_loss_coef > 0: swift asked the model for router logits and logs the aux loss
        # (realised counts: E·Σ f_i P_i with Σ f_i = mean κ, so about mean κ for a near-uniform router)
        assert 0.5 * topk < row["aux_loss"] < 2 * topk, row["aux_loss"]
        means = [row[f"elastic_moe/layer_{layer}/mean_kappa"] for layer in LAYERS]
        assert row["elastic_moe/mean_kappa"] == pytest.approx(sum(means) / len(means), abs=1e-6)
        for layer, mean in zip(LAYERS, means):
            prefix = f"elastic_moe/layer_{layer}/"
            if sampling == "balanced":
                # every forward dispatches exactly T·k (token, expert) pairs
                assert mean == pytest.approx(topk, abs=1e-8), (layer, mean)
            else:
                assert abs(mean - topk) <= TOLERANCE * topk, (layer, mean, standard_error)
            fractions = {b: row[f"{prefix}kappa_frac_{b}"] for b in schedule.budgets}
            # swift rounds logged floats to 8 decimals
            assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-6)
            assert sum(b * share for b, share in fractions.items()) == pytest.approx(mean, abs=1e-6)
            for budget, q in zip(schedule.budgets, schedule.pmf):
                # a share of N draws: standard error <= 0.5/√N < 0.011 here
                assert abs(fractions[budget] - q) < 0.06, (layer, budget, fractions[budget], q)
            assert row[f"{prefix}exposure_rank_1"] == pytest.approx(1.0)
            assert row[f"{prefix}survival_rank_{schedule.high}"] == pytest.approx(schedule.survival(schedule.high))
            retained = row[f"{prefix}retained_weight_sum_mean"]
            if model == "olmoe":  # full_softmax gate: the kept share of the softmax mass
                assert 0 < row[f"{prefix}retained_weight_sum_min"] <= retained < 1
            else:  # renormalised gate
                assert retained == pytest.approx(1.0, abs=1e-5)
            imbalance = row[f"{prefix}tokens_per_expert_max_over_mean"]
            assert 1.0 <= imbalance < NUM_EXPERTS, imbalance
            assert row[f"{prefix}tokens_per_expert_cv"] >= 0
            # top-κ differs from the static top-k set exactly when κ != k
            assert row[f"{prefix}topk_set_changed_frac"] == pytest.approx(1 - fractions[topk], abs=1e-6)
    return rows


@pytest.mark.swift_runs("olmoe_iid")
def test_swift_sft_olmoe_iid(swift_runs, tiny_assets):
    """OLMoE (top-2, full_softmax gate), ELASTIC_MOE_SCHEDULE=1-3, independent draws."""
    _check_training_run(swift_runs.result("olmoe_iid"), tiny_assets, *TRAINING_RUNS["olmoe_iid"])


@pytest.mark.swift_runs("qwen3_moe_yaml_balanced")
def test_swift_sft_yaml_env_block_selects_the_schedule_and_balanced_sampling(swift_runs, tiny_assets):
    """``swift sft config.yaml`` on Qwen3-MoE (top-4, renormalised gate): the schedule (2-6) and the
    sampling (balanced: the mean κ is exactly 4) come only from the YAML's ``ENV:`` block. (The
    ``--plugin=elastic_moe`` spelling is one of the argv forms ``test_plugin_flag.py`` rewrites.)"""
    result = swift_runs.result("qwen3_moe_yaml_balanced")
    assert result.argv[-1].endswith("sft.yaml") and result.argv[-2] == "sft"
    assert not [key for key in result.env if key.startswith("ELASTIC_MOE_")]
    config = yaml.safe_load(Path(result.argv[-1]).read_text())
    assert config["ENV"] == {"ELASTIC_MOE_SCHEDULE": "2-6", "ELASTIC_MOE_SAMPLING": "balanced"}
    assert config["external_plugins"] == ["elastic_moe"]  # a plugin name where ms-swift expects a path
    rows = _check_training_run(result, tiny_assets, *TRAINING_RUNS["qwen3_moe_yaml_balanced"])
    assert {f"elastic_moe/layer_0/kappa_frac_{b}" for b in range(2, 7)} <= set(rows[0])
    assert "elastic_moe/layer_0/kappa_frac_1" not in rows[0]


def _assert_tensorboard_matches_the_log(result) -> None:
    """The run's TensorBoard event file has the routing metrics, with the values of ``logging.jsonl``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs_dir = result.output_dir / "runs"
    event_files = sorted(runs_dir.rglob("events.out.tfevents.*"))
    assert event_files, f"no TensorBoard event file under {runs_dir}"
    accumulator = EventAccumulator(str(event_files[0].parent))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"train/elastic_moe/mean_kappa", "train/elastic_moe/layer_1/kappa_frac_3",
            "train/elastic_moe/layer_0/tokens_per_expert_max_over_mean"} <= tags, sorted(tags)
    logged = {event.step: event.value for event in accumulator.Scalars("train/elastic_moe/mean_kappa")}
    jsonl = {step: row["elastic_moe/mean_kappa"] for step, row in enumerate(result.training_rows(), start=1)}
    assert sorted(logged) == sorted(jsonl) and jsonl
    for step, value in jsonl.items():
        assert logged[step] == pytest.approx(value, rel=1e-6)


@pytest.mark.swift_runs("olmoe_iid")
def test_tensorboard_events_carry_the_routing_metrics(swift_runs):
    """The callback runs before TensorBoardCallback, so the event file has the same values."""
    result = swift_runs.result("olmoe_iid")
    assert result.returncode == 0, result.describe()
    assert len(result.training_rows()) == 3
    _assert_tensorboard_matches_the_log(result)


def _family_runs(names):
    """One parameter per run, marked so that every selected run starts with the first one asked for."""
    return [pytest.param(name, marks=pytest.mark.swift_runs(name), id=name) for name in names]


def _layers_text(layers: tuple[int, ...]) -> str:
    """The plan line's form of consecutive layers: ``0-1``, ``1-2``."""
    assert list(layers) == list(range(layers[0], layers[-1] + 1))
    return f"{layers[0]}-{layers[-1]}"


@pytest.mark.parametrize("run", _family_runs(FAMILY_RUNS))
def test_swift_sft_trains_deepseek_v4_gpt_oss_and_minimax_m2_elastically(swift_runs, tiny_assets, run):
    """``swift sft --plugin elastic_moe`` with no settings on a tiny DeepSeek-V4 / GPT-OSS / MiniMax-M2:
    the plan line names the family's rule and gate, its elastic layers and its static ones with the
    reason, κ is drawn over the whole 1-3 schedule at its pmf in every elastic layer (the logs carry
    no other), the losses and the aux loss are finite, and (GPT-OSS, the run that reports to it)
    TensorBoard gets the same metrics."""
    result = swift_runs.result(run)
    family = FAMILY_RUNS[run]
    assert result.returncode == 0, result.describe()
    assert not [key for key in result.env if key.startswith("ELASTIC_MOE_")]
    flags = dict(zip(result.argv, result.argv[1:]))
    assert (flags["--model_type"], flags["--template"], flags["--plugin"]) == (
        family.model_type, family.template, "elastic_moe")
    assert "elastic-moe: plugin elastic_moe: passing it to ms-swift as --external_plugins" in result.output
    checked = f"checked against {tiny_assets.model_dir(family.model)} (top-{FAMILY_TOPK} of {NUM_EXPERTS} experts)"
    assert checked in result.output, result.describe()
    # the plan line names the family's routing rule, its own gate (no ELASTIC_MOE_GATE was set) and
    # the layers: elastic, and static with the reason
    plan = (f"elastic-moe plan (transformers, {family.moe_layers} MoE layers): elastic {FAMILY_SCHEDULE} around "
            f"k={FAMILY_TOPK} (σ=1.5), {family.model} {family.rule} rule, renormalized gate, iid sampling: layers "
            f"{_layers_text(family.elastic)}; {family.static}; {RESOLVED_FROM_MODEL}")
    assert result.output.count(plan) == 1, result.describe()
    assert f"with a renormalised gate ({family.model} routers)" in result.output, result.describe()

    schedule = _schedule(FAMILY_SCHEDULE, FAMILY_TOPK)
    standard_error = _assert_tolerance_is_safe(schedule, tiny_assets.min_tokens_per_step)
    rows = result.training_rows()
    assert [row["global_step/max_steps"] for row in rows] == ["1/2", "2/2"], result.describe()
    for row in rows:
        assert math.isfinite(row["loss"]) and row["loss"] > 0 and math.isfinite(row["grad_norm"]), row
        # E·Σ f_i P_i with Σ f_i = mean κ: about k for a near-uniform router
        assert 0.5 * FAMILY_TOPK < row["aux_loss"] < 2 * FAMILY_TOPK, row["aux_loss"]
        # every MoE layer: a hash-routed one as a static layer, at κ = k (no ranking, no records)
        logged_layers = {key.split("/")[1] for key in row if key.startswith("elastic_moe/layer_")}
        assert logged_layers == {f"layer_{layer}" for layer in range(family.moe_layers)}, sorted(logged_layers)
        for layer in set(range(family.moe_layers)) - set(family.elastic):
            assert row[f"elastic_moe/layer_{layer}/mean_kappa"] == FAMILY_TOPK
            assert row[f"elastic_moe/layer_{layer}/kappa_frac_{FAMILY_TOPK}"] == 1.0
            assert f"elastic_moe/layer_{layer}/retained_weight_sum_mean" not in row
        every_layer = [row[f"elastic_moe/layer_{layer}/mean_kappa"] for layer in range(family.moe_layers)]
        assert row["elastic_moe/mean_kappa"] == pytest.approx(sum(every_layer) / len(every_layer), abs=1e-6)
        means = [row[f"elastic_moe/layer_{layer}/mean_kappa"] for layer in family.elastic]
        for layer, mean in zip(family.elastic, means):
            prefix = f"elastic_moe/layer_{layer}/"
            fractions = {b: row[f"{prefix}kappa_frac_{b}"] for b in schedule.budgets}
            assert f"{prefix}kappa_frac_{schedule.high + 1}" not in row
            assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-6)
            assert sum(b * share for b, share in fractions.items()) == pytest.approx(mean, abs=1e-6)
            assert abs(mean - FAMILY_TOPK) <= TOLERANCE * FAMILY_TOPK, (layer, mean, standard_error)
            for budget, q in zip(schedule.budgets, schedule.pmf):  # every budget drawn, at its pmf
                assert abs(fractions[budget] - q) < 0.06, (layer, budget, fractions[budget], q)
            assert row[f"{prefix}topk_set_changed_frac"] == pytest.approx(1 - fractions[FAMILY_TOPK], abs=1e-6)
            # renormalised over the kept experts (a routed_scaling_factor is not part of it)
            assert row[f"{prefix}retained_weight_sum_mean"] == pytest.approx(1.0, abs=1e-5)
            assert 1.0 <= row[f"{prefix}tokens_per_expert_max_over_mean"] < NUM_EXPERTS
    # the logging path is the family's no more than the schedule is: one family's run reports to TensorBoard
    assert ("tensorboard" in result.argv) == (run == "auto_gpt_oss")
    if run == "auto_gpt_oss":
        _assert_tensorboard_matches_the_log(result)


#: infer run -> (the training run whose checkpoint it reads, what the template puts before the generated
#: text of a response: both templates think by default, DeepSeek-V4's closes the thought at once)
FAMILY_INFER_RUNS = {"infer_deepseek_v4": ("auto_deepseek_v4", "</think>"),
                     "infer_minimax_m2": ("auto_minimax_m2", "<think>\n")}


@pytest.mark.parametrize("run", _family_runs(FAMILY_INFER_RUNS))
def test_swift_infer_runs_on_the_deepseek_v4_and_minimax_m2_checkpoints(swift_runs, run):
    """``swift infer`` (transformers backend, 2 rows of the dataset, 4 new tokens) on the checkpoint
    of each run above, with no settings: the checkpoint's args.json names the model type and
    template, and asks for no plugin; each response is the template's prefix, then what the model
    generated."""
    result = swift_runs.result(run)
    trained, prefix = FAMILY_INFER_RUNS[run]
    assert result.returncode == 0, result.describe()
    model = result.argv[result.argv.index("--model") + 1]
    assert f"/{trained}" in model and model.endswith("checkpoint-2"), model
    rows = [json.loads(line) for line in result.result_file.read_text().splitlines() if line.strip()]
    assert len(rows) == 2 and all(row["response"].startswith(prefix) for row in rows), rows
    # generated something after the prefix (random weights: anything)
    assert any(row["response"].removeprefix(prefix) for row in rows), rows
    assert "Traceback" not in result.output
    assert "Successfully imported external_plugins" not in result.output and "elastic_moe" not in result.output


@pytest.mark.swift_runs("bad_schedule")
def test_bad_schedule_stops_swift_sft_before_training(swift_runs):
    result = swift_runs.result("bad_schedule")
    assert result.returncode != 0, result.describe()
    # the plugin's message on its own, before ms-swift's traceback, naming the variable and a fix the
    # model accepts: 5-11 (the range turned round) does not fit OLMoE's top-2 of 8 experts
    message = ("elastic-moe: configuration error: environment: ELASTIC_MOE_SCHEDULE=11-5 has low=11 > high=5: "
               "write the range as LOW-HIGH; 5-11 does not fit the model (top-2 of 8 experts) either. Use "
               "ELASTIC_MOE_SCHEDULE=1-3 (the same width around its top-k).")
    assert message in result.output, result.describe()
    assert result.output.index(message) < result.output.index("Traceback")
    assert "ConfigError" in result.output
    assert result.training_rows() == []
    assert not (result.output_dir / "logging.jsonl").exists()
    assert "Train:" not in result.output and "model_parameter_info" not in result.output
