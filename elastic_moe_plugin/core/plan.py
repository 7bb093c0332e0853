"""``LayerPlan``: how one router routes in training, resolved once per (config, router) and kept in its state.

Both adapters resolve a plan from an :class:`~elastic_moe_plugin.core.config.ElasticConfig` and
the router they meet; ``None`` instead of a plan means "run the stock code" (eval mode, a static
schedule, a layer outside ``ElasticConfig.layers``, an MTP layer). The refusals that depend on the
router's rule rather than on the config alone (top-p on a router that does not rank by p, a width
beyond group-limited reach) live here once, each door reading its router into plain arguments.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.layer_keys import LayerKey, layer_of, part_of
from elastic_moe_plugin.core.schedule import BudgetSchedule, SamplingMode

if TYPE_CHECKING:
    from elastic_moe_plugin.core.config import ElasticConfig

#: gate rules a plan may name (``docs/gates.md``): ``sigmoid_auto`` is Megatron's sigmoid /
#: sqrtsoftplus rule (renormalise over the kept scores when κ_t > 1)
PLAN_GATES: tuple[str, ...] = ("full_softmax", "renormalized", "sigmoid_auto")

logger = logging.getLogger("elastic_moe_plugin")
#: a model's keys: its layer indices, or its RouterKeys
Key = TypeVar("Key", bound=LayerKey)
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How one router routes in training.

    Attributes:
        schedule: the budget distribution of κ (the point mass at k in ``mode="top_p"``).
        gate: the weighing rule, one of :data:`PLAN_GATES`.
        sampling: ``"iid"`` or ``"balanced"`` (:meth:`BudgetSchedule.sample`).
        layer_index: the 0-based decoder layer, or None when the router does not know it.
        top_p: ``mode="top_p"``: κ_t is the size of the smallest top-ranked set whose full-softmax
            mass reaches ``top_p``; None in ``mode="elastic"``.
        top_p_width: candidate slots in ``mode="top_p"`` (every expert, or the cap).
        cast_weights_to_logits: return gate weights in the logits' dtype (False: keep fp32, as
            Mixtral and MiniMax do in transformers).
        rule: the router family's routing rule as the plan line names it (transformers: the
            family and its rule kind, ``"deepseek_v3 sigmoid_bias"``); None where the framework has
            one router (Megatron's rule is its ``TransformerConfig``).
    """

    schedule: BudgetSchedule
    gate: str
    sampling: SamplingMode
    layer_index: int | None
    top_p: float | None = None
    top_p_width: int | None = None
    cast_weights_to_logits: bool = True
    rule: str | None = None

    #: b: candidate slots per token, the schedule's high budget (or the top-p width); a field, not
    #: a property, because routers read it at every forward
    width: int = dataclasses.field(init=False, repr=False, compare=False)
    #: k when every token's κ is k whatever is drawn, so known on the host: a schedule whose whole
    #: mass is on its center (``"static"``, or {k−1..k+1} with a vanishing σ). None when κ varies,
    #: and always in ``mode="top_p"``, where κ comes from the probabilities.
    fixed_budget: int | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        schedule = self.schedule
        object.__setattr__(self, "width", self.top_p_width if self.top_p is not None else schedule.high)
        fixed = self.top_p is None and schedule.probability(schedule.center) == 1.0
        object.__setattr__(self, "fixed_budget", schedule.center if fixed else None)


def warn_if_top1_gate_is_constant(schedule: BudgetSchedule, gate: str, where: str) -> None:
    """Warn once per process when κ = 1 can be drawn under a renormalised gate.

    A renormalised top-1 weight is exactly 1 (softmax, and sigmoid renormalised whatever κ, as
    transformers' DeepSeek-V3-style routers do), so those tokens pass no task gradient to the router
    through the gate (``docs/gates.md``, "renormalised top-1"). ``sigmoid_auto`` weighs a single
    kept expert by its own score, which keeps the gradient: no warning.
    """
    if schedule.low != 1 or gate != "renormalized" or "low1" in _warned:
        return
    _warned.add("low1")
    logger.warning(
        "elastic-moe: schedule %s with a renormalised gate (%s): tokens drawn with κ=1 get gate weight 1 "
        "and no task gradient through the router gate (docs/gates.md, 'renormalised top-1'). Consider "
        "low >= 2 or gate='full_softmax'.",
        schedule.describe(),
        where,
    )


