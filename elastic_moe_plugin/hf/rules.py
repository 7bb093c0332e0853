"""Each covered transformers family's router read into a :class:`~elastic_moe_plugin.core.routing.RoutingRule`.

A family (:class:`~.families.RouterFamily`) names two readers, both data-driven:

- how its router computes the logits z [T, E] (:data:`LOGITS`), reproduced op for op, so that
  κ ≡ k gives the stock logits bit for bit;
- how it turns z into kept experts and weights (:data:`RULES`), read from the router's own
  attributes (``norm_topk_prob``, ``n_group``/``topk_group``, ``routed_scaling_factor``,
  ``moe_norm_min``, ``expert_selection_fn``, ...) and from the family's row of the table.

The rule kinds, with the families of each (``docs/transformers.md`` has the full table)::

    softmax_topk      p = softmax(z) in fp32; top-k by p; w = p or p / Σ_kept p        OLMoE, Qwen3, Mixtral, ...
    sigmoid_bias      s = sigmoid(z) in fp32; top-k by s + b (groups: sum of the top-2) DeepSeek-V3, GLM-4.5, Kimi,
                      w = s or s / (Σ_kept s + ε), × routed_scaling_factor            Nemotron-H, MiniMax-M3, ...
    softmax_groups    p = softmax(z) in z's dtype; group-limited top-k by p (masked   DeepSeek-V2, Mistral-4
                      0.0); w = p (or p / (Σ_kept p + ε)), × routed_scaling_factor
    logits_topk       top-k by z; w = softmax over the kept z (or sigmoid(z_kept),     GPT-OSS, Granite-MoE, Aria,
                      Cohere2's sigmoid mode)                                          Cohere2-MoE
    softmax_bias_floor p = softmax(z) in fp32; top-k by p + b; w = p / max(Σ_kept p,   ERNIE-4.5
                      moe_norm_min)

The plan's gate (``ElasticConfig.gate``, ``docs/gates.md``) picks between the family's own
renormalisation (``renormalized``) and none (``full_softmax``: the kept scores as they are).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from elastic_moe_plugin.core.errors import UnsupportedTransformersError
from elastic_moe_plugin.core.patching import unwrap
from elastic_moe_plugin.core.routing import Normalization, RoutingRule, ScoreFunction

__all__ = [
    "LOGITS",
    "RULES",
    "activation_score_function",
    "expert_scale",
    "family_gate",
    "family_rule",
    "router_logits",
    "selection_bias",
]


# ---------------------------------------------------------------------------------- logits
def _flat(router: Any, hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden_states.reshape(-1, weight.shape[-1])


def _linear(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.linear(_flat(router, hidden_states, router.weight), router.weight)


def _linear_fp32(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.linear(_flat(router, hidden_states, router.weight).float(), router.weight.float())


def _linear_fp32_without_autocast(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # ERNIE-4.5, Flint, MiniCPM5-MoE switch autocast off around their fp32 router: under a bf16
    # autocast the same linear would otherwise run in bf16
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):
        return _linear_fp32(router, hidden_states)


def _linear_then_fp32(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    logits = F.linear(_flat(router, hidden_states, router.weight), router.weight).float()
    cap = getattr(router, "router_logit_softcapping", None) or 0.0  # Laguna's optional tanh soft-cap
    return torch.tanh(logits / cap) * cap if cap > 0.0 else logits


def _linear_in_weight_dtype(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = router.weight
    return F.linear(_flat(router, hidden_states, weight).to(weight.dtype), weight)


def _linear_with_bias(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.linear(_flat(router, hidden_states, router.weight), router.weight, router.bias)


def _linear_module_fp32_if_weights_are(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # HunYuan's `wg` is built fp32; the input follows it only while it still is
    flat = _flat(router, hidden_states, router.wg.weight)
    return router.wg(flat.float() if router.wg.weight.dtype == torch.float32 else flat)


def _gate_module_then_fp32(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # AFMoE's logits come from a Linear submodule, in the hidden dtype, then fp32
    return router.gate(_flat(router, hidden_states, router.gate.weight)).to(torch.float32)


def _normed_proj(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # Gemma 4: RMS-normalised (no weight), × the router's own scale × H^-1/2, then `proj`
    flat = _flat(router, hidden_states, router.proj.weight)
    return router.proj(router.norm(flat) * router.scale * router.scalar_root_size)


def _linear_module(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # Ergo's `linear`: its own fp32-output Linear (the weight rounded to the input dtype, then fp32)
    return router.linear(_flat(router, hidden_states, router.linear.weight))


def _classifier_fp32(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # LongCat-Flash: its classifier's weight in fp32 (the classifier's bias is not used)
    weight = router.classifier.weight
    return F.linear(_flat(router, hidden_states, weight).float(), weight.float())


def _linear_fp32_times_multiplier(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # Muse-Spark scales its fp32 logits by the config's output_multiplier
    return _linear_fp32(router, hidden_states) * router.output_multiplier


def routes_in_fp32(router_cls: type) -> bool:
    """Whether a router's stock forward switches autocast off to route in fp32 (Inkling from 5.25;
    5.19 routes in the hidden dtype): read from the installed code, whose forward names it."""
    found = _FP32_ROUTING.get(router_cls)
    if found is None:
        forward = unwrap(router_cls.__dict__.get("forward"))
        found = _FP32_ROUTING[router_cls] = forward is not None and "maybe_autocast" in forward.__code__.co_names
    return found


_FP32_ROUTING: dict[type, bool] = {}


def _routed_and_shared(router: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    # Inkling: [T, E + S] logits of the routed experts, then of the shared ones
    flat = _flat(router, hidden_states, router.weight)
    if not routes_in_fp32(type(router)):
        return F.linear(flat, router.weight)
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):
        return F.linear(flat.float(), router.weight.float())


#: how a family computes z [T, E] from hidden states [..., H], as its stock router does
LOGITS: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "linear": _linear,
    "linear_fp32": _linear_fp32,
    "linear_fp32_without_autocast": _linear_fp32_without_autocast,
    "linear_then_fp32": _linear_then_fp32,
    "linear_in_weight_dtype": _linear_in_weight_dtype,
    "linear_with_bias": _linear_with_bias,
    "wg_fp32_if_built_so": _linear_module_fp32_if_weights_are,
    "gate_module_then_fp32": _gate_module_then_fp32,
    "normed_proj": _normed_proj,
    "linear_module": _linear_module,
    "classifier_fp32": _classifier_fp32,
    "linear_fp32_times_multiplier": _linear_fp32_times_multiplier,
    "routed_and_shared": _routed_and_shared,
}


def router_logits(router: Any, family: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """z [T, E] of ``router`` for ``hidden_states`` [..., H], computed as the family's stock forward does."""
    return LOGITS[family.logits](router, hidden_states)


