"""torchtitan's own trainer through the door: ``Trainer`` of torchtitan 0.3.0 with its registered
DeepSeek-V3 debug model, configured from its command line with the door in ``--override.imports``,
on CPU ranks (the end-to-end proof of the torchtitan door; two torchrun worlds, ~2 minutes).

World of 1 process (a corpus of varied documents): stock, ``static`` and κ ≡ k (a point mass through
the elastic path) over 3 steps; an elastic 1-5 run of 4 steps saving a checkpoint at step 2 (under
the debug config's selective activation checkpointing, so every MoE forward is recomputed in
backward), and the same run resumed from that checkpoint. Also the single-process reference of the
second world: torchtitan's seed checkpoint (the weights every run of that comparison loads: a
sharded model initialises other values than one process does), and κ ≡ k from it on a corpus whose
documents are all the same, so that every data-parallel rank's batch is this process's.

World of 2 processes (gloo), on that corpus: FSDP2 over both ranks, and expert parallelism 2 (the
all-to-all dispatcher; FSDP2 over the same ranks), each at κ ≡ k and elastic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elastic_moe_plugin.core.budget_stream import BudgetStream
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET, BudgetSchedule
from elastic_moe_plugin.tools import child_bootstrap

pytestmark = [pytest.mark.titan, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "titan"
SEED, LAYERS, TOKENS, WIDTH = 7, ("1", "2", "3", "4", "5"), 2 * 64, 5
ELASTIC = BudgetSchedule.parse("1-5", 3)
BASE = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
        "--metrics.log_freq", "1", "--debug.seed", str(SEED), "--metrics.enable_tensorboard"]  # fmt: skip
POINT_MASS = ["--override.imports", 'elastic_moe_plugin.titan.elastic_moe={"schedule": "2-4", "sigma": 0.001}']
ELASTIC_ARGS = ["--override.imports", 'elastic_moe_plugin.titan.elastic_moe={"schedule": "1-5"}']
FSDP = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.spmd_backend", "partial_dtensor"]
EP = [*FSDP, "--parallelism.expert_parallel_degree", "2", "--training.disable_cuda_graphs"]


def _run_world(tmp: Path, processes: int, runs: list[dict]) -> list[dict]:
    spec, out = tmp / f"spec{processes}.json", tmp / f"out{processes}"
    out.mkdir()
    spec.write_text(json.dumps({"runs": runs}))
    python_path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **child_bootstrap.environment(["titan"], python_path)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               str(FIXTURES / "train.py"), str(spec), str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> tuple[dict, list[dict]]:
    sys.path.insert(0, str(FIXTURES))
    from assets import write_assets

    tmp = tmp_path_factory.mktemp("titan")
    varied, repeated = write_assets(tmp / "varied"), write_assets(tmp / "repeated", repeated=True)
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "2", "--dump_folder", str(tmp / "elastic_run")]

    seed_weights = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp / "seed" / "checkpoint" / "step-0")]

    def run(name: str, folder: Path, *args: str, steps: int = 3) -> dict:
        dump = [] if "--dump_folder" in args else ["--dump_folder", str(tmp / name)]
        return {"name": name, "workdir": str(folder), "args": [*BASE, "--training.steps", str(steps), *dump, *args]}

    single = _run_world(tmp, 1, [
        run("stock", varied), run("static", varied, "--override.imports",
                                  'elastic_moe_plugin.titan.elastic_moe={"schedule": "static"}'),
        run("point_mass", varied, *POINT_MASS),
        run("elastic", varied, *ELASTIC_ARGS, *checkpoint, steps=4),
        run("resumed", varied, *ELASTIC_ARGS, *checkpoint, "--checkpoint.load_step", "2", steps=4),
        run("seed", repeated, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"),
        run("reference", repeated, *POINT_MASS, *seed_weights),
    ])[0]  # fmt: skip
    pair = _run_world(tmp, 2, [
        run("fsdp_point_mass", repeated, *POINT_MASS, *FSDP, *seed_weights),
        run("fsdp_elastic", repeated, *ELASTIC_ARGS, *FSDP),
        run("ep_point_mass", repeated, *POINT_MASS, *EP, *seed_weights),
        run("ep_elastic", repeated, *ELASTIC_ARGS, *EP),
    ])  # fmt: skip
    return single, pair


def _closed_form_kappa(shard: int, draws: int) -> list[list[int]]:
    """κ of each draw of one process: (seed, counter) = (offset + --debug.seed, 0, 1, ...) on its shard."""
    seed = BUDGET_SEED_OFFSET + SEED
    return [ELASTIC.budgets_from_uniforms(BudgetStream(seed, i).uniforms(shard, TOKENS)).tolist() for i in range(draws)]


def _draws_in_call_order(result: dict) -> list[list[int]]:
    """κ of every MoE forward in call order (each step runs layers 1-5 in order)."""
    steps = len(result["kappa"][LAYERS[0]])
    return [result["kappa"][layer][step] for step in range(steps) for layer in LAYERS]


def test_static_and_point_mass_losses_equal_stock_digit_for_digit(worlds):
    single, _ = worlds
    assert len(single["stock"]["losses"]) == 3
    assert single["static"]["losses"] == single["stock"]["losses"]
    assert single["point_mass"]["losses"] == single["stock"]["losses"]
    assert single["elastic"]["losses"][0] != single["stock"]["losses"][0]  # the comparison can fail
    assert single["point_mass"]["counter"] == 3 * len(LAYERS)  # one draw per MoE forward, none in a recompute


def test_kappa_is_the_stream_s_closed_form_and_follows_the_pmf(worlds):
    single, _ = worlds
    drawn = _draws_in_call_order(single["elastic"])
    assert drawn == _closed_form_kappa(0, len(drawn))
    values = np.concatenate(drawn)
    for budget in range(1, WIDTH + 1):
        share, q = float(np.mean(values == budget)), ELASTIC.probability(budget)
        assert abs(share - q) <= 4.5 * np.sqrt(q * (1 - q) / values.size), (budget, share, q)


def test_expert_rows_equal_the_kept_pairs(worlds):
    single, _ = worlds
    for name in ("elastic", "point_mass", "stock"):
        result = single[name]
        for layer in LAYERS:
            expected = [TOKENS * 3] * len(result["rows"][layer]) if name == "stock" else result["totals"][layer]
            assert result["rows"][layer] == expected
            if name == "elastic":
                assert [sum(pairs) for pairs in result["pairs"][layer]] == expected
                assert [sum(kappa) for kappa in result["kappa"][layer]] == expected
    assert len({total for layer in LAYERS for total in single["elastic"]["totals"][layer]}) > 5


def test_the_routing_metrics_reach_the_metrics_logger(worlds):
    single, _ = worlds
    metrics = single["elastic"]["metrics"]
    last_step = [single["elastic"]["kappa"][layer][-1] for layer in LAYERS]
    assert metrics["elastic_moe/layer_1/mean_kappa"] == pytest.approx(np.mean(last_step[0]))
    assert metrics["elastic_moe/mean_kappa"] == pytest.approx(np.mean([np.mean(k) for k in last_step]))
    assert single["stock"]["metrics"] == {}


def test_a_resumed_run_continues_kappa_and_the_losses_exactly(worlds):
    single, _ = worlds
    elastic, resumed = single["elastic"], single["resumed"]
    assert len(resumed["losses"]) == 2  # steps 3 and 4
    assert resumed["losses"] == elastic["losses"][2:]
    assert _draws_in_call_order(resumed) == _draws_in_call_order(elastic)[2 * len(LAYERS) :]
    assert resumed["counter"] == elastic["counter"] == 4 * len(LAYERS)


@pytest.mark.parametrize("parallelism", ["fsdp", "ep"])
def test_two_ranks_at_point_mass_match_the_single_process_step(worlds, parallelism):
    single, pair = worlds
    reference = single["reference"]["losses"]
    for rank in pair:
        losses = rank[f"{parallelism}_point_mass"]["losses"]
        # step 1 runs before any update; later steps follow a clipped update whose norm the ranks
        # reduce in another order than one process (and the experts multiply other row blocks under EP)
        assert losses[0] == pytest.approx(reference[0], rel=1e-6 if parallelism == "ep" else 0)
        np.testing.assert_allclose(losses, reference, rtol=1e-5)


@pytest.mark.parametrize("parallelism", ["fsdp", "ep"])
def test_two_ranks_draw_independent_kappa_of_their_own_shards(worlds, parallelism):
    _, pair = worlds
    drawn = [_draws_in_call_order(rank[f"{parallelism}_elastic"]) for rank in pair]
    for shard, rank in enumerate(pair):
        assert rank[f"{parallelism}_elastic"]["shard"] == shard
        assert drawn[shard] == _closed_form_kappa(shard, len(drawn[shard]))
    assert drawn[0] != drawn[1]  # the same tokens on both ranks, different κ
    both = np.concatenate([np.concatenate(d) for d in drawn])
    for budget in range(1, WIDTH + 1):  # the pooled shares as one stream's
        share, q = float(np.mean(both == budget)), ELASTIC.probability(budget)
        assert abs(share - q) <= 4.5 * np.sqrt(q * (1 - q) / both.size)


def test_expert_parallel_ranks_multiply_the_kept_pairs_of_their_experts(worlds):
    _, pair = worlds
    results = [rank["ep_elastic"] for rank in pair]
    local = 8 // 2
    for layer in LAYERS:
        for step in range(len(results[0]["rows"][layer])):
            pairs = [np.array(result["pairs"][layer][step]) for result in results]
            for rank, result in enumerate(results):
                owned = slice(rank * local, (rank + 1) * local)
                assert result["rows"][layer][step] == sum(int(p[owned].sum()) for p in pairs)
            assert sum(r["rows"][layer][step] for r in results) == sum(r["totals"][layer][step] for r in results)
