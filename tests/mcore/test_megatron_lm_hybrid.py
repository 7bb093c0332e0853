"""Megatron-LM's own training loop with a ``HybridModel`` and the plugin, on the CPU.

``examples/megatron_lm/pretrain_hybrid_moe.py`` (Megatron's argument parsing, ``HybridModelConfig``
from the flags, ``pretrain``, ``training_log``, mock data) runs under torchrun
on gloo through ``tests/fixtures/megatron_lm/run_on_cpu.py``, i.e. the front door
``python -m elastic_moe_plugin.megatron_lm --cpu`` plus the test-only observer of experts per token
(``--stock``: the script without the plugin, on the same CPU runtime). The model: pattern
``*E*E*E*E`` (8 layers, MoE layers 1, 3, 5, 7), 4 experts top-2, alltoall dispatcher, aux loss; the
elastic runs route layers 3 and 5 with schedule 1-3 (``--elastic-moe-layers 3-5``). No run passes
``--spec``: the front door adds the CPU runtime's local stack spec; the stock run, which bypasses the
front door, names that spec itself (the argument a user of stock Megatron-LM would pass).

Three runs (the tiny GPT model's settings of ``test_megatron_lm.py``, 5 iterations of 2 micro-batches
of 4 x 32 tokens, dropout off), two processes at a time: stock, static, and elastic (TensorBoard
with ``--moe-per-layer-logging``). Resume and TP=2 with sequence parallelism go through the same
router code in a hybrid stack as in a GPT one: ``test_megatron_lm.py`` proves them through the trainer. Skipped where
``test_megatron_lm.py`` is, and where megatron-core has no ``HybridModel``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_moe_plugin import ElasticConfig
from elastic_moe_plugin.megatron_lm import CPU_HYBRID_SPEC

# the GPT module's tiny-model flags, log reader, environment and skip rule (tests/mcore is on sys.path)
from test_megatron_lm import MEGATRON_ARGS as GPT_ARGS  # isort: skip
from test_megatron_lm import Result, _environment, _scalars, _skip_reason  # isort: skip

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "megatron_lm" / "pretrain_hybrid_moe.py"
LAUNCHER = REPO / "tests" / "fixtures" / "megatron_lm" / "run_on_cpu.py"

PATTERN, EXPERTS, TOPK, ITERS, FORWARDS_PER_ITERATION, TOKENS_PER_FORWARD = "*E*E*E*E", 4, 2, 5, 2, 4 * 32
MOE_LAYERS, ELASTIC_LAYERS, STATIC_LAYERS = (1, 3, 5, 7), (3, 5), (1, 7)
SCHEDULE = "1-3"
ELASTIC = ["--elastic-moe-schedule", SCHEDULE, "--elastic-moe-layers", "3-5"]
METRICS = ("mean_kappa", "retained_weight_sum_mean", "tokens_per_expert_max_over_mean")


def _hybrid_args() -> list[str]:
    """The GPT test's tiny-model flags, the layers spelled by the pattern instead of ``--num-layers``."""
    args, skip = [], 0
    for arg in GPT_ARGS:
        if skip:
            skip -= 1
        elif arg in ("--num-layers", "--train-iters"):
            skip = 1
        else:
            args.append(arg)
    return [*args, "--hybrid-layer-pattern", PATTERN, "--train-iters", str(ITERS)]


MEGATRON_ARGS = _hybrid_args()


def _module_skip_reason() -> str | None:
    if _skip_reason():
        return _skip_reason()
    if importlib.util.find_spec("megatron.core.models.hybrid") is None:
        return "this megatron-core has no megatron.core.models.hybrid (HybridModel: 0.19+)"
    return None


pytestmark = [pytest.mark.megatron, pytest.mark.slow]
if _module_skip_reason():
    pytestmark.append(pytest.mark.skip(reason=_module_skip_reason()))


# ====================================================================================== the runs
@dataclasses.dataclass
class Run:
    args: list[str]
    nproc: int = 1
    stock: bool = False
    after: tuple[str, ...] = ()  # runs whose checkpoints this one loads
    env: tuple[tuple[str, str], ...] = ()


def _runs(tmp: Path) -> dict[str, Run]:
    per_layer = ["--moe-per-layer-logging"]
    return {
        "stock": Run([*CPU_HYBRID_SPEC, "--tensorboard-dir", str(tmp / "tb_stock"), *per_layer], stock=True),
        "static": Run(["--elastic-moe-schedule", "static"]),
        "elastic": Run([*ELASTIC, "--tensorboard-dir", str(tmp / "tb_elastic"), *per_layer]),
    }


