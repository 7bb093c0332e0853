"""End to end: ``elastic-moe launch RECIPE --rehearse``, one recipe per launcher, as a user runs it.

Each run is the ``elastic-moe`` command line in a subprocess (``python -m elastic_moe_plugin.cli``),
which plans the rehearsal (tiny same-family model, local data, the replacements it prints), then
runs the recipe's own launcher: ``megatron sft`` for ``qwen3_sft/6-10`` (4 CPU processes: PP 2 x
EP 2 x DP 2), ``swift sft`` for ``olmoe_sft/6-10`` (2 processes, DP 2, under the recipe's DeepSpeed
ZeRO-2), Megatron-LM's trainer for ``pretrain/6-10`` (2 processes, EP 2). Two steps each here (the
default is 3), the OLMoE and pretraining recipes with ``--set batch.global=16`` (their 256 sequences
a step are 128 micro-batches a step on each of 2 CPU processes; the accumulation code is the same at
16). A user overlay of the OLMoE recipe with a flag ms-swift does not know (rehearsed with
``--nproc-per-node 1``: one ``swift sft`` rank fails as two would) must fail with ms-swift's own
message before any step.

That the OLMoE rehearsal trained under DeepSpeed ZeRO-2 is read from the engine each rank built
(``_engine_probe.py``, run at the start of every process through the ``PYTHONPATH`` the rehearsal
passes on): ZeRO stage 2 over 2 ranks, each holding the whole model and half of the optimizer's
fp32 partition.

How close the logged mean κ must be to 8: with ``sampling=iid`` each token draws κ independently
from the 6-10 pmf (mean 8, standard deviation σ_q), so one rank's per-step, per-layer mean over N
tokens has standard error σ_q/√N. N is at least (rows per rank and step) x (the shortest row of the
rehearsal's dataset, content tokens only), which :func:`_tolerance` reads from the files the
rehearsal wrote; the tolerance is 4.5 standard errors at that N (a chance failure per comparison
below 1e-5). A static run would log exactly 8, so each step must also show κ = 6 and κ = 10.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS = 2
Z = 4.5

pytestmark = [pytest.mark.swift, pytest.mark.slow]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_elastic_moe_tests_swift_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_jobs = _load("_jobs")
_probe = _load("_engine_probe")


def _missing(*modules: str) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def _megatron_training_missing() -> str | None:
    core, training = importlib.util.find_spec("megatron.core"), importlib.util.find_spec("megatron.training")
    if core is None or training is None:
        return "megatron-core with megatron.training (the 0.19.2 wheel)"
    if Path(core.origin).parents[1] != Path(training.origin).parents[1]:
        return "a megatron.training of the imported megatron.core (the 0.16.1 wheel ships none)"
    return None


#: the global batch of the OLMoE and pretraining rehearsals here (the recipes' own: 256)
GLOBAL_BATCH = 16
#: name -> (recipe, what must be importable, its weight in processes, recipe keys set on the command line)
REHEARSALS = {
    "qwen3": ("qwen3_sft/6-10", _missing("swift", "mcore_bridge", "megatron.core"), 2, []),
    "olmoe": ("olmoe_sft/6-10", _missing("swift", "transformers", "deepspeed"), 2, [f"batch.global={GLOBAL_BATCH}"]),
    "pretrain": ("pretrain/6-10", [m for m in [_megatron_training_missing()] if m], 2, [f"batch.global={GLOBAL_BATCH}"]),
    "broken": (None, _missing("swift", "transformers"), 1, []),
}


def _cli(recipe: str, work: Path, sets: list[str], *options: str) -> list[str]:
    return [sys.executable, "-m", "elastic_moe_plugin.cli", "launch", recipe, "--rehearse", "--steps", str(STEPS),
            "--rehearse-dir", str(work), *options, *[option for item in sets for option in ("--set", item)]]


@pytest.fixture(scope="module")
def rehearsals(swift_base_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rehearse")
    env = {**swift_base_env, "PYTHONPATH": ":".join(filter(None, [str(ROOT), swift_base_env.get("PYTHONPATH")]))}
    broken = tmp / "broken.yaml"
    broken.write_text(
        f"# a user overlay of the OLMoE 6-10 recipe with a flag ms-swift does not have\n"
        f"extends: [{str(ROOT / 'configs' / 'olmoe_sft' / '6-10.yaml')!r}]\n"
        "args:\n  nosuch_flag: 1\n")
    jobs = []
    for name, (recipe, missing, weight, sets) in REHEARSALS.items():
        if missing:
            continue
        job_env = env
        if name == "olmoe":  # every process records the DeepSpeed engine it builds
            probe = _probe.sitecustomize_dir(tmp / name / "probe")
            job_env = {**env, "PYTHONPATH": f"{probe}:{env['PYTHONPATH']}",
                       _probe.PROBE_ENV: str(tmp / name / "engine")}
        options = ("--nproc-per-node", "1") if name == "broken" else ()
        jobs.append(_jobs.Job(name, _cli(recipe or str(broken), tmp / name / "work", sets, *options), job_env,
                              tmp / name, weight=weight, timeout=300))
    results = _jobs.run_jobs(jobs, tmp / "logs")
    for name, result in results.items():
        print(f"rehearsal {name}: rc={result.returncode} in {result.seconds:.1f}s")
    return {name: (result, tmp / name / "work") for name, result in results.items()}


def _engines(rehearsals, name: str) -> list[dict]:
    """What ``_engine_probe.py`` recorded of each rank's DeepSpeed engine, by rank."""
    folder = rehearsals[name][1].parent / "engine"
    return [json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))]


