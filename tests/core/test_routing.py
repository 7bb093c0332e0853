"""The routing core (``elastic_moe_plugin.core.routing``) against a hand-written reference of every rule.

No framework. Each case routes random logits (continuous, so no ties) with a :class:`RoutingRule`
and compares with a per-token reference written out in Python floats from the rule's definition:
score the experts (softmax, sigmoid or sqrt-softplus), rank them by the logits or by the scores
plus a selection bias, keep the groups the rule keeps (group score = sum of its top
``group_score_topk`` selection values), take the first b, keep the first κ_t, and weigh the kept
set by the rule's normalisation, times the scaling factor. Ids and kept masks must match exactly;
weights within fp32 rounding where the core computes in fp32 (against the float64 reference), to
1e-12 where the rule computes in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from elastic_moe_plugin.core.routing import (
    RoutingRule,
    balancing_scores,
    budget_mask,
    route,
    top_p_budgets,
)

T, E = 40, 16


def _score(z: float, score_function: str, row: list[float]) -> float:
    if score_function == "softmax":
        top = max(row)
        return math.exp(z - top) / sum(math.exp(v - top) for v in row)
    if score_function == "sigmoid":
        return 1.0 / (1.0 + math.exp(-z))
    return math.sqrt(math.log1p(math.exp(z)))  # sqrtsoftplus


def _hand_route(row: list[float], rule: RoutingRule, kappa: int, width: int, bias: list[float] | None):
    """(ids [b], kept [b], weights [b]) of one token, from the rule's definition."""
    scores = [_score(z, rule.score_function, row) for z in row]
    if rule.select_on == "logits":
        selection = list(row)
    else:
        selection = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores)]
    allowed = list(range(len(row)))
    if rule.groups_kept:
        size = len(row) // rule.num_groups
        group_scores = [sum(sorted(selection[g * size:(g + 1) * size], reverse=True)[: rule.group_score_topk])
                        for g in range(rule.num_groups)]
        best = sorted(range(rule.num_groups), key=lambda g: group_scores[g], reverse=True)[: rule.groups_kept]
        # the dropped groups' experts compete at the rule's masked value (−inf, or 0.0 as in DeepSeek-V2)
        selection = [value if e // size in best else rule.masked_group_value for e, value in enumerate(selection)]
    ids = sorted(allowed, key=lambda e: selection[e], reverse=True)[:width]
    kept_ids = ids[:kappa]
    if rule.normalization == "none":
        kept_weights = [scores[e] for e in kept_ids]
    elif rule.normalization == "kept_softmax":
        top = max(row[e] for e in kept_ids)
        exps = [math.exp(row[e] - top) for e in kept_ids]
        kept_weights = [x / sum(exps) for x in exps]
    else:
        total = sum(scores[e] for e in kept_ids)
        total = max(total, rule.renormalization_min) if rule.renormalization_min is not None else total + rule.renormalization_eps
        several = rule.normalization == "kept_sum" or kappa > 1
        kept_weights = [scores[e] / total if several else scores[e] for e in kept_ids]
    scale = rule.scaling_factor or 1.0
    weights = [w * scale for w in kept_weights] + [0.0] * (width - len(kept_ids))
    return ids, [j < kappa for j in range(width)], weights


RULES = {
    # name: (rule keywords, with a selection bias)
    "softmax_full (OLMoE, Switch)": (dict(normalization="none"), False),
    "softmax_renormalized (Qwen3)": (dict(normalization="kept_sum"), False),
    "topk_on_logits_then_softmax (Megatron post-softmax, GPT-OSS)": (
        dict(select_on="logits", normalization="kept_softmax"), False),
    "softmax_pre_then_kept_softmax (Megatron pre-softmax, renormalized)": (dict(normalization="kept_softmax"), False),
    "topk_on_logits_full_probabilities": (dict(select_on="logits", normalization="none"), False),
    "sigmoid_bias_if_several (Megatron sigmoid)": (
        dict(score_function="sigmoid", normalization="kept_sum_if_several", renormalization_eps=1e-20), True),
    "sigmoid_bias_groups_scaled (DeepSeek-V3 with Megatron's groups)": (
        dict(score_function="sigmoid", normalization="kept_sum", renormalization_eps=1e-20, num_groups=4,
             groups_kept=2, group_score_topk=2, scaling_factor=2.5), True),
    "sqrtsoftplus_bias_if_several": (
        dict(score_function="sqrtsoftplus", normalization="kept_sum_if_several", renormalization_eps=1e-20), True),
    "softmax_groups_kept_softmax (group-limited softmax)": (
        dict(normalization="kept_softmax", num_groups=4, groups_kept=3, group_score_topk=1, scaling_factor=16.0),
        False),
    "softmax_bias_floor (ERNIE-4.5)": (dict(normalization="kept_sum", renormalization_min=1e-12), True),
    "softmax_bias_floor_binding (a floor above every kept sum)": (
        dict(normalization="kept_sum", renormalization_min=2.0), True),
    "softmax_groups_by_max_zero_fill_scaled (DeepSeek-V2)": (
        dict(normalization="none", num_groups=4, groups_kept=2, group_score_topk=1, masked_group_value=0.0,
             scaling_factor=16.0), False),
    "sigmoid_bias_groups_zero_fill (AXK-2)": (
        dict(score_function="sigmoid", normalization="kept_sum", renormalization_eps=1e-20, num_groups=4,
             groups_kept=2, group_score_topk=2, masked_group_value=0.0), True),
    "sigmoid_of_the_top_logits_renormalised (Cohere2-MoE sigmoid)": (
        dict(score_function="sigmoid", select_on="logits", normalization="kept_sum"), False),
    "sigmoid_unnormalised_scaled": (dict(score_function="sigmoid", normalization="none", scaling_factor=1.5), True),
}
BUDGETS = {"kappa_is_k": None, "variable_kappa": (1, 6)}


def _inputs(seed: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=generator, dtype=torch.float64) * 1.5).to(dtype)
    bias = torch.randn(E, generator=generator, dtype=torch.float64).mul(0.3).to(dtype)
    return logits, bias