def _start(name: str, run: Run, tmp: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(run.nproc),
               str(LAUNCHER), *(["--stock"] if run.stock else []), str(SCRIPT), *MEGATRON_ARGS, *run.args]
    env = {**_environment(), "RUN_ON_CPU_OBSERVE": str(tmp / f"observed_{name}"), **dict(run.env)}
    with open(tmp / f"{name}.log", "w") as log:  # a file, not a pipe: nobody reads a pipe while runs overlap
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp)


def _collect(name: str, process: subprocess.Popen, tmp: Path) -> Result:
    process.wait()
    observed = {int(path.suffix[1:]): {int(layer): forwards for layer, forwards in json.loads(path.read_text()).items()}
                for path in tmp.glob(f"observed_{name}.*")}
    return Result(name, process.returncode, (tmp / f"{name}.log").read_text(), observed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Result]:
    """Every run, two processes at a time."""
    tmp = tmp_path_factory.mktemp("megatron_lm_hybrid")
    pending, running, done = dict(_runs(tmp)), {}, {}
    deadline = time.monotonic() + 600
    while pending or running:
        for name, (process, run) in list(running.items()):
            if process.poll() is not None:
                done[name] = _collect(name, process, tmp)
                del running[name]
        busy = sum(run.nproc for _, run in running.values())
        for name, run in list(pending.items()):
            if all(dep in done for dep in run.after) and (busy == 0 or busy + run.nproc <= 2):
                running[name] = (_start(name, run, tmp), run)
                busy += run.nproc
                del pending[name]
        if time.monotonic() > deadline:
            for process, _ in running.values():
                process.kill()
            pytest.fail(f"Megatron-LM hybrid runs still running after 10 minutes: {sorted(running)}")
        time.sleep(0.2)
    done["tmp"] = tmp
    return done


def _ok(runs, name) -> Result:
    result = runs[name]
    assert result.returncode == 0, f"run {name!r} failed (exit {result.returncode}):\n{result.output[-6000:]}"
    return result


def _step_mean_kappa(result: Result, layer: int, iteration: int, rank: int = 0) -> float:
    """Mean experts per token the router of ``layer`` handed its dispatcher in ``iteration`` (both micro-batches)."""
    start = FORWARDS_PER_ITERATION * (iteration - 1)
    forwards = result.observed[rank][layer][start:start + FORWARDS_PER_ITERATION]
    tokens = sum(sum(counts) for counts in forwards)
    return sum(kappa * count for counts in forwards for kappa, count in enumerate(counts)) / tokens


# ====================================================================================== static == stock
def test_static_prints_the_loss_lines_of_stock_megatron_digit_for_digit(runs):
    stock, static = _ok(runs, "stock"), _ok(runs, "static")
    assert sorted(stock.lines()) == sorted(static.lines()) == list(range(1, ITERS + 1))
    for iteration, line in stock.lines().items():
        assert static.lines()[iteration] == line, f"iteration {iteration}"
        assert "lm loss:" in line and "load_balancing_loss:" in line and "elastic_moe/" not in static.lines()[iteration]
    # the front door supplied the spec the stock run names itself: the same model
    assert f"added {' '.join(CPU_HYBRID_SPEC)}" in static.output and "added --spec" not in stock.output
    spec_line = re.compile(r"^\s*spec \.+ \['elastic_moe_plugin\.cpu_runtime\.hybrid', 'hybrid_stack_spec'\]$", re.M)
    assert spec_line.search(static.output) and spec_line.search(stock.output)
    assert "hybrid_layer_pattern ............................ *E*E*E*E" in static.output


# ====================================================================================== elastic κ
def test_kappa_follows_the_pmf_on_layers_3_and_5_and_is_k_on_1_and_7(runs):
    """Per forward the observer's histogram of experts per token; layers 3 and 5 pooled (2 x 1280
    draws): each κ's share within 4 binomial standard deviations of the pmf (κ i.i.d. from it: a
    correct draw fails with probability < 1e-4 per share; seeded, so the outcome is fixed)."""
    elastic = _ok(runs, "elastic")
    schedule = ElasticConfig(schedule=SCHEDULE).budget_schedule(TOPK)
    assert sorted(elastic.observed[0]) == list(MOE_LAYERS)  # only the E symbols route
    for layer in STATIC_LAYERS:
        assert elastic.observed[0][layer] == [[0, 0, TOKENS_PER_FORWARD, 0, 0]] * (ITERS * FORWARDS_PER_ITERATION)
    totals = [0] * (EXPERTS + 1)
    for layer in ELASTIC_LAYERS:
        forwards = elastic.observed[0][layer]
        assert len(forwards) == ITERS * FORWARDS_PER_ITERATION
        assert all(sum(counts) == TOKENS_PER_FORWARD for counts in forwards)
        totals = [a + sum(column) for a, column in zip(totals, zip(*forwards))]
    draws = sum(totals)
    assert totals[0] == 0 and all(count == 0 for count in totals[schedule.high + 1:]), totals
    for budget, probability in zip(schedule.budgets, schedule.pmf):
        share, sd = totals[budget] / draws, math.sqrt(probability * (1 - probability) / draws)
        assert abs(share - probability) < 4 * sd, f"κ={budget}: {share:.4f} vs {probability:.4f}"