def selection_bias(router: Any, family: Any, arguments: Mapping[str, Any] | None = None) -> torch.Tensor | None:
    """The selection-only bias [E] the family adds to its scores before ranking (DeepSeek's
    ``e_score_correction_bias``, ERNIE's ``moe_statics.e_score_correction_bias`` [1, E]), read at
    every call: balancing updates it in place between steps. Where the block passes it in
    (MiniMax-M2, AFMoE: :attr:`~.router_family.RouterFamily.bias_argument`), it is that argument
    of the call (``arguments``: the forward's arguments after ``hidden_states``, by name), None
    where the call passes None (LFM2-MoE without ``use_expert_bias``). None where the family has none."""
    if family.bias_argument is not None:
        bias = (arguments or {}).get(family.bias_argument)
        return None if bias is None else bias.reshape(-1)
    if family.bias is None:
        return None
    return operator.attrgetter(family.bias)(router).reshape(-1)


def expert_scale(router: Any, family: Any) -> torch.Tensor | None:
    """The per-expert factor [E] the family multiplies the kept weights by, indexed by expert id,
    after its renormalisation (Gemma 4's ``per_expert_scale``); None where it has none."""
    return None if family.per_expert_scale is None else operator.attrgetter(family.per_expert_scale)(router)


# ---------------------------------------------------------------------------------- gates
def family_gate(router: Any, family: Any) -> str:
    """The gate convention the family's stock router implements (``docs/gates.md``): whether it
    renormalises over the kept set, read from the router where the family lets it choose."""
    renormalizes = family.renormalizes
    if renormalizes == "selection_fn":  # Cohere2: softmax over the kept logits, or sigmoid renormalised iff asked
        renormalizes = "always" if router.expert_selection_fn == "softmax" else "norm_topk_prob"
    if renormalizes == "norm_topk_prob":
        return "renormalized" if getattr(router, "norm_topk_prob", True) else "full_softmax"
    if renormalizes == "p_norm":  # DBRX: divided by a p-norm unless moe_normalize_expert_weights is None
        return "full_softmax" if router.moe_normalize_expert_weights is None else "renormalized"
    return "renormalized" if renormalizes == "always" else "full_softmax"


