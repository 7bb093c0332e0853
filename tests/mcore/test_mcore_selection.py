"""``mcore.routing.select_candidates``: Megatron's selection rule widened to b, called with plain arguments.

No router is built: each case calls the function on random logits (continuous, so no ties) and
compares it with a per-token reference written out by hand in float64: rank the experts by the
selection score (z, softmax(z), or sigmoid/sqrt-softplus plus the expert bias), keep the groups
stock top-k keeps (group score = sum of its top ``k // group_topk`` scores), take the first b, and
read off what the gate weighs. Ids must match exactly; values exactly where they are copied
logits, within fp32 rounding (rel 1e-6) where they are fp32 scores against the fp64 reference.
With b = k, the ids are the experts Megatron's own ``topk_routing_with_score_function`` selects.
"""

from __future__ import annotations

import math

import pytest
import torch

from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.mcore.routing import select_candidates

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

T = 24


def _score(z: float, score_function: str) -> float:
    if score_function == "sigmoid":
        return 1.0 / (1.0 + math.exp(-z))
    return math.sqrt(math.log1p(math.exp(z)))  # sqrtsoftplus


def _hand_candidates(logits, width, topk, gate, score_function="softmax", use_pre_softmax=False,
                     num_groups=None, group_topk=None, expert_bias=None):
    """(values [T, b] fp64, ids [T, b]) token by token, from the rule in the module docstring."""
    values, ids = [], []
    for row in logits.double().tolist():
        num_experts = len(row)
        if score_function == "softmax":
            top = max(row)
            exps = [math.exp(z - top) for z in row]
            probs = [e / sum(exps) for e in exps]
            rank = probs if use_pre_softmax else row
            weighed = row if gate == "renormalized" else probs
        else:
            scores = [_score(z, score_function) for z in row]
            bias = [0.0] * num_experts if expert_bias is None else expert_bias.double().tolist()
            rank = [s + b for s, b in zip(scores, bias)]
            weighed = scores
        allowed = range(num_experts)
        if group_topk:
            size = num_experts // num_groups
            groups = [sorted(rank[g * size:(g + 1) * size], reverse=True)[: topk // group_topk]
                      for g in range(num_groups)]
            best = sorted(range(num_groups), key=lambda g: sum(groups[g]), reverse=True)[:group_topk]
            allowed = [e for e in range(num_experts) if e // size in best]
        order = sorted(allowed, key=lambda e: rank[e], reverse=True)[:width]
        ids.append(order)
        values.append([weighed[e] for e in order])
    return torch.tensor(values, dtype=torch.float64), torch.tensor(ids)


CASES = {
    # name: (num_experts, width b, topk k, gate, keyword arguments)
    "post_softmax_renormalized": (8, 3, 2, "renormalized", {}),
    "post_softmax_full_softmax": (8, 3, 2, "full_softmax", {}),
    "pre_softmax_full_softmax": (8, 3, 2, "full_softmax", dict(use_pre_softmax=True)),
    "pre_softmax_renormalized": (8, 3, 2, "renormalized", dict(use_pre_softmax=True)),
    "sigmoid_with_expert_bias": (8, 4, 2, "sigmoid_auto", dict(score_function="sigmoid", bias=True)),
    "sigmoid_without_bias": (8, 4, 2, "renormalized", dict(score_function="sigmoid")),
    "sqrtsoftplus_with_expert_bias": (8, 4, 2, "sigmoid_auto", dict(score_function="sqrtsoftplus", bias=True)),
    # groups scored with k // group_topk = 2 top scores, not b // group_topk = 3
    "group_limited_softmax": (16, 6, 4, "renormalized", dict(num_groups=4, group_topk=2)),
    "group_limited_sigmoid_with_bias": (16, 6, 4, "sigmoid_auto",
                                        dict(score_function="sigmoid", num_groups=4, group_topk=2, bias=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_select_candidates_matches_the_hand_written_rule(case):
    num_experts, width, topk, gate, options = CASES[case]
    options = dict(options)
    generator = torch.Generator().manual_seed(len(case))
    logits = torch.randn(T, num_experts, generator=generator, dtype=torch.float32) * 2
    if options.pop("bias", False):
        options["expert_bias"] = torch.randn(num_experts, generator=generator) * 0.3
    values, ids = select_candidates(logits, width, topk, gate, **options)
    hand_values, hand_ids = _hand_candidates(logits, width, topk, gate, **options)
    assert values.shape == ids.shape == (T, width)
    assert torch.equal(ids, hand_ids)
    copies_logits = options.get("score_function", "softmax") == "softmax" and gate == "renormalized"
    if copies_logits:
        assert values.dtype == logits.dtype and torch.equal(values, logits.gather(1, hand_ids))  # the logits themselves
    else:
        assert values.dtype == torch.float32  # Megatron's precision policy: scores in fp32
        torch.testing.assert_close(values.double(), hand_values, rtol=1e-6, atol=0)  # fp32 rounding


@pytest.mark.parametrize("case", ["post_softmax_renormalized", "pre_softmax_full_softmax", "sigmoid_with_expert_bias",
                                  "group_limited_softmax", "group_limited_sigmoid_with_bias"])
def test_with_b_equal_to_k_the_candidates_are_megatrons_own_selection(case):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    num_experts, _, topk, gate, options = CASES[case]
    options = dict(options)
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(T, num_experts, generator=generator) * 2
    if options.pop("bias", False):
        options["expert_bias"] = torch.randn(num_experts, generator=generator) * 0.3
    _, ids = select_candidates(logits, topk, topk, gate, **options)
    _, routing_map = topk_routing_with_score_function(logits, topk, **options)
    ours = torch.zeros_like(routing_map).scatter(1, ids, True)
    assert torch.equal(ours, routing_map)


def test_an_unknown_score_function_is_refused():
    with pytest.raises(UnsupportedMegatronError, match="moe_router_score_function='tanh' is not supported"):
        select_candidates(torch.randn(4, 8), 3, 2, "renormalized", score_function="tanh")
