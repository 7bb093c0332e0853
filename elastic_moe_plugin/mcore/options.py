"""Which Megatron options elastic routing refuses, and how each refusal reads.

One table, :data:`RULES`, serves both places that check a Megatron model before it trains: the
router built under the patch (:func:`.patch.validate_router`) and the Megatron-LM entry point before
Megatron starts (:func:`.megatron_args.check_megatron_args`). Each :class:`Rule` pairs a predicate
over the model's options and the elastic config (a :class:`Checked`) with the message that names the
problem and its fix; :func:`check_model_options` runs the table in order and raises one
:class:`~elastic_moe_plugin.core.errors.UnsupportedMegatronError` that lists every problem, so a run
is fixed in one round rather than one refusal at a time. A message spells Megatron options through
:class:`MegatronOptions`: as ``TransformerConfig`` attributes (:data:`TRANSFORMER_CONFIG`) or as
Megatron-LM flags (:data:`MEGATRON_LM_FLAGS`), whichever the user wrote.

Adding a rule is one predicate, one message and one entry of :data:`RULES` (its place in the table
is its place in the message). Nothing here imports megatron or torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.mcore.graph_options import (
    ROUTER_SCOPES,
    captures_moe_preprocess,
    describe_capture,
    graph_setting,
    router_capture,
    spell_fix,
)


# ---------------------------------------------------------------------------------- spelling
class MegatronOptions:
    """How a refusal names a Megatron option: as a ``TransformerConfig`` attribute (a model being built,
    whichever front end set it) or as a Megatron-LM flag (:mod:`.megatron_args`, before the script runs)."""

    def __init__(self, flags: bool = False) -> None:
        self.flags = flags

    def setting(self, attribute: str, value) -> str:
        if not self.flags:
            return f"{attribute}={value!r}"
        flag = _FLAG_NAMES.get(attribute, "--" + attribute.replace("_", "-"))
        if value is True:
            return flag
        return f"{flag} {' '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}"

    def turn_off(self, attribute: str) -> str:
        """How to switch a boolean option off: a store_true flag is removed (it takes no value)."""
        flag = _FLAG_NAMES.get(attribute, "--" + attribute.replace("_", "-"))
        if self.flags:
            return f"remove {flag}, a store_true flag that takes no value,"
        return f"set {attribute}=False (Megatron-LM: remove the store_true flag {flag})"

    def elastic(self, name: str, value) -> str:
        """An ElasticConfig setting, as this front end writes it."""
        return f"--elastic-moe-{name.replace('_', '-')} {value}" if self.flags else f"{name}={value!r}"


#: TransformerConfig attribute -> Megatron-LM flag, where the flag is not the attribute's name
_FLAG_NAMES = {"num_moe_experts": "--num-experts"}
TRANSFORMER_CONFIG = MegatronOptions(flags=False)
MEGATRON_LM_FLAGS = MegatronOptions(flags=True)


# ---------------------------------------------------------------------------------- model options
def _model_num_layers(config) -> int | None:
    return None if getattr(config, "num_layers", None) is None else int(config.num_layers)


def top_p_width(model_config, config: ElasticConfig) -> int:
    """Candidate slots of ``mode="top_p"``: every expert, or ``top_p_max_experts``."""
    return config.top_p_max_experts or model_config.num_moe_experts


# ---------------------------------------------------------------------------------- the rules
@dataclasses.dataclass(frozen=True)
class Checked:
    """What every rule reads: the model's options (``TransformerConfig``'s attribute names), the
    elastic config, what the router routes with, how messages spell options, whether the budget is
    read off the probabilities (``mode="top_p"``) and the upper budget (``width``: the schedule's
    high end, or the top-p candidate slots)."""

    model: Any
    config: ElasticConfig
    score_function: str
    routing_type: Any
    router_class: str | None
    options: MegatronOptions
    top_p: bool
    width: int

    def spell(self, attribute: str, value) -> str:
        return self.options.setting(attribute, value)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One refusal: ``refuses`` says whether the checked options hit it, ``message`` names the
    problem and its fix (spelt with ``Checked.options``)."""

    name: str
    refuses: Callable[[Checked], bool]
    message: Callable[[Checked], str]