# ---------------------------------------------------------------------------------- rules
def _groups(router: Any, group_score_topk: int) -> dict[str, Any]:
    """Group-limited selection where the router uses it (more than one group, and DeepSeek-V2's
    ``topk_method="group_limited_greedy"`` where the router has that switch)."""
    groups = getattr(router, "num_group", None)
    if not groups or groups <= 1 or getattr(router, "topk_method", "group_limited_greedy") != "group_limited_greedy":
        return {}
    return {"num_groups": int(groups), "groups_kept": int(router.topk_group), "group_score_topk": group_score_topk}


def _scaling(router: Any, family: Any) -> float | None:
    scale = getattr(router, family.scaling, None) if family.scaling else None
    return None if scale is None or scale == 1.0 else float(scale)


def _softmax_topk(router: Any, family: Any, renormalize: bool) -> RoutingRule:
    return RoutingRule(
        normalization="kept_sum" if renormalize else "none",
        renormalization_eps=family.renormalization_eps,
        scaling_factor=_scaling(router, family),  # LongCat-Flash's routed_scaling_factor
        weights_in_logits_dtype=family.weights_dtype == "logits",
        score_dtype=torch.float32 if family.scores_in_fp32 else None,
    )


def _softmax_pnorm(router: Any, family: Any, renormalize: bool) -> RoutingRule:
    # DBRX: softmax in the logits' dtype; w = p / ||p_S||_q, q = moe_normalize_expert_weights
    q = router.moe_normalize_expert_weights
    return RoutingRule(
        normalization="kept_sum" if renormalize else "none",
        renormalization_p=float(q) if renormalize and q is not None else None,
        score_dtype=None,
    )


def _sigmoid_bias(
    router: Any, family: Any, renormalize: bool, score_function: ScoreFunction = "sigmoid"
) -> RoutingRule:
    return RoutingRule(
        score_function=score_function,
        normalization="kept_sum" if renormalize else "none",
        renormalization_eps=family.renormalization_eps,
        scaling_factor=_scaling(router, family),
        masked_group_value=family.masked_group_value,
        weights_in_logits_dtype=family.weights_dtype == "logits",
        score_dtype=torch.float32 if family.scores_in_fp32 else None,
        **_groups(router, group_score_topk=2),
    )


#: the activation modules a router may score with (transformers' ``ACT2FN`` classes) → the core's score function
_ACTIVATIONS: dict[str, ScoreFunction] = {"SqrtSoftplusActivation": "sqrtsoftplus", "Sigmoid": "sigmoid"}


