"""κ's stream at scale, through Megatron-LM's own trainer: ranks with a different T on every step.

``tests/fixtures/megatron_lm/variable_length_pretrain.py`` (the example script with micro-batches cut
to a length that differs per rank and step) runs under torchrun on gloo, on CPU, through
``python -m elastic_moe_plugin.megatron_lm``, on 4 ranks (DP=4, EP=2: a world of 2 ranks would prove
nothing more). It runs 6 iterations saving at 3, then resumes from that checkpoint to 6. The fixture records, per
router forward, κ per token, the stream's draw counter and seed, and the router's token shard.

What the tests hold (``docs/parallelism.md#randomness``):

- every rank's κ is the closed form of ``core.budget_stream`` at (seed, counter, its shard): it
  generated its own T uniforms, and the shards' uniforms are pairwise disjoint;
- the counters stay in step on every rank although T differs on every step;
- the resumed run's κ on iterations 4-6 equals the uninterrupted run's on every rank, although
  Megatron restores data-parallel rank 0's RNG states on all of them.

T = 0 is not reachable here (Megatron's GPT model needs tokens); the draw at T = 0 is tested at the
router (``test_mcore_budget_rng.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic_moe_plugin import ElasticConfig
from elastic_moe_plugin.core.budget_stream import BudgetStream
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "fixtures" / "megatron_lm" / "variable_length_pretrain.py"
LAUNCHER = REPO / "tests" / "fixtures" / "megatron_lm" / "run_on_cpu.py"

LAYERS, EXPERTS, TOPK, SEQ, MICRO_BATCH, ITERS, SAVE_AT, SEED = 2, 4, 2, 32, 2, 6, 3, 1234
SCHEDULE = "1-3"
MEGATRON_ARGS = [
    "--num-layers", str(LAYERS), "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
    "--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", "32",
    "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "0.01", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--micro-batch-size", str(MICRO_BATCH), "--train-iters", str(ITERS),
    "--lr", "1e-3", "--seed", str(SEED), "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-gelu-fusion", "--disable-bias-linear",
    "--clip-grad", "0", "--elastic-moe-schedule", SCHEDULE, "--elastic-moe-log-metrics", "false",
]
WORLDS = {4: ["--expert-model-parallel-size", "2"]}


def _skip_reason() -> str | None:
    import importlib.util

    core, training = importlib.util.find_spec("megatron.core"), importlib.util.find_spec("megatron.training")
    if core is None:
        return "megatron-core is not installed"
    if training is None:
        return "this megatron-core ships no megatron.training"
    if Path(core.origin).parents[1] != Path(training.origin).parents[1]:
        return ("megatron.training is not the one of the imported megatron.core (the megatron-core 0.16.1 wheel "
                "ships none, and the 0.19.2 wheel's needs megatron.core 0.19)")
    return None


pytestmark = [pytest.mark.megatron, pytest.mark.slow]
if _skip_reason():
    pytestmark.append(pytest.mark.skip(reason=_skip_reason()))


def _environment() -> dict[str, str]:
    drop = ("ELASTIC_MOE_", "MASTER_", "TORCHELASTIC_", "PET_", "RUN_ON_CPU_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(TORCH_COMPILE_DISABLE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NO_VCS_VERSION="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return env


def _run(tmp: Path, name: str, world: int, extra: list[str]) -> list[list[dict]]:
    """One torchrun; per rank, the router forwards the fixture observed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(LAUNCHER), str(SCRIPT), *MEGATRON_ARGS, "--global-batch-size", str(MICRO_BATCH * world),
               *WORLDS[world], *extra]
    env = {**_environment(), "KAPPA_OBSERVE": str(tmp / f"kappa_{name}")}
    log = tmp / f"{name}.log"
    with open(log, "w") as handle:
        completed = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=tmp, timeout=600)
    assert completed.returncode == 0, f"run {name!r} failed:\n{log.read_text()[-6000:]}"
    return [json.loads((tmp / f"kappa_{name}.{rank}").read_text()) for rank in range(world)]


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda world: f"world{world}")
def runs(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"kappa_world{world}")
    checkpoint = str(tmp / "checkpoint")
    full = _run(tmp, "full", world, ["--save", checkpoint, "--save-interval", str(SAVE_AT)])
    resumed = _run(tmp, "resumed", world, ["--load", checkpoint, "--ckpt-step", str(SAVE_AT)])
    return world, full, resumed


def _schedule():
    return ElasticConfig(schedule=SCHEDULE).budget_schedule(TOPK)


def test_every_rank_draws_its_own_shard_of_the_stream_in_step_whatever_its_t(runs):
    world, full, _ = runs
    schedule = _schedule()
    forwards = len(full[0])
    assert forwards == ITERS * LAYERS and all(len(per_rank) == forwards for per_rank in full)
    for index in range(forwards):
        seen = [per_rank[index] for per_rank in full]
        assert len({(s["layer"], s["iteration"], s["counter"], s["seed"]) for s in seen}) == 1, \
            f"forward {index}: the ranks' streams are not in step: {[(s['counter'], s['seed']) for s in seen]}"
        assert seen[0]["counter"] == index and seen[0]["seed"] == BUDGET_SEED_OFFSET + SEED
        assert sorted(s["shard"] for s in seen) == list(range(world)), "one token shard per data-parallel rank"
        lengths = [len(s["kappa"]) for s in seen]
        assert len(set(lengths)) == world, f"forward {index}: the ranks should route different T, got {lengths}"
        stream = BudgetStream(seen[0]["seed"], seen[0]["counter"])
        uniforms = []
        for rank, s in enumerate(seen):
            expected = stream.draw(schedule, "iid", s["shard"], len(s["kappa"]))[0].budgets
            assert s["kappa"] == expected.tolist(), f"forward {index}, rank {rank}: not its shard's draw"
            uniforms.append(stream.uniforms(s["shard"], len(s["kappa"])))
        for a in range(world):  # no two shards' κ from the same uniforms
            for b in range(a + 1, world):
                assert np.intersect1d(uniforms[a], uniforms[b]).size == 0, (index, a, b)
    kappa = torch.tensor([k for per_rank in full for s in per_rank for k in s["kappa"]])
    assert set(kappa.tolist()) == {1, 2, 3}


def test_a_resumed_run_replays_every_ranks_kappa(runs):
    """Megatron-LM saves data-parallel rank 0's RNG tracker states and restores them on every rank:
    the stream's counter is the same on all of them, so every rank continues exactly."""
    world, full, resumed = runs
    after = [[s for s in per_rank if s["iteration"] >= SAVE_AT] for per_rank in full]
    assert all(len(per_rank) == (ITERS - SAVE_AT) * LAYERS for per_rank in after)
    for rank in range(world):
        assert resumed[rank] == after[rank], f"rank {rank}: the resumed run drew other κ"
    assert resumed[0][0]["counter"] == SAVE_AT * LAYERS