def _top_p_without_softmax(c: Checked) -> bool:
    """``mode="top_p"`` under a non-softmax score function: the nucleus is cut where the full-softmax
    probabilities reach p, which sigmoid or sqrtsoftplus scores (not a distribution) do not give."""
    return c.top_p and c.score_function != "softmax"


def _top_p_without_softmax_message(c: Checked) -> str:
    return (
        f"mode='top_p' reads the budget off full-softmax probabilities, but the router's score "
        f"function is {c.spell('moe_router_score_function', c.score_function)}; use "
        f"{c.options.elastic('mode', 'elastic')}"
    )


_OWN_BALANCING = ("sinkhorn", "quantile_balancing")


def _own_balancing(routing_type) -> str | None:
    """The load-balancing type that picks experts itself (a one-entry list counts as its entry)."""
    if routing_type in _OWN_BALANCING:
        return routing_type
    if isinstance(routing_type, (list, tuple)) and len(routing_type) == 1 and routing_type[0] in _OWN_BALANCING:
        return routing_type[0]
    return None


def _balancing_picks_experts(c: Checked) -> bool:
    """Sinkhorn and quantile balancing: they choose the experts by their own algorithm, with a fixed
    k, so there is no per-token top-k for the budget to vary."""
    return _own_balancing(c.routing_type) is not None


def _balancing_picks_experts_message(c: Checked) -> str:
    flags = c.options.flags
    return (
        f"{c.spell('moe_router_load_balancing_type', _own_balancing(c.routing_type))} picks experts by its "
        f"own balancing algorithm with a fixed k; use "
        + ", ".join(repr(t) if not flags else t for t in ("aux_loss", "seq_aux_loss", "global_aux_loss"))
        + f" or {'none' if flags else repr('none')}"
        + (f" ({c.spell('moe_router_load_balancing_type', 'aux_loss')})" if flags else "")
    )


def _routing_replay(c: Checked) -> bool:
    """``moe_enable_routing_replay``: the replayed [T, topk] buffers were recorded with one fixed k."""
    return bool(getattr(c.model, "moe_enable_routing_replay", False))


def _routing_replay_message(c: Checked) -> str:
    return (
        f"{c.spell('moe_enable_routing_replay', True)} replays [T, topk] buffers recorded with a fixed k: "
        f"disable routing replay, i.e. {c.options.turn_off('moe_enable_routing_replay')} for elastic "
        f"training"
    )


def _inference_optimized(c: Checked) -> bool:
    """``transformer_impl="inference_optimized"`` or an ``InferenceTopKRouter``: that router and its
    token dispatchers exchange dense [T, topk] buffers, so k is fixed by their shapes."""
    return getattr(c.model, "transformer_impl", None) == "inference_optimized" or c.router_class is not None


def _inference_optimized_message(c: Checked) -> str:
    what = (
        c.spell("transformer_impl", "inference_optimized")
        if getattr(c.model, "transformer_impl", None) == "inference_optimized"
        else f"the router class {c.router_class} (an InferenceTopKRouter)"
    )
    return (
        f"{what}: InferenceTopKRouter and the inference-optimised token dispatchers exchange dense "
        f"[T, topk] buffers with a fixed k; train with the stock TopKRouter, "
        + (
            "--transformer-impl transformer_engine or local "
            if c.options.flags
            else "transformer_impl='transformer_engine' or 'local' "
        )
        + "(elastic layers route static top-k in eval, so the checkpoint then serves on the "
        "inference-optimised layers unchanged)"
    )


def _graph_captures_router(c: Checked) -> bool:
    """A budget schedule under a CUDA graph that captures the router's training forward
    (:mod:`.graph_options`): κ is drawn on the host and copied in at every forward, so a replay
    would reuse the κ of the capture. (``mode="top_p"`` draws nothing on the host; its graph limit
    is :func:`_graph_captures_top_p_sizing`.)"""
    return not c.top_p and router_capture(graph_setting(c.model)) is not None