def _check(rule: RoutingRule, with_bias: bool, budgets_range, logits: torch.Tensor, bias: torch.Tensor,
           tolerance: dict) -> None:
    k = 4
    if budgets_range is None:
        width, budgets = k, torch.full((T,), k)
    else:
        low, high = budgets_range
        width = high
        budgets = torch.randint(low, high + 1, (T,), generator=torch.Generator().manual_seed(7))
    routed = route(logits, rule, width, budgets=budgets, selection_bias=bias if with_bias else None)
    rows, bias_list = logits.double().tolist(), bias.double().tolist() if with_bias else None
    expected = [_hand_route(row, rule, int(kappa), width, bias_list) for row, kappa in zip(rows, budgets.tolist())]
    assert routed.ids.tolist() == [ids for ids, _, _ in expected]
    assert routed.kept.tolist() == [kept for _, kept, _ in expected]
    assert torch.equal(routed.budgets, budgets)
    reference = torch.tensor([weights for _, _, weights in expected], dtype=torch.float64)
    torch.testing.assert_close(routed.weights.double(), reference, **tolerance)
    assert bool((routed.weights[~routed.kept] == 0).all()), "weights beyond κ are exactly 0"
    assert routed.gate_weights.dtype == rule.score_dtype
    unscaled = reference / (rule.scaling_factor or 1.0)
    torch.testing.assert_close(routed.gate_weights.double(), unscaled, **tolerance)


@pytest.mark.parametrize("budgets_range", list(BUDGETS.values()), ids=list(BUDGETS))
@pytest.mark.parametrize("name", list(RULES))
def test_every_rule_matches_its_hand_written_reference_in_fp32(name, budgets_range):
    keywords, with_bias = RULES[name]
    rule = RoutingRule(**keywords)
    logits, bias = _inputs(1, torch.float32)
    # fp32 scores against the float64 reference: a few ulps (6e-8 each) per score and normalisation
    _check(rule, with_bias, budgets_range, logits, bias, dict(rtol=2e-6, atol=1e-7))


@pytest.mark.parametrize("budgets_range", list(BUDGETS.values()), ids=list(BUDGETS))
@pytest.mark.parametrize("name", list(RULES))
def test_every_rule_matches_its_hand_written_reference_in_fp64(name, budgets_range):
    keywords, with_bias = RULES[name]
    rule = RoutingRule(**keywords, score_dtype=torch.float64)
    logits, bias = _inputs(2, torch.float64)
    # float64 throughout: only the order of the sums differs from the reference
    _check(rule, with_bias, budgets_range, logits, bias, dict(rtol=1e-12, atol=1e-15))


