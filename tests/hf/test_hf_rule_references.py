"""Each family's routing rule under variable κ, against a reference written out by hand from the
family's modeling code (float64, plain Python: nothing of the package or of transformers), and
each reference shown able to fail: a plausible wrong rule (the bias forgotten, another score
function, the scale applied before the renormalisation, ...) disagrees with the elastic router.

The router's projection is redrawn at unit scale so that every rank is decided by a margin far
above fp32's rounding; a selection bias, a per-expert scale and a router input scale are random.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core.schedule import BudgetSchedule

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_clean")]

INSTALLED = {family.name for family in hf.covered_router_classes().values()}
TOKENS, WIDTH = 24, 4  # DeepSeek-V3's tiny model keeps 2 of 4 groups of 2 experts: 4 reachable


def _family(name):
    return next(family for family in hf.FAMILIES if family.name == name)


def _top(values: list[float], allowed: list[int], width: int) -> list[int]:
    return sorted(allowed, key=lambda e: values[e], reverse=True)[:width]


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(z - top) for z in row]
    return [x / sum(exps) for x in exps]


# ------------------------------------------------------------------------------- logits
def _linear(router, x: torch.Tensor) -> torch.Tensor:
    return x @ router.weight.double().T


def _linear_with_bias(router, x: torch.Tensor) -> torch.Tensor:
    return x @ router.weight.double().T + router.bias.double()


def _gemma4_logits(router, x: torch.Tensor) -> torch.Tensor:
    """z = proj(x / sqrt(mean(x²) + eps) · scale · H^-1/2)."""
    normed = x / (x.square().mean(-1, keepdim=True) + router.eps).sqrt()
    return (normed * router.scale.double() * x.shape[-1] ** -0.5) @ router.proj.weight.double().T


# ------------------------------------------------------------------------------- rules
def _deepseek_v3(router, z, kappa, width, bias, *, groups=True):
    """s = sigmoid(z); rank s + b inside the best groups (group score: sum of its top-2 of s + b);
    w = s / (Σ_kept s + 1e-20) × routed_scaling_factor."""
    bias = router.e_score_correction_bias.tolist()
    scores = [_sigmoid(v) for v in z]
    selection = [s + b for s, b in zip(scores, bias, strict=True)]
    size = len(scores) // router.num_group
    group_scores = [sum(sorted(selection[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(router.num_group)]
    kept_groups = sorted(range(router.num_group), key=lambda g: group_scores[g], reverse=True)[: router.topk_group]
    allowed = [e for e in range(len(scores)) if not groups or e // size in kept_groups]
    ids = _top(selection, allowed, width)
    total = sum(scores[e] for e in ids[:kappa]) + 1e-20
    return ids, [scores[e] / total * router.routed_scaling_factor for e in ids[:kappa]]


def _gpt_oss(router, z, kappa, width, bias, *, renormalised=True):
    """rank z = x W^T + bias; w = softmax over the kept z."""
    ids = _top(z, list(range(len(z))), width)
    if not renormalised:
        probabilities = _softmax(z)
        return ids, [probabilities[e] for e in ids[:kappa]]
    kept = _softmax([z[e] for e in ids[:kappa]])
    return ids, kept


def _ernie(router, z, kappa, width, bias, *, biased=True):
    """p = softmax(z); rank p + b; w = p / max(Σ_kept p, moe_norm_min)."""
    bias = router.moe_statics.e_score_correction_bias.reshape(-1).tolist()
    probabilities = _softmax(z)
    selection = [p + (b if biased else 0.0) for p, b in zip(probabilities, bias, strict=True)]
    ids = _top(selection, list(range(len(z))), width)
    total = max(sum(probabilities[e] for e in ids[:kappa]), router.norm_min)
    return ids, [probabilities[e] / total for e in ids[:kappa]]


def _deepseek_v4(router, z, kappa, width, bias, *, score=lambda v: math.sqrt(math.log1p(math.exp(v)))):
    """s = sqrt(softplus(z)); rank s + b (the router's correction bias); w = s / (Σ_kept s + 1e-20)
    × routed_scaling_factor."""
    bias = router.e_score_correction_bias.tolist()
    scores = [score(v) for v in z]
    ids = _top([s + b for s, b in zip(scores, bias, strict=True)], list(range(len(z))), width)
    total = sum(scores[e] for e in ids[:kappa]) + 1e-20
    return ids, [scores[e] / total * router.routed_scaling_factor for e in ids[:kappa]]


def _minimax_m2(router, z, kappa, width, bias, *, biased=True):
    """s = sigmoid(z); rank s + b (the bias the block passes in); w = s / Σ_kept s."""
    scores = [_sigmoid(v) for v in z]
    selection = [s + (b if biased else 0.0) for s, b in zip(scores, bias, strict=True)]
    ids = _top(selection, list(range(len(z))), width)
    total = sum(scores[e] for e in ids[:kappa])
    return ids, [scores[e] / total for e in ids[:kappa]]


def _gemma4(router, z, kappa, width, bias, *, scale_first=False):
    """p = softmax(z); rank p; w = p / Σ_kept p × per_expert_scale[id]."""
    probabilities = _softmax(z)
    scale = router.per_expert_scale.tolist()
    ids = _top(probabilities, list(range(len(z))), width)
    if scale_first:  # the wrong order: scaled, then renormalised
        scaled = [probabilities[e] * scale[e] for e in ids[:kappa]]
        return ids, [value / sum(scaled) for value in scaled]
    total = sum(probabilities[e] for e in ids[:kappa])
    return ids, [probabilities[e] / total * scale[e] for e in ids[:kappa]]


def _longcat(router, z, kappa, width, bias, *, zero_experts_rank=True):
    """p = softmax(z) over the N real and Z identity ("zero") experts alike; rank p + b over all of
    them (κ counts slots of either kind); w = p × routed_scaling_factor, never renormalised."""
    probabilities = _softmax(z)
    correction = router.e_score_correction_bias.tolist()
    ranked = list(range(len(z) if zero_experts_rank else router.num_experts))
    ids = _top([p + b for p, b in zip(probabilities, correction, strict=True)], ranked, width)
    return ids, [probabilities[e] * router.routed_scaling_factor for e in ids[:kappa]]


def _longcat_logits(router, x: torch.Tensor) -> torch.Tensor:
    return x @ router.classifier.weight.double().T


def _dbrx(router, z, kappa, width, bias, *, q=None):
    """p = softmax(z); rank p; w = p / ||p_kept||_q, q = moe_normalize_expert_weights (the tiny
    model's is set to 2: a q-norm, not the sum)."""
    q = router.moe_normalize_expert_weights if q is None else q
    probabilities = _softmax(z)
    ids = _top(probabilities, list(range(len(z))), width)
    norm = sum(probabilities[e] ** q for e in ids[:kappa]) ** (1 / q)
    return ids, [probabilities[e] / norm for e in ids[:kappa]]


def _dbrx_logits(block, x: torch.Tensor) -> torch.Tensor:
    return x @ block.router.layer.weight.double().T


class Reference(NamedTuple):
    """A family's rule written out, a plausible wrong variant of it, and its logits."""

    rule: Callable[..., tuple[list[int], list[float]]]
    wrong: Callable[..., tuple[list[int], list[float]]]
    logits: Callable[[Any, torch.Tensor], torch.Tensor] = _linear


REFERENCES: dict[str, Reference] = {
    "deepseek_v3": Reference(_deepseek_v3, lambda *a: _deepseek_v3(*a, groups=False)),
    "gpt_oss": Reference(_gpt_oss, lambda *a: _gpt_oss(*a, renormalised=False), _linear_with_bias),
    "ernie4_5_moe": Reference(_ernie, lambda *a: _ernie(*a, biased=False)),
    "deepseek_v4": Reference(_deepseek_v4, lambda *a: _deepseek_v4(*a, score=_sigmoid)),
    "minimax_m2": Reference(_minimax_m2, lambda *a: _minimax_m2(*a, biased=False)),
    "gemma4": Reference(_gemma4, lambda *a: _gemma4(*a, scale_first=True), _gemma4_logits),
    "longcat_flash": Reference(_longcat, lambda *a: _longcat(*a, zero_experts_rank=False), _longcat_logits),
    # ERNIE-4.5-VL's text router (the first of its two): ERNIE-4.5's rule
    "ernie4_5_vl_moe": Reference(_ernie, lambda *a: _ernie(*a, biased=False)),
    # DBRX routes in a method of its FFN block, from its router's logits
    "dbrx": Reference(_dbrx, lambda *a: _dbrx(*a, q=1.0), _dbrx_logits),
}
#: tiny-model settings a reference needs: DBRX with a q-norm other than the sum
OVERRIDES = {"dbrx": {"ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2,
                                     "moe_normalize_expert_weights": 2.0}}}


def _route(tiny, family_name):
    """The elastic routing of TOKENS random tokens with random κ in 1..WIDTH by a tiny model's first
    covered router, with what a reference reads: ``(router, float64 logits, bias list, κ, ids, weights)``."""
    if family_name not in INSTALLED:
        pytest.skip(f"transformers {transformers.__version__} has no {family_name}")
    family = _family(family_name)
    model = tiny.model(family_name, **OVERRIDES.get(family_name, {}))
    router = next(module for module in model.modules() if type(module).__name__ == family.router)
    generator = torch.Generator().manual_seed(5)
    projection = router.router if family.routing_method else router  # DBRX: its block's router
    with torch.no_grad():
        # spread logits: every rank decided by a margin
        next(p for p in projection.parameters() if p.dim() == 2).normal_(0.0, 1.0, generator=generator)
        if family.bias:
            bias = operator.attrgetter(family.bias)(router)
            bias.copy_(torch.randn(bias.shape, generator=generator) * 0.1)
        for name in ("per_expert_scale", "scale"):  # Gemma 4's factors: not all ones
            if family.name == "gemma4":
                getattr(router, name).copy_(torch.rand(getattr(router, name).shape, generator=generator) + 0.5)
    passed_bias = torch.randn(family.num_experts_of(router), generator=generator) * 0.1
    args = [passed_bias] if family.bias_argument else []
    x = torch.randn(TOKENS, 64, generator=generator)
    budgets = torch.randint(1, WIDTH + 1, (TOKENS,), generator=generator)
    plan = hf.LayerPlan(schedule=BudgetSchedule.parse(f"1-{WIDTH}", 2, 1.5, allow_off_center=True),
                        gate=hf.gate_for(router, family, ElasticConfig()), sampling="iid", layer_index=None)
    if family.routing_method:  # a routing method takes its block's logits; returns (weights, ids)
        weights, ids = hf.elastic_routing(router, plan, router.router(x), budgets=budgets)
    else:
        _, weights, ids = hf.elastic_routing(router, plan, x, *args, budgets=budgets)
    logits = REFERENCES[family_name].logits(router, x.double())
    return router, logits, passed_bias.tolist() if args else None, budgets, ids, weights


def _mismatches(rule, router, logits, bias, budgets, ids, weights) -> list[int]:
    """Tokens whose elastic ids or kept weights differ from ``rule``'s (fp32 routing against
    float64: a few ulps of tolerance), asserting weight 0 beyond κ."""
    wrong = []
    for t in range(TOKENS):
        kappa = int(budgets[t])
        assert weights[t, kappa:].eq(0).all()
        expected_ids, expected_weights = rule(router, logits[t].tolist(), kappa, WIDTH, bias)
        same = ids[t].tolist() == expected_ids and torch.allclose(
            weights[t, :kappa].double(), torch.tensor(expected_weights, dtype=torch.float64), rtol=2e-6, atol=1e-7
        )
        if not same:
            wrong.append(t)
    return wrong


@pytest.mark.parametrize("family_name", list(REFERENCES))
def test_family_rule_under_variable_kappa_matches_its_hand_written_reference(tiny, family_name):
    router, logits, bias, budgets, ids, weights = _route(tiny, family_name)
    assert _mismatches(REFERENCES[family_name].rule, router, logits, bias, budgets, ids, weights) == []


@pytest.mark.parametrize("family_name", list(REFERENCES))
def test_a_plausible_wrong_rule_fails_against_the_elastic_router(tiny, family_name):
    router, logits, bias, budgets, ids, weights = _route(tiny, family_name)
    assert _mismatches(REFERENCES[family_name].wrong, router, logits, bias, budgets, ids, weights)