def _graph_captures_router_message(c: Checked) -> str:
    setting, flags = graph_setting(c.model), c.options.flags
    dropped = [name for name in setting.scopes if name in ROUTER_SCOPES]
    drop = f"drop {', '.join(repr(name) for name in dropped)}: " if dropped else ""
    return (
        f"a CUDA graph that captures the router ({describe_capture(setting, flags)}): κ is drawn on the host "
        "and copied in at every forward, so a graph replay would reuse the κ of its capture; capture only "
        f"scopes without the router ({drop}{spell_fix(setting, flags)}), or use "
        f"{c.options.elastic('schedule', 'static')} (inference graphs stay allowed: evaluation routes static top-k)"
    )


def _graph_captures_top_p_sizing(c: Checked) -> bool:
    """``mode="top_p"`` under a CUDA graph that captures a dropless alltoall dispatcher's preprocess:
    the dispatch is sized from the realised Σκ, a device-to-host sync no graph can capture."""
    return (
        c.top_p
        and captures_moe_preprocess(c.model)
        and not c.model.moe_pad_expert_input_to_capacity
        and c.model.moe_token_dispatcher_type == "alltoall"
    )


def _graph_captures_top_p_sizing_message(c: Checked) -> str:
    return (
        "a CUDA graph that captures the dispatcher's preprocess (scope 'moe_preprocess' in "
        "cuda_graph_modules, cuda_graph_scope before megatron-core 0.19, which cuda_graph_impl='local' "
        "adds to 'moe_router'; a whole-layer scope; or cuda_graph_impl='full_iteration') with "
        "mode='top_p': a dropless alltoall dispatch is then sized from the realised Σκ, a "
        "device-to-host sync Megatron also refuses to capture (as with a capacity factor); remove "
        "'moe_preprocess' (and 'moe_router' with cuda_graph_impl='local') from the CUDA-graph scope, "
        "or use drop-and-pad (moe_pad_expert_input_to_capacity)"
    )


def _batch_invariant(c: Checked) -> bool:
    """``batch_invariant_mode``: Megatron's batch-invariant MoE path (``moe/batch_invariant.py``,
    Megatron-LM main) asserts one fixed top-k per token and builds [T, topk] inverse maps; κ drawn
    per token position is not batch-invariant anyway."""
    return bool(getattr(c.model, "batch_invariant_mode", False))


def _batch_invariant_message(c: Checked) -> str:
    return (
        f"{c.spell('batch_invariant_mode', True)}: Megatron's batch-invariant MoE unpermute asserts a fixed "
        "top-k per token (num_out_tokens % num_tokens == 0) and builds [T, topk] maps, and κ, drawn per "
        f"token position, is not batch-invariant; {c.options.turn_off('batch_invariant_mode')} for elastic "
        "training (evaluation routes static top-k, so batch-invariant inference of the checkpoint is unaffected)"
    )


def _probs_on_input(c: Checked) -> bool:
    """``moe_apply_probs_on_input``: the gate scales each expert's input, which Megatron defines
    for top-1 routing only (its experts assert ``moe_router_topk == 1``)."""
    return bool(getattr(c.model, "moe_apply_probs_on_input", False))


def _probs_on_input_message(c: Checked) -> str:
    return (
        f"{c.spell('moe_apply_probs_on_input', True)} scales each expert's input by its gate, which Megatron "
        f"defines for top-1 routing only (its experts assert moe_router_topk == 1), but κ gives a token up to "
        f"{c.width} experts; {c.options.turn_off('moe_apply_probs_on_input')} for elastic training"
    )


def _sequence_topk(c: Checked) -> bool:
    """``moe_router_topk_mode`` other than ``"topk"`` (SeqTopK, a Megatron-LM branch): the router
    picks each sequence's expert budget itself, which elastic routing replaces."""
    return getattr(c.model, "moe_router_topk_mode", "topk") not in (None, "topk")


def _sequence_topk_message(c: Checked) -> str:
    return (
        f"{c.spell('moe_router_topk_mode', c.model.moe_router_topk_mode)} chooses per-sequence expert budgets "
        f"itself, which elastic routing replaces with per-token κ; use {c.spell('moe_router_topk_mode', 'topk')}"
    )