def _get(rehearsals, name):
    recipe, missing, _, _ = REHEARSALS[name]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    return rehearsals[name]


def _swift_rows(work: Path) -> list[dict]:
    rows = []
    for path in sorted(work.rglob("logging.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if "loss" in row and "train_runtime" not in row]


def _pmf_std(schedule: str = "6-10", topk: int = 8) -> float:
    from elastic_moe_plugin.core.config import ElasticConfig

    resolved = ElasticConfig(schedule=schedule).resolve(num_experts=16, topk=topk)
    mean = sum(b * q for b, q in zip(resolved.budgets, resolved.pmf))
    return (sum(q * (b - mean) ** 2 for b, q in zip(resolved.budgets, resolved.pmf))) ** 0.5


def _tolerance(work: Path, family: str, rows_per_rank_step: int) -> float:
    """Z standard errors of a per-step mean κ over the fewest tokens one rank can route in a step."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "tiny" / family)
    rows = [json.loads(line) for line in (work / "tiny" / "train.jsonl").read_text().splitlines()]
    shortest = min(sum(len(tokenizer(m["content"])["input_ids"]) for m in row["messages"]) for row in rows)
    return Z * _pmf_std() / (rows_per_rank_step * shortest) ** 0.5


def _check_replacements(output: str, expected: list[str]) -> None:
    for line in expected:
        assert f"#   {line}" in output, line


@pytest.mark.parametrize("name", ["qwen3", "olmoe"])
def test_rehearsal_of_an_ms_swift_recipe_trains_and_logs_routing_metrics(rehearsals, name):
    result, work = _get(rehearsals, name)
    assert result.returncode == 0, result.describe()
    output = result.output
    assert "rehearsal: OK" in output
    # the replacements are printed with their reasons; the recipe's other flags stay as they are
    _check_replacements(output, [
        "args.bf16: true -> false  (bf16 mixed precision is a GPU choice)",
        "args.torch_dtype: bfloat16 -> float32  (bf16 weights are a GPU choice)",
    ])
    if name == "qwen3":
        _check_replacements(output, ["args.attention_backend: flash -> local  (flash attention is GPU-only)",
                                     "args.ddp_backend: unset -> gloo  (NCCL is GPU-only)"])
        assert "--lr 1e-05" in output and "--moe_aux_loss_coeff 0.001" in output and "--recompute_granularity full" in output
        plan = "elastic-moe plan (megatron-core, 2 MoE layers): elastic 6-10 around k=8 (σ=1.5), renormalized gate"
    else:
        _check_replacements(output, [
            "args.attn_impl: flash_attn -> sdpa  (flash attention is GPU-only)",
            "args.use_cpu: unset -> true  (no CUDA here: accelerate's CPU processes over gloo; without it DeepSpeed "
            "sizes its batch for a world of 1)",
            "args.fp16: unset -> false  (ms-swift turns fp16 on for float32 weights, and DeepSpeed's CPU accelerator "
            "refuses fp16; float32 here)"])
        assert "--optim adamw_torch_fused" in output and "--router_aux_loss_coef 0.01" in output
        # the recipe's own DeepSpeed ZeRO-2, not replaced: ms-swift reads its zero2 config, and each of the
        # 2 ranks builds a ZeRO-2 engine holding the whole model and its half of the fp32 optimizer state
        assert not [line for line in output.splitlines() if line.startswith("#   args.deepspeed")]
        assert "--deepspeed zero2" in output and "EMOE_BOOTSTRAP=engines" in output
        assert re.search(r"Using deepspeed: \{.*'zero_optimization': \{'stage': 2,", output), result.describe()
        engines = _engines(rehearsals, name)
        assert [(e["rank"], e["world"], e["stage"]) for e in engines] == [(0, 2, 2), (1, 2, 2)], engines
        total = engines[0]["params_total"]
        for engine in engines:
            assert engine["params_local"] == total and engine["params_partitioned"] == 0, engine
            assert total // 2 <= engine["optimizer_local"] < total, engine
        plan = ("elastic-moe plan (transformers, 4 MoE layers): elastic 6-10 around k=8 (σ=1.5), olmoe softmax_topk rule, "
                "full_softmax gate")
    assert plan in output, result.describe()
    rows = _swift_rows(work)
    assert len(rows) == STEPS, rows
    # qwen3: global batch 16 over 2 data-parallel ranks; olmoe: GLOBAL_BATCH rows over 2 (micro-batch 1); the
    # logged routing is rank 0's
    tolerance = _tolerance(work, "qwen3_moe", 8) if name == "qwen3" else _tolerance(work, "olmoe", GLOBAL_BATCH // 2)
    for row in rows:
        if name == "qwen3":
            # megatron sft logs as Megatron-SWIFT logs its MoE losses: layer means only (no
            # moe_per_layer_logging in the recipe); a mean over layers is within each layer's bound
            assert not [key for key in row if key.startswith("elastic_moe/layer_")], sorted(row)
            means = {"elastic_moe/mean_kappa": float(row["elastic_moe/mean_kappa"])}
        else:
            means = {key: float(value) for key, value in row.items() if key.endswith("/mean_kappa") and "/layer_" in key}
        print(f"rehearsal {name} step: loss={row['loss']} mean κ {means} (tolerance ±{tolerance:.3f})")
        assert math.isfinite(float(row["loss"])), row
        assert means and all(abs(value - 8) <= tolerance for value in means.values()), means
        for key in means:
            prefix = key.rsplit("/", 1)[0]
            assert float(row[f"{prefix}/kappa_frac_6"]) > 0 and float(row[f"{prefix}/kappa_frac_10"]) > 0


def test_rehearsal_of_the_megatron_lm_recipe_trains_and_logs_routing_metrics(rehearsals):
    result, work = _get(rehearsals, "pretrain")
    assert result.returncode == 0, result.describe()
    output = result.output
    assert "rehearsal: OK" in output
    _check_replacements(output, ["args.bf16: true -> removed  (bf16 is a GPU precision)",
                                 "args.transformer-impl: unset -> local  (Transformer Engine is GPU-only)"])
    # the one Megatron-LM CPU entry point: the recipe's own, with its --cpu flag
    assert re.search(r"-m elastic_moe_plugin\.megatron_lm \\\s+--cpu \S+pretrain_gpt", output), output[:5000]
    assert "megatron_lm_cpu" not in output and "EMOE_BOOTSTRAP=grad_clip" in output
    assert "--clip-grad 1.0" in output and "--moe-z-loss-coeff 0.001" in output
    lines = [line for line in output.splitlines() if re.search(r"\biteration\s+\d+/\s*\d+ \|", line)]
    assert len(lines) == STEPS, lines
    for line in lines:
        mean = float(re.search(r" elastic_moe/mean_kappa: ([^ |]+) \|", line).group(1))
        print(f"rehearsal pretrain: {line[line.index('iteration'):line.index('iteration') + 40]}... "
              f"elastic_moe/mean_kappa={mean}")
        # GLOBAL_BATCH / 2 sequences x 256 tokens per rank (DP 2) and step; printed with 2 decimals
        assert abs(mean - 8) <= Z * _pmf_std() / (GLOBAL_BATCH // 2 * 256) ** 0.5 + 0.005
        # elastic, not static: a static top-8 run changes no top-k set (this is 1 - q(8) ≈ 0.71)
        assert float(re.search(r" elastic_moe/topk_set_changed_frac: ([^ |]+) \|", line).group(1)) > 0.5
    assert (work / "checkpoints" / "pretrain" / "6-10" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)


def test_a_flag_ms_swift_does_not_know_fails_the_rehearsal_with_ms_swifts_message_before_any_step(rehearsals):
    result, work = _get(rehearsals, "broken")
    assert result.returncode != 0, result.describe()
    assert "ValueError: remaining_argv: ['--nosuch_flag', '1']" in result.output, result.describe()
    assert "rehearsal: the launcher exited with status" in result.output
    assert _swift_rows(work) == []
    assert "Train:" not in result.output


def test_the_cpu_bootstrap_clears_transformer_engines_attention_switches():
    """A shell set up for GPUs (or a process that built a megatron-core model) may hold
    NVTE_FLASH_ATTN=1; megatron-core then asserts under the CPU flags' --attention_backend local.
    Every process the child bootstrap starts with ``megatron_swift`` runs without the three switches."""
    import os
    import subprocess

    from elastic_moe_plugin.tools import child_bootstrap

    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    env = {**os.environ, **child_bootstrap.environment(["megatron_swift"], str(Path(__file__).parents[2])),
           "NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0", "CUDA_VISIBLE_DEVICES": ""}
    code = f"import os, json; print(json.dumps([os.environ.get(n) for n in {names!r}]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [None, None, None]
    # the bootstrap on the path without the feature named, and without the bootstrap: the variable stays
    for control in ({**env, child_bootstrap.BOOTSTRAP_ENV: ""}, {**env, "PYTHONPATH": ""}):
        kept = subprocess.run([sys.executable, "-c", "import os; print(os.environ['NVTE_FLASH_ATTN'])"],
                              capture_output=True, text=True, env=control, timeout=120)
        assert kept.stdout.strip() == "1", kept.stderr[-2000:]
