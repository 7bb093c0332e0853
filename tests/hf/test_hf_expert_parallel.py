"""transformers' expert parallelism follows κ, on 2 gloo processes (CPU, real DTensors).

``tests/fixtures/hf/expert_parallel.py`` loads a tiny OLMoE (8 experts, top-2, schedule 1-3: b = 3)
with ``from_pretrained(..., distributed_config=...)`` under two of transformers' expert-parallel
plans, both on ``tp_size = ep_size = 2`` (what 5.19 accepts), by what the installed transformers has:

- the token dispatch (``ep_dispatch_experts``, the model's own plan; each rank dispatches its
  ``Shard(0)`` half of the batch): the style's own all-to-all on 5.19-5.22, ``AllToAllEP`` (the
  ``"auto"`` implementation in training) from 5.23;
- the masking: ``ep_router`` + ``moe_tp_experts`` on 5.19-5.22, ``AllReduceEP``
  (``ep_implementation="all_reduce"``, which rebuilds the index for the local experts) from 5.23.

Each rank runs forward + backward twice on the same κ: elastic, and with the router's mark hidden
so every one of the b slots is computed (the unkept ones at weight 0), which is what expert
parallelism did before. Checked, per experts implementation:

- the rows each rank's experts multiply (counted at the GEMMs, ``counters.ExpertRows``) are
  the kept pairs routed to that rank's experts, computed from the router's record (all-slots: the
  T·b slots routed there); they sum to Σκ (all-slots: T·b);
- loss and every local gradient agree with the all-slots pass to fp32 rounding (the same sums in
  another order: pairs per token instead of slots per token).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "fixtures" / "hf" / "expert_parallel.py"
IMPLS = ("grouped_mm", "batched_mm", "eager")
WIDTH, LAYERS, RANKS = 3, 2, 2
# fp32, same κ, same products; summed per token in pair order instead of slot order
FP32 = {"rel": 1e-5, "abs": 1e-6}


def _plans() -> tuple[str, str]:
    """The fixture's dispatch and masking plans for the installed transformers: 5.23 moved the
    dispatch into ``EPImplementation``s and replaced ``ep_router`` by ``AllReduceEP``."""
    try:
        from transformers.distributed import expert_parallel
    except ImportError:
        return "dispatch", "masked"
    return ("dispatch", "all_reduce") if hasattr(expert_parallel, "AllReduceEP") else ("dispatch", "masked")


def _tiny_olmoe(directory: Path) -> Path:
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=128, num_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = OlmoeForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.1)  # routers far enough from uniform that κ's slots differ
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def both_plans(tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    """One torchrun for both plans (a world of processes costs more to start than to run):
    ``{plan: {impl: [rank 0's results, rank 1's]}}``."""
    plans = _plans()
    output = tmp_path_factory.mktemp("expert_parallel")
    model_dir = _tiny_olmoe(output / "model")
    drop = ("ELASTIC_MOE_", "MASTER_", "TORCHELASTIC_", "PET_")
    keep = ("ELASTIC_MOE_ALLOW_UNSUPPORTED_TRANSFORMERS",)  # a transformers outside the guard's range, as here
    env = {k: v for k, v in os.environ.items()
           if (k in keep or not k.startswith(drop)) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               str(WORKER), str(model_dir), ",".join(plans), ",".join(IMPLS), str(output)]
    with open(output / "log", "w") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=output, timeout=600)
    assert completed.returncode == 0, (output / "log").read_text()[-6000:]
    return {plan: {impl: [json.loads((output / f"{plan}_{impl}_rank_{rank}.json").read_text()) for rank in range(RANKS)]
                   for impl in IMPLS} for plan in plans}


@pytest.fixture(params=_plans())
def runs(request, both_plans):
    return request.param, both_plans[request.param]


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_parallel_experts_multiply_only_the_kept_pairs(runs, impl):
    plan, results = runs
    per_rank = results[impl]
    assert all(result["expert_parallel"] and result["local_experts"] == 4 for result in per_rank)
    for layer in (f"model.layers.{i}.mlp.experts" for i in range(LAYERS)):
        routed = [result["routed"][layer] for result in per_rank]
        assert all(r["width"] == WIDTH for r in routed)
        elastic_rows = [result["elastic"]["rows"][layer] for result in per_rank]
        all_slot_rows = [result["all_slots"]["rows"][layer] for result in per_rank]
        # one TP group: both ranks route the same tokens with the same κ (replicated router, κ's
        # stream keyed by the TP group's token shard)
        assert routed[0] == routed[1]
        kept_pairs, slots = routed[0]["sum_kappa"], routed[0]["tokens"] * WIDTH
        assert routed[0]["tokens"] < kept_pairs < slots
        # the pairs routed to each rank's experts (experts 4r..4r+3), from the router's record
        kept_by_owner, slots_by_owner = routed[0]["kept_by_owner"], routed[0]["slots_by_owner"]
        assert sum(kept_by_owner) == kept_pairs and sum(slots_by_owner) == slots
        if plan != "dispatch" and impl == "batched_mm":
            # transformers' batched_mm under masking multiplies every pair it is given, the other
            # rank's included (clamped, weight 0: "pays the wasted GEMM compute"), so each rank
            # multiplies all P kept pairs; before, all T·b slots.
            assert elastic_rows == [kept_pairs] * RANKS and all_slot_rows == [slots] * RANKS, layer
        else:
            # each pair is multiplied once, by its expert's rank: the dispatch sends it there once
            # (TP-sliced), the masking leaves the other rank's pairs out of the GEMMs
            assert elastic_rows == kept_by_owner and all_slot_rows == slots_by_owner, layer


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_parallel_outputs_and_gradients_match_all_slots(runs, impl):
    _, results = runs
    for rank, result in enumerate(results[impl]):
        elastic, all_slots = result["elastic"], result["all_slots"]
        assert elastic["loss"] == pytest.approx(all_slots["loss"], **FP32), rank
        assert elastic["grads"].keys() == all_slots["grads"].keys() and elastic["grads"]
        for name, grad in elastic["grads"].items():
            assert grad == pytest.approx(all_slots["grads"][name], **FP32), (rank, name)