def _group_reach(c: Checked) -> int:
    """The experts group-limited routing can pick from: the kept groups times the experts per group."""
    return c.model.moe_router_group_topk * (c.model.num_moe_experts // c.model.moe_router_num_groups)


def _groups_too_narrow(c: Checked) -> bool:
    """Group-limited routing whose kept groups hold fewer experts than the upper budget (or fewer
    budget slots than groups): the widest tokens could not get their κ experts."""
    group_topk = c.model.moe_router_group_topk
    return bool(group_topk) and (c.width > _group_reach(c) or c.width // group_topk < 1)


def _groups_too_narrow_message(c: Checked) -> str:
    num_groups, group_topk = c.model.moe_router_num_groups, c.model.moe_router_group_topk
    return (
        f"group-limited routing keeps {group_topk} of {num_groups} groups "
        f"({_group_reach(c)} experts), fewer than the upper budget {c.width}; "
        + ("set top_p_max_experts to at most that" if c.top_p else "narrow the schedule")
        + f" or raise {'--moe-router-group-topk' if c.options.flags else 'moe_router_group_topk'}"
    )


#: every refusal, in the order its problem is listed in the one message
RULES: tuple[Rule, ...] = (
    Rule("top_p_without_softmax", _top_p_without_softmax, _top_p_without_softmax_message),
    Rule("balancing_picks_experts", _balancing_picks_experts, _balancing_picks_experts_message),
    Rule("routing_replay", _routing_replay, _routing_replay_message),
    Rule("sequence_topk", _sequence_topk, _sequence_topk_message),
    Rule("batch_invariant", _batch_invariant, _batch_invariant_message),
    Rule("probs_on_input", _probs_on_input, _probs_on_input_message),
    Rule("inference_optimized", _inference_optimized, _inference_optimized_message),
    Rule("graph_captures_router", _graph_captures_router, _graph_captures_router_message),
    Rule("graph_captures_top_p_sizing", _graph_captures_top_p_sizing, _graph_captures_top_p_sizing_message),
    Rule("groups_too_narrow", _groups_too_narrow, _groups_too_narrow_message),
)


# ---------------------------------------------------------------------------------- the check
def check_model_options(
    model,
    config: ElasticConfig,
    *,
    score_function: str,
    routing_type,
    router_class: str | None = None,
    options: MegatronOptions = TRANSFORMER_CONFIG,
    num_layers: int | None = None,
):
    """The rules of :func:`.patch.validate_router` on plain values, so that the Megatron-LM entry point
    (:func:`.megatron_args.check_megatron_args`, before Megatron starts) and the router built later
    refuse the same things with one rule.

    Args:
        model: the model's options under ``TransformerConfig``'s attribute names (a
            ``TransformerConfig``, or a namespace of the parsed flags).
        score_function / routing_type: what the router routes with (``router.score_function``,
            ``router.routing_type``: a load-balancing type, or a list of them).
        router_class: the router's class name when it is an ``InferenceTopKRouter``.
        options: how messages name Megatron options.
        num_layers: the decoder layers (default ``model.num_layers``).

    Returns:
        the schedule, or None where nothing is routed elastically (``schedule="static"``).

    Raises:
        ConfigError: the schedule or layers do not fit the model.
        UnsupportedMegatronError: every option that cannot route per-token budgets, in one message.
    """
    layers = _model_num_layers(model) if num_layers is None else num_layers
    schedule = config.resolve(num_experts=model.num_moe_experts, topk=model.moe_router_topk, num_layers=layers)
    top_p = config.mode == "top_p"
    if schedule.is_static and not top_p:
        return None
    width = top_p_width(model, config) if top_p else schedule.high
    checked = Checked(model, config, score_function, routing_type, router_class, options, top_p, width)
    problems = [rule.message(checked) for rule in RULES if rule.refuses(checked)]
    if problems:
        what = f"mode='top_p' (p={config.top_p})" if top_p else f"schedule {schedule.describe()}"
        raise UnsupportedMegatronError(
            f"elastic-moe cannot route {what} with this Megatron config: " + "; ".join(problems) + "."
        )
    return schedule


__all__ = [
    "MEGATRON_LM_FLAGS",
    "RULES",
    "TRANSFORMER_CONFIG",
    "Checked",
    "MegatronOptions",
    "Rule",
    "check_model_options",
    "top_p_width",
]