def test_the_plan_line_names_the_layer_numbers_and_their_moe_index(runs):
    """Printed once, once Megatron-LM has built the model; the static run routes nothing elastically,
    so it says so (rank 0 only: ``test_hf_plan_and_static_layers.py``, the same ``core.plan`` line)."""
    plan = ("elastic-moe plan (megatron-core, 4 MoE layers): elastic 1-3 around k=2 (σ=1.5), renormalized gate, "
            "iid sampling: layers 3, 5 (MoE layers 1-2); static top-2: layers 1, 7 (MoE layers 0, 3)")
    elastic = _ok(runs, "elastic")
    assert elastic.output.count(plan) == 1, elastic.output[-3000:]
    assert "elastic-moe plan" not in _ok(runs, "stock").output
    assert "elastic-moe plan (megatron-core, 4 MoE layers): elastic: none" in _ok(runs, "static").output


def test_console_metrics_are_the_mean_over_the_elastic_moe_layers(runs):
    """mean κ is the mean over layers 3 and 5 (2 layers, not the pattern's 8 symbols nor its 4 MoE
    layers) of the κ those routers handed their dispatcher in the step: ~ k = 2; the renormalised
    gate keeps weight sum 1; max/mean tokens per expert >= 1. The console prints 2 decimals."""
    elastic = _ok(runs, "elastic")
    assert sorted(elastic.lines()) == list(range(1, ITERS + 1))
    for iteration, line in elastic.lines().items():
        for name in METRICS:
            assert f" elastic_moe/{name}: " in line, line
        expected = sum(_step_mean_kappa(elastic, layer, iteration) for layer in ELASTIC_LAYERS) / len(ELASTIC_LAYERS)
        assert elastic.value(iteration, "elastic_moe/mean_kappa") == pytest.approx(expected, abs=0.005 + 1e-9)
        assert abs(elastic.value(iteration, "elastic_moe/mean_kappa") - TOPK) < 0.25
        assert elastic.value(iteration, "elastic_moe/retained_weight_sum_mean") == 1.0
        assert elastic.value(iteration, "elastic_moe/tokens_per_expert_max_over_mean") >= 1.0


def test_tensorboard_scalars_are_the_mean_of_the_per_layer_values_of_the_elastic_layers(runs):
    elastic, _ = _ok(runs, "elastic"), _ok(runs, "stock")
    ours, stock = _scalars(runs["tmp"] / "tb_elastic"), _scalars(runs["tmp"] / "tb_stock")
    assert set(stock) == {tag for tag in ours if "elastic_moe" not in tag}, "Megatron's own tags must be unchanged"
    for step in range(1, ITERS + 1):
        for name in METRICS:
            per_layer = [ours[f"moe/elastic_moe/{name}_layer_{layer}"][step] for layer in ELASTIC_LAYERS]
            assert ours[f"elastic_moe/{name}"][step] == pytest.approx(sum(per_layer) / len(per_layer), abs=1e-5), (
                step, name)
            # the console prints the same layer mean (one rank: no data-parallel average) to 2 decimals
            assert elastic.value(step, f"elastic_moe/{name}") == pytest.approx(ours[f"elastic_moe/{name}"][step],
                                                                                abs=0.005 + 1e-6), (step, name)
        # Megatron writes every layer position; the pattern's other positions hold no elastic router
        assert all(ours[f"moe/elastic_moe/mean_kappa_layer_{layer}"][step] == 0
                   for layer in range(len(PATTERN)) if layer not in ELASTIC_LAYERS)
        for layer in ELASTIC_LAYERS:
            observed = _step_mean_kappa(elastic, layer, step)
            assert ours[f"moe/elastic_moe/mean_kappa_layer_{layer}"][step] == pytest.approx(observed, abs=1e-5)
        assert ours["elastic_moe/retained_weight_sum_mean"][step] == pytest.approx(1.0, abs=1e-6)
        assert ours["elastic_moe/tokens_per_expert_max_over_mean"][step] >= 1.0
        assert abs(ours["elastic_moe/mean_kappa"][step] - TOPK) < 0.25