def top_p_refusal(config: ElasticConfig, ranker: str, ranked: str) -> ConfigError:
    """The refusal of ``mode="top_p"`` for a router that does not rank by the softmax probability p:
    top-p's budget is the mass of p, which a router ranking by anything else would cut at the wrong
    experts.

    Args:
        ranker: the message's subject and verb, as the door names its router
            (``"this torchtitan router ranks"``, ``"longcat_flash routers rank"``).
        ranked: what it ranks by instead (``"sigmoid scores"``).
    """
    return ConfigError(
        f"mode='top_p' keeps each token's smallest top-ranked set whose softmax probability reaches top_p, "
        f"but {ranker} by {ranked}, not by that probability. "
        f"Use {config.spell('mode', 'elastic')} (a budget schedule) for this model.",
        field="mode",
        fixes=({"mode": "elastic"},),
    )


def check_group_reach(
    config: ElasticConfig,
    *,
    width: int,
    top_k: int,
    num_experts: int,
    num_groups: int | None,
    groups_kept: int | None,
    router: str,
    group_fields: tuple[str, str],
    explain_static: bool = True,
) -> None:
    """Refuse a width b beyond what group-limited selection can reach: a token ranks only inside
    ``groups_kept`` of ``num_groups`` equal expert groups, so the widest tokens would be dealt
    experts of dropped groups. No groups (either count None or 0, as :func:`.routing.route` reads
    them): every expert is in reach.

    Args:
        width: b, the schedule's high budget or the top-p width.
        router: the message's subject and verb (``"this torchtitan router ranks"``, ``"deepseek_v3 routes"``).
        group_fields: how the framework names (groups_kept, num_groups), as the message shows them.
        explain_static: say why ``static`` is the only fix where top-k itself reaches past the kept
            groups (the torchtitan door's message has never said it).

    Raises:
        ConfigError: naming the groups, the reach and a schedule within it: the widest range
            around k inside the reach, or ``static`` where k itself reaches past it.
    """
    if not num_groups or not groups_kept:
        return
    reach = groups_kept * (num_experts // num_groups)
    if width <= reach:
        return
    if top_k < reach:  # {2k - reach .. reach}: symmetric around k, as wide as the reach allows
        schedule, beyond = f"{max(1, 2 * top_k - reach)}-{reach}", ""
    else:  # stock top-k already deals experts of dropped groups
        schedule, beyond = "static", ""
        if explain_static:
            beyond = (
                f"; top-{top_k} itself reaches past them, so no elastic width above k = {top_k} fits: "
                "train this model static"
            )
    kept_field, groups_field = group_fields
    raise ConfigError(
        f"{router} inside {kept_field}={groups_kept} of {groups_field}={num_groups} expert groups "
        f"({reach} experts a token can reach), fewer than the {width} candidate slots of "
        f"{config.spell('schedule')}: the widest tokens would be dealt experts of dropped groups{beyond}. "
        f"Use {config.spell('schedule', schedule)}.",
        field="schedule",
        fixes=({"schedule": schedule},),
    )


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


#: the plan line's note when the schedule came from the model (``ElasticConfig.schedule == "auto"``)
RESOLVED_FROM_MODEL = "schedule resolved from the model (auto: k-2..k+2 around its top-k, within its experts)"


def _layers(keys: list[LayerKey], moe_index: Mapping[int, int] | None) -> str:
    """``"layers 3-7"``; where a layer's number is not its MoE index (a hybrid pattern, a
    ``moe_layer_freq``), both: ``"layers 3, 5 (MoE layers 1-2)"``; where layers hold several
    routers, each part's layers: ``"layers 0-1 (text_moe), 0-1 (vision_moe)"``."""
    parts: dict[str, list[int]] = {}
    for key in keys:
        parts.setdefault(part_of(key), []).append(layer_of(key))
    if set(parts) != {""}:
        return "layers " + ", ".join(
            f"{_ranges(layers)} ({part})" if part else _ranges(layers) for part, layers in sorted(parts.items())
        )
    layers = parts[""]
    text = f"layers {_ranges(layers)}"
    if moe_index and any(moe_index.get(layer, layer) != layer for layer in layers):
        text = f"layers {', '.join(str(layer) for layer in sorted(layers))}"
        known = [moe_index[layer] for layer in layers if layer in moe_index]
        text += f" (MoE layers {_ranges(known)})" if known else ""
    return text


def describe_plans(
    plans: Mapping[Key, LayerPlan | None],
    topk: Mapping[Key, int],
    framework: str,
    note: str | None = None,
    moe_index: Mapping[int, int] | None = None,
    static_reasons: Mapping[Key, str] | None = None,
) -> str:
    """The start-up line of a run: which MoE layers route elastically, with what, and which stay static.

    Args:
        plans: {0-based layer index: its training plan, None for a layer that routes stock top-k}
            ({:class:`~.layer_keys.RouterKey`: ...} where layers hold several routers).
        topk: {layer index: the layer's top-k} (the static layers' k, and the elastic layers' centre).
        framework: shown first, e.g. ``"transformers"`` or ``"megatron-core"``.
        note: appended after the layers (:data:`RESOLVED_FROM_MODEL`).
        moe_index: {layer index: its MoE index (rank among the model's MoE layers)}, where they differ
            (a Megatron ``HybridModel``: in ``*E*E*E*E`` layer 3 is MoE layer 1); the line then shows both.
        static_reasons: {layer index: why its router cannot route elastically} for static layers
            that are static by construction (DeepSeek-V4's hash-routed layers); shown with them.

    Example: ``elastic-moe plan (transformers, 16 MoE layers): elastic 6-10 around k=8 (σ=1.5), olmoe
    softmax_topk rule, full_softmax gate, iid sampling: layers 3-7; static top-8: layers 0-2, 8-15``.
    """
    groups: dict[str, list[LayerKey]] = {}
    for layer, plan in plans.items():
        rule = f"{plan.rule} rule, " if plan is not None and plan.rule else ""
        if plan is None:
            why = (static_reasons or {}).get(layer)
            key = f"static top-{topk[layer]}" + (f" ({why})" if why else "")
        elif plan.top_p is not None:
            key = f"elastic top-p {plan.top_p:g} (at most {plan.top_p_width} experts), {rule}{plan.gate} gate"
        else:
            key = f"elastic {plan.schedule.describe()}, {rule}{plan.gate} gate, {plan.sampling} sampling"
        groups.setdefault(key, []).append(layer)
    parts = [
        f"{key}: {_layers(layers, moe_index)}"
        for key, layers in sorted(
            groups.items(), key=lambda item: (item[0].startswith("static"), min(map(layer_of, item[1])))
        )
    ]
    if not any(key.startswith("static") for key in groups):
        parts.append("static: none")
    if not any(key.startswith("elastic") for key in groups):
        parts.insert(0, "elastic: none")
    if note:
        parts.append(note)
    num_layers = len({layer_of(key) for key in plans})
    routers = f", {len(plans)} routers" if len(plans) != num_layers else ""
    return f"elastic-moe plan ({framework}, {num_layers} MoE layers{routers}): " + "; ".join(parts)


def log_plan_once(line: str) -> bool:
    """Log ``line`` at INFO on rank 0 (``RANK`` unset or 0), once per process and line; True if logged."""
    if os.environ.get("RANK", "0") != "0" or line in _logged_plans:
        return False
    _logged_plans.add(line)
    logger.info("%s", line)
    return True


_logged_plans: set[str] = set()


def forget_logged() -> None:
    """Forget which plan lines and warnings this process has logged, so the next ones log again
    (a test, or a notebook that builds a second model, sees them once more)."""
    _logged_plans.clear()
    _warned.clear()


def log_plan(
    plans: Mapping[Key, LayerPlan | None],
    topk: Mapping[Key, int],
    framework: str,
    config=None,
    moe_index: Mapping[int, int] | None = None,
    note: str | None = None,
    static_reasons: Mapping[Key, str] | None = None,
) -> str | None:
    """Log (rank 0, once per process and line) and return :func:`describe_plans` of ``plans``
    (an adapter's ``model_plans``, :func:`elastic_moe_plugin.core.records.model_plans`); None when
    there are no plans (no active, enabled config). ``config``: the active ``ElasticConfig``; the line
    says when its schedule was resolved from the model. ``moe_index``: as :func:`describe_plans`.
    ``note``: the adapter's own note, after that one. ``static_reasons``: as :func:`describe_plans`."""
    if not plans:
        return None
    elastic = any(plan is not None and plan.top_p is None for plan in plans.values())
    resolved = RESOLVED_FROM_MODEL if config is not None and config.schedule_from_model and elastic else None
    note = "; ".join(part for part in (resolved, note) if part) or None
    line = describe_plans(plans, topk, framework, note, moe_index, static_reasons)
    log_plan_once(line)
    return line


__all__ = [
    "PLAN_GATES",
    "RESOLVED_FROM_MODEL",
    "LayerPlan",
    "check_group_reach",
    "describe_plans",
    "forget_logged",
    "log_plan",
    "log_plan_once",
    "top_p_refusal",
    "warn_if_top1_gate_is_constant",
]
