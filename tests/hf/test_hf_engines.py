"""The transformers door under the distributed engines its users scale out with: DeepSpeed ZeRO-2,
ZeRO-3 (the model built inside ``zero.Init``) and FSDP2, each on 2 CPU processes with gloo
(``tests/fixtures/hf/engine_training.py``: one torchrun world runs all three engines in turn, tiny
OLMoE and tiny Qwen3-MoE under each, stock and with the plugin).

Asserted for every engine and both families:

- **the engine really shards**: ZeRO-3 leaves each process an empty local shard of the router's
  weight outside its forward (``ds_shape`` the full [E, H]), FSDP2 a DTensor row shard [E/2, H];
  ZeRO-2 keeps full parameters;
- **static is stock, digit for digit**: ``schedule="static"`` gives the stock run's loss at every step
  on every process; so does κ ≡ k drawn through the elastic code path (schedule 1-3 with σ = 1e-3,
  whose outer budgets have probability exactly 0) for OLMoE. Qwen3-MoE's renormalised softmax
  differentiates through the plugin's own backward (``RenormalizedProbs``, docs/gates.md), which
  agrees with autograd's to float32 rounding, not bitwise: its point-mass losses equal stock's at
  step 1 (before any update) and stay within 1e-5 after (the elastic run is more than 1e-4 away);
- **independent κ per process**: every process's κ is the closed form of ``core.budget_stream`` at
  (seed, counter, its data-parallel rank), the processes' uniforms are disjoint, and their counters
  stay in step;
- **κ follows the pmf on every process**: the shares of 1, 2 and 3 over 2 layers × 4 steps × 128
  tokens within 4.5 standard errors of q;
- **expert rows = Σκ per process**: the rows each layer's experts multiplied, counted at the GEMMs
  (``counters.ExpertRows``; under ZeRO-3 with the weights gathered for the forward, under FSDP2
  unsharded), equal that process's Σκ of the layer;
- **the engine does not change the routing**: the elastic run's step-1 losses are the same digits
  under all three engines, the later ones within float32 rounding;
- **resume from the engine's checkpoint** (DeepSpeed's, FSDP2's distributed checkpoint) continues κ,
  and the loss, exactly on every process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from elastic_moe_plugin import ElasticConfig
from elastic_moe_plugin.core.budget_stream import BudgetStream
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET

pytestmark = [pytest.mark.hf, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "fixtures" / "hf" / "engine_training.py"
ENGINES = ("zero2", "zero3", "fsdp2")
FAMILIES = ("olmoe", "qwen3_moe")
WORLD, STEPS, SAVE_AT, LAYERS, TOKENS = 2, 4, 2, 2, 128
SCHEDULE = ElasticConfig(schedule="1-3").budget_schedule(2)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[str, list[dict]]:
    """engine -> the results of process 0 and process 1 (one torchrun world for all engines)."""
    output = tmp_path_factory.mktemp("engines")
    drop = ("ELASTIC_MOE_", "MASTER_", "TORCHELASTIC_", "PET_", "ACCELERATE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               str(WORKER), ",".join(ENGINES), str(output)]
    with open(output / "log", "w") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=output, timeout=900)
    assert completed.returncode == 0, (output / "log").read_text()[-8000:]
    per_rank = [json.loads((output / f"{rank}.json").read_text()) for rank in range(WORLD)]
    return {engine: [result[engine] for result in per_rank] for engine in ENGINES}


def _steps(run: dict) -> list[dict]:
    return [run[str(step)] for step in sorted(map(int, run))]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_engine_shards_what_it_claims(worlds, engine):
    for rank, result in enumerate(worlds[engine]):
        for family in FAMILIES:
            seen = result[family]["sharding"]
            assert seen["full_shape"] == [8, 64], (engine, rank, family, seen)
            expected = {"zero2": [8, 64], "zero3": [0], "fsdp2": [4, 64]}[engine]
            assert seen["local_shape"] == expected, (engine, rank, family, seen)


@pytest.mark.parametrize("engine", ENGINES)
def test_static_and_kappa_equal_to_k_give_the_stock_losses(worlds, engine):
    for rank, result in enumerate(worlds[engine]):
        for family in FAMILIES:
            runs = result[family]
            stock = [step["loss"] for step in _steps(runs["stock"])]
            assert len(stock) == STEPS and all(math.isfinite(loss) for loss in stock)
            assert [step["loss"] for step in _steps(runs["static"])] == stock, (engine, rank, family)
            point_mass = [step["loss"] for step in _steps(runs["point_mass"])]
            assert all(set(kappa) == {2} for step in _steps(runs["point_mass"]) for kappa in step["kappa"].values())
            elastic = [step["loss"] for step in _steps(runs["elastic"])]
            assert max(abs(a - b) for a, b in zip(elastic, stock)) > 1e-4  # the comparison can fail
            if family == "olmoe":
                assert point_mass == stock, (engine, rank, family)
            else:
                assert point_mass[0] == stock[0], (engine, rank, family)
                assert max(abs(a - b) for a, b in zip(point_mass, stock)) < 1e-5, (engine, rank, point_mass, stock)


def test_the_elastic_runs_are_the_same_under_every_engine(worlds):
    """The engines shard parameters, gradients and optimizer states, never the routing: each
    process's elastic loss of step 1 (router, experts and aux loss on realised counts, before any
    update) is the same digits under all three, and the later steps agree to float32 rounding (ZeRO-3
    reduces gradients in buckets of its own, so its updates differ from the others' in the last
    bits, as its stock run's do). ZeRO-3 hands every module new tensor objects; with the routers'
    marks keyed by object identity, its experts computed all T·b slots and the aux loss recounted a
    static top-3: its step-1 losses differed by more than 1e-3."""
    for rank in range(WORLD):
        for family in FAMILIES:
            losses = {engine: [step["loss"] for step in _steps(worlds[engine][rank][family]["elastic"])]
                      for engine in ENGINES}
            assert losses["zero2"][0] == losses["zero3"][0] == losses["fsdp2"][0], (rank, family, losses)
            assert all(abs(a - b) < 1e-5 for engine in ENGINES for a, b in zip(losses[engine], losses["zero2"])), (
                rank, family, losses)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_process_draws_its_own_kappa_in_step(worlds, engine):
    for family in FAMILIES:
        per_rank = [_steps(result[family]["elastic"]) for result in worlds[engine]]
        for step in range(STEPS):
            seen = [steps[step] for steps in per_rank]
            assert {(s["counter"], s["seed"]) for s in seen} == {(LAYERS * step, BUDGET_SEED_OFFSET)}, (engine, step)
            assert [s["shard"] for s in seen] == list(range(WORLD))
            assert [s["tokens"] for s in seen] == [TOKENS] * WORLD
            for layer in range(LAYERS):
                stream = BudgetStream(BUDGET_SEED_OFFSET, seen[0]["counter"] + layer)
                for rank, s in enumerate(seen):
                    expected = stream.draw(SCHEDULE, "iid", rank, TOKENS)[0].budgets.tolist()
                    assert s["kappa"][str(layer)] == expected, (engine, family, step, layer, rank)
                assert np.intersect1d(stream.uniforms(0, TOKENS), stream.uniforms(1, TOKENS)).size == 0
            assert seen[0]["kappa"] != seen[1]["kappa"]


@pytest.mark.parametrize("engine", ENGINES)
def test_kappa_follows_the_pmf_on_every_process(worlds, engine):
    for rank, result in enumerate(worlds[engine]):
        budgets = np.concatenate([kappa for step in _steps(result["olmoe"]["elastic"]) for kappa in step["kappa"].values()])
        assert budgets.size == STEPS * LAYERS * TOKENS
        for budget in SCHEDULE.budgets:
            q = SCHEDULE.probability(budget)
            share = float(np.mean(budgets == budget))
            assert abs(share - q) < 4.5 * math.sqrt(q * (1 - q) / budgets.size), (engine, rank, budget, share, q)


@pytest.mark.parametrize("engine", ENGINES)
def test_expert_rows_equal_the_sum_of_kappa_on_every_process(worlds, engine):
    for rank, result in enumerate(worlds[engine]):
        for family in FAMILIES:
            for run in ("elastic", "point_mass"):
                for step in _steps(result[family][run]):
                    assert step["rows"] == {layer: sum(kappa) for layer, kappa in step["kappa"].items()}, (
                        engine, rank, family, run)
            assert any(sum(kappa) != TOKENS * 2 for step in _steps(result[family]["elastic"])
                       for kappa in step["kappa"].values())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_run_resumed_from_the_engines_checkpoint_continues_kappa_exactly(worlds, engine):
    for rank, result in enumerate(worlds[engine]):
        for family in FAMILIES:
            full, resumed = result[family]["elastic"], result[family]["resumed"]
            assert sorted(map(int, resumed)) == list(range(SAVE_AT + 1, STEPS + 1)), (engine, rank, family)
            for step in resumed:
                assert resumed[step]["kappa"] == full[step]["kappa"], (engine, rank, family, step)
                assert resumed[step]["loss"] == full[step]["loss"], (engine, rank, family, step)
