"""End to end: ``swift sft --plugin elastic_moe --deepspeed zero3`` on 2 CPU ranks (gloo), tiny OLMoE
(top-2 of 8 experts, 2 layers), ``ELASTIC_MOE_SCHEDULE=1-3``, 3 steps of 8 rows per rank: the run
``conftest.RUNS["olmoe_zero3"]``, launched as docs/swift.md ("Engines: DeepSpeed and FSDP2") says for
a CPU host (``--use_cpu true --fp16 false --ddp_backend gloo``, the child bootstrap's ``engines``).

ms-swift builds the model under ZeRO-3 inside ``deepspeed.zero.Init``; on a CPU host that needs the
CPU runtime's ``engines`` part (``elastic_moe_plugin.cpu_runtime.engines``), the one thing this test
proves end to end through ms-swift: the run trains with the plugin, κ drawn over the whole schedule
at every step, and the engine each rank built (``_engine_probe.py``) is ZeRO-3 over 2 ranks with
the parameters partitioned: each rank holds half of every partitioned parameter and of the fp32
optimizer state, against the element count read from the checkpoint's safetensors.

How close the mean κ must be to 2: rank 0 routes at least ``tiny_assets.min_tokens_per_step`` tokens
per layer and step (8 rows), so 0.2 is more than 10 standard errors of the 1-3 pmf (σ_q ≈ 0.79).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest

pytestmark = [pytest.mark.swift, pytest.mark.slow]

deepspeed_missing = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                       reason="needs deepspeed (make setup installs it)")


def _elements(model_dir) -> int:
    """The tiny checkpoint's parameter elements, from its safetensors (no model built here)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return total


@deepspeed_missing
@pytest.mark.swift_runs("olmoe_zero3")
def test_zero3_trains_elastically_on_two_cpu_ranks(swift_runs, tiny_assets):
    result = swift_runs.result("olmoe_zero3")
    assert result.returncode == 0, result.describe()
    assert "torch.distributed.run --nproc_per_node 2" in result.output
    assert ("elastic-moe plan (transformers, 2 MoE layers): elastic 1-3 around k=2 (σ=1.5), olmoe softmax_topk rule, "
            "full_softmax gate") in result.output, result.describe()

    # ZeRO-3: ms-swift read its zero3 config, and each of the 2 ranks built a stage-3 engine holding half
    # of the partitioned parameters and of the fp32 optimizer state
    assert re.search(r"Using deepspeed: \{.*'zero_optimization': \{'stage': 3,", result.output), result.describe()
    engines = [json.loads(path.read_text()) for path in sorted((result.output_dir.parent / "engine").glob("rank*.json"))]
    assert [(e["rank"], e["world"], e["stage"]) for e in engines] == [(0, 2, 3), (1, 2, 3)], engines
    total = _elements(tiny_assets.model_dir("olmoe"))
    for engine in engines:
        print(f"olmoe_zero3 rank {engine['rank']}: holds {engine['params_local']} of {total} parameter elements, "
              f"{engine['params_partitioned']} of {engine['params']} parameters partitioned, "
              f"{engine['optimizer_local']} fp32 optimizer elements")
        assert engine["params_total"] == total, engine
        assert engine["params_partitioned"] > 0, engine
        # a partition is ceil(numel / 2) elements: at most one element of padding per parameter
        assert total / 2 <= engine["params_local"] <= total / 2 + engine["params"], engine
        assert total / 2 <= engine["optimizer_local"] < total, engine

    # trained with the plugin: 3 steps, finite losses, κ over the whole 1-3 schedule in both layers
    rows = result.training_rows()
    assert [row["global_step/max_steps"] for row in rows] == ["1/3", "2/3", "3/3"], result.describe()
    means = [float(row["elastic_moe/mean_kappa"]) for row in rows]
    print(f"olmoe_zero3: losses {[row['loss'] for row in rows]}, mean κ per step {means}")
    assert all(math.isfinite(float(row["loss"])) and math.isfinite(float(row["grad_norm"])) for row in rows), rows
    assert len(set(means)) == 3, means  # iid budgets: a different realised mean every step
    assert all(abs(mean - 2) < 0.2 for mean in means), means
    for row in rows:
        for layer in (0, 1):
            fractions = [float(row[f"elastic_moe/layer_{layer}/kappa_frac_{k}"]) for k in (1, 2, 3)]
            assert all(fraction > 0 for fraction in fractions) and abs(sum(fractions) - 1) < 1e-3, (layer, fractions)
