"""The torchtitan pretraining recipe (``configs/pretrain_titan/``) run and parsed by torchtitan itself.

- ``elastic-moe launch pretrain_titan/6-10 --rehearse``, as a user runs it: the recipe's own launcher
  (``torchrun -m torchtitan.train`` with the recipe's flags and the door in ``--override.imports``)
  on 2 CPU processes under the child bootstrap's ``titan`` feature, for 3 steps of the tiny model of
  the same family (``eer_tiny``: 4 layers, 20 experts, top-8), with its tokenizer and FineWeb-Edu
  stand-in written locally. ``--set batch.global=16`` (the recipe's 256 sequences are 32
  micro-batches a step on each of 2 CPU processes, ~40 s a step; the accumulation code is the same
  at 2), ~45 s in all.
- every recipe of the setting through torchtitan's own ``ConfigManager`` (``python -m
  elastic_moe_plugin.tools.recipes.argcheck``): the flags parse, the door's JSON is the recipe's
  ``ElasticConfig``, and the model ``--config`` builds has the parameters of the ``model:`` block
  (1,426,784,256 total, 365,101,056 active at top-8, plus 34,048 norm weights).

How close κ's shares must be to the 6-10 pmf: each token draws κ independently (``sampling: iid``),
so one logged step's share of κ = b over N tokens has standard error √(q_b (1 - q_b) / N); N is at
least one rank's tokens of a step (micro 4 x 256 tokens x 2 micro-batches = 2048). The tolerance is
4.5 standard errors (a chance failure per comparison below 1e-5; 60 comparisons).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.tools.recipes.load import list_recipe_files

pytestmark = [pytest.mark.titan, pytest.mark.slow]

GLOBAL_BATCH, STEPS, TOKENS_PER_RANK, Z = 16, 3, 4 * 256 * 2, 4.5
LAYERS = ("0", "1", "2", "3")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
CLEAN_PREFIXES = ("ELASTIC_MOE_", "SLURM_", "PET_", "TORCHELASTIC_")
CLEAN_NAMES = {"NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "LOCAL_RANK", "GROUP_RANK",
               "RANK", "WORLD_SIZE", "EMOE_BOOTSTRAP"}  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN_PREFIXES) and k not in CLEAN_NAMES}
    env.update(OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", PYTHONUNBUFFERED="1")
    return env


def _scalars(work: Path) -> dict[str, list[tuple[int, float]]]:
    """The TensorBoard scalars the rehearsal's torchtitan wrote (``--metrics.enable_tensorboard``)."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    (events,) = work.glob("checkpoints/pretrain_titan/6-10/tb/*/events.out.tfevents.*")
    accumulator = event_accumulator.EventAccumulator(str(events))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_the_torchtitan_recipe_rehearses_three_steps_of_elastic_6_10(tmp_path):
    work = tmp_path / "work"
    command = [sys.executable, "-m", "elastic_moe_plugin.cli", "launch", "pretrain_titan/6-10", "--rehearse",
               "--rehearse-dir", str(work), "--set", f"batch.global={GLOBAL_BATCH}"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    out = ANSI.sub("", done.stdout + done.stderr)
    assert done.returncode == 0, out[-8000:]
    assert f"rehearsal: OK: {STEPS} steps of configs/pretrain_titan/6-10.yaml through torchtitan" in out
    # the replacements it printed, and the recipe's own launcher under the CPU runtime
    assert "#   args.config: eer_1p42b_a365m -> eer_tiny  (" in out
    assert "-> 1 node x 2 CPU processes (gloo), tp=1, pp=1, cp=1, ep=2, etp=1" in out
    assert "EMOE_BOOTSTRAP=titan" in out and "-m torchtitan.train" in out
    # the door, applied through --override.imports on every rank, planned 6-10 around the tiny model's top-8
    assert "elastic-moe plan (torchtitan, 4 MoE layers): elastic 6-10 around k=8 (σ=1.5), torchtitan softmax+bias" in out
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"INFO - step:\s+(\d+)\s+loss:\s+([0-9.]+)", out)}
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(loss) and 0 < loss < 10 for loss in losses.values())
    logged = {int(m[1]) for m in re.finditer(r"elastic-moe: step (\d+): mean_kappa ([0-9.]+)", out)}
    assert logged == {1, 2, 3}
    assert re.search(r"validate step:\s+1\s+loss:", out)  # the recipe's validator, one batch
    assert (work / "checkpoints" / "pretrain_titan" / "6-10" / "checkpoint" / f"step-{STEPS}").is_dir()

    schedule = ElasticConfig(schedule="6-10").budget_schedule(8)
    scalars = _scalars(work)
    assert [step for step, _ in scalars["loss_metrics/global_avg_loss"]] == [1, 2, 3]
    for layer in LAYERS:
        prefix = f"elastic_moe/layer_{layer}/kappa_frac_"
        assert sorted(int(tag.removeprefix(prefix)) for tag in scalars if tag.startswith(prefix)) == [6, 7, 8, 9, 10]
        for step in range(STEPS):
            shares = {b: scalars[f"{prefix}{b}"][step][1] for b in range(6, 11)}
            assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
            for budget, share in shares.items():
                q = schedule.probability(budget)
                assert abs(share - q) <= Z * math.sqrt(q * (1 - q) / TOKENS_PER_RANK), (layer, step, budget, share, q)
            mean = scalars[f"elastic_moe/layer_{layer}/mean_kappa"][step][1]
            assert abs(mean - 8) <= Z * schedule.std / math.sqrt(TOKENS_PER_RANK), (layer, step, mean)


def test_torchtitan_parses_every_recipe_of_the_setting():
    names = [name for name, _ in list_recipe_files() if name.startswith("pretrain_titan/")]
    assert len(names) == 11
    command = [sys.executable, "-m", "elastic_moe_plugin.tools.recipes.argcheck", "--json", *names]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout)["recipes"]
    for name in names:
        entry = results[name]
        assert entry["ok"], (name, entry.get("error"), entry.get("skipped"))
        assert "torchtitan ConfigManager parser (tyro) and Trainer.Config checks" in entry["checked"]
        assert "elastic_moe_plugin.titan.elastic_moe JSON = the recipe's ElasticConfig" in entry["checked"]
        (counted,) = [check for check in entry["checked"] if check.startswith("model ")]
        assert "1,426,818,304 parameters" in counted and "1,426,784,256" in counted and "34,048 norm weights" in counted