def activation_score_function(router: Any) -> ScoreFunction:
    """The score function of a router that holds its activation as a module (DeepSeek-V4's
    ``score_fn = ACT2FN[config.scoring_func]``).

    Raises:
        UnsupportedTransformersError: an activation the routing core does not compute (the config's
            ``scoring_func`` names another one).
    """
    name = type(router.score_fn).__name__
    if name not in _ACTIVATIONS:
        raise UnsupportedTransformersError(
            f"elastic-moe cannot route {type(router).__name__} elastically: it scores with {name}, and the routing "
            f"core computes {', '.join(sorted(_ACTIVATIONS.values()))} only (the config's scoring_func). Use "
            f"scoring_func='sqrtsoftplus' or 'sigmoid', or train this model without the plugin."
        )
    return _ACTIVATIONS[name]


def _sigmoid_shared_sink(router: Any, family: Any, renormalize: bool) -> RoutingRule:
    # Inkling: the kept sigmoid scores as they are; the shared-expert sink normalises them after
    # the routing call (.routing.shared_sink_weights), where the rule cannot see the shared logits
    return RoutingRule(score_function="sigmoid", normalization="none", score_dtype=None)


def _activation_bias(router: Any, family: Any, renormalize: bool) -> RoutingRule:
    # DeepSeek-V4: the sigmoid-bias rule with the router's own activation, in the logits' dtype
    return _sigmoid_bias(router, family, renormalize, activation_score_function(router))


def _softmax_groups(router: Any, family: Any, renormalize: bool) -> RoutingRule:
    return RoutingRule(
        normalization="kept_sum" if renormalize else "none",
        renormalization_eps=family.renormalization_eps,
        scaling_factor=_scaling(router, family),
        masked_group_value=0.0,
        score_dtype=None,  # softmax in the logits' dtype (fp32 in DeepSeek-V2, whose logits are fp32)
        **_groups(router, group_score_topk=family.group_score_topk),
    )


def _logits_topk(router: Any, family: Any, renormalize: bool) -> RoutingRule:
    if getattr(router, "expert_selection_fn", "softmax") == "sigmoid":  # Cohere2: sigmoid of the kept logits
        normalization: Normalization = "kept_sum" if renormalize else "none"
        return RoutingRule(score_function="sigmoid", select_on="logits", normalization=normalization, score_dtype=None)
    return RoutingRule(
        select_on="logits",
        normalization="kept_softmax" if renormalize else "none",
        score_dtype=torch.float32 if family.scores_in_fp32 else None,
        weights_in_logits_dtype=family.weights_dtype == "logits",
    )


def _logits_bias_sigmoid(router: Any, family: Any, renormalize: bool) -> RoutingRule:
    # Kolibri-1: the bias ranks the logits themselves; the kept logits' sigmoid weighs
    return RoutingRule(
        score_function="sigmoid", select_on="logits", normalization="kept_sum" if renormalize else "none"
    )


def _softmax_bias_floor(router: Any, family: Any, renormalize: bool) -> RoutingRule:
    return RoutingRule(
        normalization="kept_sum" if renormalize else "none",
        renormalization_min=float(router.norm_min) if renormalize else None,
        weights_in_logits_dtype=family.weights_dtype == "logits",
    )


#: rule kind → its reader (router, family, renormalise?) → RoutingRule
RULES: dict[str, Callable[[Any, Any, bool], RoutingRule]] = {
    "softmax_topk": _softmax_topk,
    "softmax_pnorm": _softmax_pnorm,
    "sigmoid_bias": _sigmoid_bias,
    "activation_bias": _activation_bias,
    "sigmoid_shared_sink": _sigmoid_shared_sink,
    "softmax_groups": _softmax_groups,
    "logits_topk": _logits_topk,
    "logits_bias_sigmoid": _logits_bias_sigmoid,
    "softmax_bias_floor": _softmax_bias_floor,
}


def family_rule(router: Any, family: Any, gate: str) -> RoutingRule:
    """The routing rule of ``router`` (of ``family``) under the plan's ``gate``: the family's own
    renormalisation for ``"renormalized"``, none for ``"full_softmax"``."""
    return RULES[family.rule](router, family, gate != "full_softmax")
