"""κ's stream across the processes of a transformers ``Trainer`` run (DDP on gloo, CPU), each with
a different padding-free T on every step (``tests/fixtures/hf/trainer_kappa_stream.py``).

On 2 processes (the 4-process world of the Megatron-LM twin, test_megatron_lm_kappa_stream.py, proves the
same draw with more shards):

- every process's κ is the closed form of ``core.budget_stream`` at (seed, counter, its shard =
  its data-parallel rank), the shards' uniforms are pairwise disjoint (before, every process drew
  the same uniforms, so their κ were correlated), and the counters stay in step although T differs;
- the run saved at step 3 and resumed (with κ's stream and the default generator moved first)
  draws every process's κ of steps 4-6 exactly as the uninterrupted run did: each process restores
  the state from its own ``rng_state_<rank>.pth``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig
from elastic_moe_plugin.core.budget_stream import BudgetStream
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET

pytestmark = [pytest.mark.hf, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "fixtures" / "hf" / "trainer_kappa_stream.py"
STEPS, SAVE_AT, LAYERS = 6, 3, 2


@pytest.fixture(scope="module", params=[2], ids=lambda world: f"world{world}")
def runs(request, tmp_path_factory):
    world = request.param
    output = tmp_path_factory.mktemp(f"trainer_world{world}")
    drop = ("ELASTIC_MOE_", "MASTER_", "TORCHELASTIC_", "PET_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(WORKER), str(output)]
    with open(output / "log", "w") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=output, timeout=600)
    assert completed.returncode == 0, (output / "log").read_text()[-6000:]
    return world, [json.loads((output / f"kappa_{rank}.json").read_text()) for rank in range(world)]


def test_every_process_draws_its_own_shard_in_step_whatever_its_t(runs):
    world, per_rank = runs
    schedule = ElasticConfig(schedule="1-3").budget_schedule(2)
    for step in range(1, STEPS + 1):
        seen = [result["full"][str(step)] for result in per_rank]
        assert {(s["counter"], s["seed"]) for s in seen} == {(LAYERS * (step - 1), BUDGET_SEED_OFFSET)}, step
        assert [s["shard"] for s in seen] == list(range(world))
        tokens = [s["tokens"] for s in seen]
        assert len(set(tokens)) == world, f"step {step}: every process should hold another T, got {tokens}"
        for layer in range(LAYERS):
            stream = BudgetStream(BUDGET_SEED_OFFSET, seen[0]["counter"] + layer)
            for rank, s in enumerate(seen):
                expected = stream.draw(schedule, "iid", rank, s["tokens"])[0].budgets.tolist()
                assert s["kappa"][str(layer)] == expected, f"step {step}, layer {layer}, process {rank}"
            uniforms = [stream.uniforms(rank, s["tokens"]) for rank, s in enumerate(seen)]
            assert all(np.intersect1d(uniforms[a], uniforms[b]).size == 0
                       for a in range(world) for b in range(a + 1, world)), (step, layer)


def test_a_resumed_trainer_run_replays_every_processs_kappa(runs):
    world, per_rank = runs
    for rank, result in enumerate(per_rank):
        assert sorted(result["resumed"], key=int) == [str(step) for step in range(SAVE_AT + 1, STEPS + 1)]
        for step in range(SAVE_AT + 1, STEPS + 1):
            assert result["resumed"][str(step)] == result["full"][str(step)], f"process {rank}, step {step}"