def test_the_weights_dtype_is_the_logits_unless_the_rule_keeps_fp32():
    logits = _inputs(3, torch.bfloat16)[0]
    budgets = torch.full((T,), 2)
    assert route(logits, RoutingRule(), 3, budgets=budgets).weights.dtype == torch.bfloat16
    kept_fp32 = route(logits, RoutingRule(weights_in_logits_dtype=False), 3, budgets=budgets)
    assert kept_fp32.weights.dtype == torch.float32
    assert torch.equal(kept_fp32.weights.to(torch.bfloat16), route(logits, RoutingRule(), 3, budgets=budgets).weights)


def test_a_rule_without_a_score_dtype_stays_in_the_logits_dtype():
    """Mistral-4 and GPT-OSS never leave the logits' dtype: scores, selection and weights in bf16,
    as the same ops written out in bf16."""
    logits = _inputs(3, torch.bfloat16)[0]
    budgets = torch.full((T,), 3)
    kept_sum = route(logits, RoutingRule(score_dtype=None, renormalization_eps=1e-20), 3, budgets=budgets)
    probabilities = torch.softmax(logits, dim=-1)
    top, ids = torch.topk(probabilities, 3, dim=-1)
    assert kept_sum.gate_weights.dtype == torch.bfloat16
    assert torch.equal(kept_sum.ids, ids)
    assert torch.equal(kept_sum.weights, top / (top.sum(-1, keepdim=True) + 1e-20))
    on_logits = RoutingRule(score_dtype=None, select_on="logits", normalization="kept_softmax")
    top_logits, ids = torch.topk(logits, 3, dim=-1)
    routed = route(logits, on_logits, 3, budgets=budgets)
    assert torch.equal(routed.weights, torch.softmax(top_logits, dim=1, dtype=torch.bfloat16))


def test_top_p_keeps_the_smallest_top_ranked_set_reaching_p():
    logits = _inputs(4, torch.float64)[0]
    rule = RoutingRule(normalization="none", score_dtype=torch.float64)
    routed = route(logits, rule, 6, top_p=0.5)
    for row, ids, kappa in zip(logits.tolist(), routed.ids.tolist(), routed.budgets.tolist()):
        probabilities = [_score(z, "softmax", row) for z in row]
        mass, expected = 0.0, 0
        for expert in ids:
            if mass >= 0.5:
                break
            mass += probabilities[expert]
            expected += 1
        assert kappa == max(1, min(expected, 6))
    assert top_p_budgets(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.1]]), 0.6).tolist() == [2, 3]
    with pytest.raises(ValueError, match="budgets"):
        route(logits, rule, 6)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_balancing_scores_are_the_full_distribution(score_function):
    logits = _inputs(5, torch.float64)[0]
    scores = balancing_scores(logits, score_function, torch.float64)
    for row, got in zip(logits.tolist(), scores.tolist()):
        raw = [_score(z, score_function, row) for z in row]
        expected = raw if score_function == "softmax" else [s / (sum(raw) + 1e-20) for s in raw]
        assert got == pytest.approx(expected, rel=1e-12)


def test_budget_mask_keeps_slot_j_iff_j_below_the_budget():
    mask = budget_mask(torch.tensor([1, 3, 0, 5]), 4)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, True, False],
        [False, False, False, False],
        [True, True, True, True],
    ]
    with pytest.raises(ValueError, match=r"budgets must be a LongTensor of shape \[T\]"):
        budget_mask(torch.tensor([[1]]), 2)


def test_a_top1_kept_set_is_weighed_one_with_zero_gate_gradient():
    """Renormalised top-1 (docs/gates.md, 'renormalised top-1'): weight exactly 1, gate gradient exactly 0."""
    logits = _inputs(6, torch.float32)[0].requires_grad_()
    for rule in (RoutingRule(normalization="kept_sum"), RoutingRule(select_on="logits", normalization="kept_softmax")):
        routed = route(logits, rule, 3, budgets=torch.ones(T, dtype=torch.long))
        assert bool((routed.weights[:, 0] == 1).all())
        (grad,) = torch.autograd.grad((routed.weights * torch.randn(T, 3)).sum(), logits)
        assert bool((grad == 0).all())


@pytest.mark.parametrize(("keywords", "message"), [
    (dict(score_function="relu"), r"score_function='relu' is not supported"),
    (dict(normalization="softmax"), r"normalization='softmax' is unknown"),
    (dict(score_function="sigmoid", normalization="kept_softmax"), r"only a softmax router has"),
    (dict(groups_kept=2), r"groups_kept needs num_groups and group_score_topk"),
])
def test_a_rule_refuses_what_it_cannot_compute(keywords, message):
    with pytest.raises(ValueError, match=message):
        RoutingRule(**keywords)
