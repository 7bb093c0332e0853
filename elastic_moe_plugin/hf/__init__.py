"""Elastic Expert Routing for transformers 5.x: one class-level patch of the MoE top-k routers.

Usage (call before building the model, in every process)::

    from elastic_moe_plugin import ElasticConfig, hf

    hf.apply(ElasticConfig(schedule="6-10", layers="3-7"))
    model = AutoModelForCausalLM.from_pretrained(...)   # every covered router routes elastically in training

    hf.apply(config, model=model)      # a model built *before* apply: also tags its layers and validates
    with hf.patched(ElasticConfig()):  # or scoped
        ...

Covered families (:data:`FAMILIES`): every transformers MoE whose router sits at ``mlp.gate`` and
whose ``forward(hidden_states)`` returns ``(router_logits, top_k_weights, top_k_index)`` after a
softmax in fp32, a top-k on the probabilities and, where the family does, a renormalisation:
OLMoE, FlexOlmo, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Qwen3-VL-MoE (text), Qwen3-Omni-MoE
(thinker and talker), Qwen4-Exp, Mixtral, MiniMax and Mellum. One generic patcher serves them all;
the table only records class names and the two ways the families differ (whether
``norm_topk_prob`` decides the gate, and whether the weights are cast back to the logits' dtype).
Routers with another shape (sigmoid scores with a correction bias, top-k on the logits, jitter
inside the router, hash routing: DeepSeek-V4, GPT-OSS, Granite-MoE, Phi-MoE, ...) are not patched.

What is patched, per covered family (``transformers.models.<family>.modeling_<family>``):

- ``<Router>.forward``: in training, elastic layers run :func:`elastic_route`. In eval mode, for
  ``schedule="static"``, for ``enabled=False`` and in layers outside ``ElasticConfig.layers`` the
  original method runs, so results are bit-for-bit stock.
- ``<DecoderLayer>.__init__``: runs the original, then tags ``self.mlp.gate`` with the 0-based
  decoder-layer index (the ``layer_idx`` argument; the router itself does not know it) and checks
  the config against the model (:class:`~elastic_moe_plugin.core.config.ConfigError` at model build).
- ``modeling_<family>.load_balancing_loss_func``: counts the *realised* assignments of logits that
  came from an elastic router (paper §3.2: "load-balancing statistics use realized assignments");
  for any other logits it calls the original, so stock results stay bitwise.

Nothing else is touched: parameters, buffers, state-dict keys and the experts modules are stock,
so checkpoints are interchangeable with unpatched transformers.

Elastic routing, one MoE layer in training (paper §3.2, Eq. 4-5; the gate weights follow seed 000)::

    (1) z [T, E] = x W^T                                  (stock router logits)
    (2) κ [T] ~ q on {a..b}                              (BudgetSchedule.sample, torch's default
                                                           generator: replayed by checkpointing)
    (3) p = softmax(z) in fp32; the top-b candidates by p, sorted by rank
    (4) slot j (0-based) is kept iff j < κ_t; weights by gates.weigh_candidates:
            full_softmax  w = p_e                          (norm_topk_prob=False, OLMoE)
            renormalized  w = p_e / Σ_kept p               (norm_topk_prob=True, Qwen3, Mixtral)
    (5) return (z, w [T, b], ids [T, b]). A slot beyond κ_t keeps its real candidate id with a
        weight of exactly 0: every experts implementation (eager, grouped_mm, batched_mm, and
        expert parallelism) computes it and adds 0. The sentinel id ``num_experts`` would be
        skipped by the eager loop, but grouped_mm/batched_mm only honour it in expert-parallel mode.
    (6) the realised routing (ids, kept-slot mask) is remembered, weakly keyed by the z tensor that
        transformers' output recorder collects, for ``load_balancing_loss_func``; plus a
        :class:`RoutingRecord` and a bounded κ histogram per router.

The experts and the MoE blocks read the routing width from ``top_k_index.size(-1)``, never from
``config.num_experts_per_tok``, so a width b ≠ k needs no further patch (checked for 5.19).

Shapes: T = tokens in the call (batch × sequence), E = ``router.num_experts``, k = ``router.top_k``,
b = the schedule's high budget. Attention-mask polarity, as transformers uses it: 1 = real token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from packaging.version import Version
from torch.utils.weak import WeakIdKeyDictionary

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import ConfigError, UnsupportedTransformersError
from elastic_moe_plugin.core.gates import budget_mask, top_p_budgets, weigh_candidates

# The framework-free record type that elastic_moe_plugin.core.metrics turns into logged scalars.
from elastic_moe_plugin.core.metrics import RoutingRecord
from elastic_moe_plugin.core.schedule import BudgetSchedule

logger = logging.getLogger("elastic_moe_plugin.hf")

SUPPORTED_TRANSFORMERS_MIN = Version("5.0")
SUPPORTED_TRANSFORMERS_MAX = Version("5.20")  # exclusive: ms-swift 4.6 caps transformers at <5.20
SUPPORTED_TRANSFORMERS_RANGE = ">=5.0,<5.20"
#: set to 1 to try an untested transformers version anyway
ALLOW_UNSUPPORTED_ENV = "ELASTIC_MOE_ALLOW_UNSUPPORTED_TRANSFORMERS"

_PATCH_MARKER = "__elastic_moe_patched__"
_LAYER_ATTR = "_elastic_layer_index"
#: weakref to the sibling experts module (``mlp.experts``), to learn its implementation at forward
_EXPERTS_ATTR = "_elastic_experts"
_RECORD_ATTR = "_elastic_record"
_HISTOGRAM_ATTR = "_elastic_budget_histogram"
_PLAN_ATTR = "_elastic_plan_cache"
# "...layers.<i>.mlp.gate": the ModuleList index of the decoder layer is its layer_idx.
_ROUTER_NAME = re.compile(r"(?:^|\.)(\d+)\.mlp\.gate$")


# ---------------------------------------------------------------------------------- families
@dataclasses.dataclass(frozen=True)
class RouterFamily:
    """One covered router class and the decoder layer that owns it.

    Attributes:
        name: a label, e.g. ``"olmoe"`` or ``"qwen3_omni_moe.talker"``.
        module: the transformers model folder, ``transformers.models.<module>.modeling_<module>``.
        router: the router class name (``mlp.gate``).
        decoder_layer: the decoder-layer class whose ``__init__(config, layer_idx)`` builds it.
        reads_norm_topk_prob: the stock router renormalises iff ``router.norm_topk_prob``; False
            means it always renormalises (Mixtral, MiniMax, Qwen3.5/VL text).
        casts_weights: the stock router casts the top-k weights to the logits' dtype (False:
            they stay fp32, as in Mixtral and MiniMax).
        required: apply() fails if the installed transformers lacks it (the issue's targets).
    """

    name: str
    module: str
    router: str
    decoder_layer: str
    reads_norm_topk_prob: bool = True
    casts_weights: bool = True
    required: bool = False

    @property
    def module_path(self) -> str:
        return f"transformers.models.{self.module}.modeling_{self.module}"


FAMILIES: tuple[RouterFamily, ...] = (
    RouterFamily("olmoe", "olmoe", "OlmoeTopKRouter", "OlmoeDecoderLayer", required=True),
    RouterFamily("qwen3_moe", "qwen3_moe", "Qwen3MoeTopKRouter", "Qwen3MoeDecoderLayer", required=True),
    RouterFamily("flex_olmo", "flex_olmo", "FlexOlmoTopKRouter", "FlexOlmoDecoderLayer"),
    RouterFamily("qwen2_moe", "qwen2_moe", "Qwen2MoeTopKRouter", "Qwen2MoeDecoderLayer"),
    RouterFamily("qwen3_next", "qwen3_next", "Qwen3NextTopKRouter", "Qwen3NextDecoderLayer"),
    RouterFamily("qwen3_5_moe", "qwen3_5_moe", "Qwen3_5MoeTopKRouter", "Qwen3_5MoeDecoderLayer",
                 reads_norm_topk_prob=False),
    RouterFamily("qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoeTextTopKRouter", "Qwen3VLMoeTextDecoderLayer",
                 reads_norm_topk_prob=False),
    RouterFamily("qwen3_omni_moe.thinker", "qwen3_omni_moe", "Qwen3OmniMoeThinkerTextTopKRouter",
                 "Qwen3OmniMoeThinkerTextDecoderLayer"),
    RouterFamily("qwen3_omni_moe.talker", "qwen3_omni_moe", "Qwen3OmniMoeTalkerTextTopKRouter",
                 "Qwen3OmniMoeTalkerDecoderLayer"),
    RouterFamily("qwen4_exp", "qwen4_exp", "Qwen4ExpTextTopKRouter", "Qwen4ExpTextDecoderLayer"),
    RouterFamily("mixtral", "mixtral", "MixtralTopKRouter", "MixtralDecoderLayer",
                 reads_norm_topk_prob=False, casts_weights=False),
    RouterFamily("minimax", "minimax", "MiniMaxTopKRouter", "MiniMaxDecoderLayer",
                 reads_norm_topk_prob=False, casts_weights=False),
    RouterFamily("mellum", "mellum", "MellumTopKRouter", "MellumDecoderLayer"),
)


def _load_family(family: RouterFamily) -> tuple[Any, type, type] | str:
    """(module, router class, decoder-layer class), or a reason why the family cannot be patched."""
    try:
        module = importlib.import_module(family.module_path)
    except ImportError as error:
        return f"{family.module_path} does not import ({error})"
    router_cls = getattr(module, family.router, None)
    layer_cls = getattr(module, family.decoder_layer, None)
    if router_cls is None or layer_cls is None:
        missing = family.router if router_cls is None else family.decoder_layer
        return f"{family.module_path}.{missing} does not exist"
    # The generic patcher re-implements exactly `forward(self, hidden_states)`; anything else is a
    # different router and must not be replaced silently.
    forward = router_cls.__dict__.get("forward")
    forward = getattr(forward, "__wrapped__", forward) if getattr(forward, _PATCH_MARKER, False) else forward
    if forward is None or list(inspect.signature(forward).parameters) != ["self", "hidden_states"]:
        return f"{family.module_path}.{family.router}.forward is not forward(self, hidden_states)"
    init = layer_cls.__dict__.get("__init__")
    if init is None or "layer_idx" not in inspect.signature(init).parameters:
        return f"{family.module_path}.{family.decoder_layer}.__init__ takes no layer_idx"
    return module, router_cls, layer_cls


def covered_router_classes() -> dict[type, RouterFamily]:
    """{router class: family} for every covered family importable from the installed transformers."""
    classes = {}
    for family in FAMILIES:
        loaded = _load_family(family)
        if not isinstance(loaded, str):
            classes[loaded[1]] = family
    return classes


# ---------------------------------------------------------------------------------- version
def transformers_version() -> Version:
    return Version(importlib.metadata.version("transformers"))


def check_transformers_version() -> Version:
    """Raise :class:`UnsupportedTransformersError` outside ``>=5.0,<5.20`` unless overridden."""
    try:
        found = transformers_version()
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedTransformersError(
            f"elastic_moe_plugin.hf needs transformers {SUPPORTED_TRANSFORMERS_RANGE}, which is not installed: "
            f"pip install 'elastic-moe-plugin[hf]' (or 'transformers{SUPPORTED_TRANSFORMERS_RANGE}')."
        ) from None
    if not SUPPORTED_TRANSFORMERS_MIN <= Version(found.base_version) < SUPPORTED_TRANSFORMERS_MAX:
        if os.environ.get(ALLOW_UNSUPPORTED_ENV, "").lower() in ("1", "true", "yes"):
            logger.warning("elastic-moe: transformers %s is outside the tested range %s; %s is set, trying anyway.",
                           found, SUPPORTED_TRANSFORMERS_RANGE, ALLOW_UNSUPPORTED_ENV)
        else:
            raise UnsupportedTransformersError(
                f"elastic-moe supports transformers {SUPPORTED_TRANSFORMERS_RANGE}, found {found}. Install a "
                f"supported version (pip install 'transformers{SUPPORTED_TRANSFORMERS_RANGE}'), or set "
                f"{ALLOW_UNSUPPORTED_ENV}=1 to try anyway."
            )
    return found


# ---------------------------------------------------------------------------------- patch state
@dataclasses.dataclass
class _PatchState:
    config: ElasticConfig
    originals: list[tuple[Any, str, Any]]  # (owner, attribute, original object)
    families: tuple[str, ...]
    generation: int


_state: _PatchState | None = None
_generation = 0
_lock = threading.RLock()
_warned: set[str] = set()


def apply(config: ElasticConfig | None = None, *, model: torch.nn.Module | None = None) -> None:
    """Patch every covered router class so elastic layers route with ``config`` in training.

    Args:
        config: defaults to :meth:`ElasticConfig.from_env` (``ELASTIC_MOE_*``).
        model: a model built before this call. Its routers are tagged with their layer index
            (:func:`tag_layers`) and the config is checked against it now. Models built after
            ``apply`` are tagged and checked at construction.

    Idempotent: applying the same config again only (re)tags ``model``; a different config
    replaces the active one (existing routers pick it up at their next forward). If ``model``
    rejects the config, the previous state (patched or not) is restored before raising.

    Raises:
        ConfigError: the config does not fit ``model``, or uses a mode this adapter lacks.
        UnsupportedTransformersError: transformers outside the tested range, or a required
            family (OLMoE, Qwen3-MoE) missing or changed.
    """
    global _generation
    config = ElasticConfig.from_env() if config is None else config
    if not isinstance(config, ElasticConfig):
        raise TypeError(f"hf.apply expects an ElasticConfig, got {type(config).__name__}.")
    check_transformers_version()
    previous = active_config()
    with _lock:
        if _state is None or _state.config != config:
            _remove_locked()
            _install_locked(config)
            _generation += 1
            _state.generation = _generation
            logger.info("elastic-moe: patched %d transformers router families (%s) with %s",
                        len(_state.families), ", ".join(_state.families), config)
    if model is not None:
        try:
            tag_layers(model)
            validate_model(model, config)
        except BaseException:
            # A config that does not fit the model must not stay active: restore what was before.
            if previous is None:
                remove()
            elif previous != config:
                apply(previous)
            raise


def _install_locked(config: ElasticConfig) -> None:
    global _state
    originals: list[tuple[Any, str, Any]] = []
    families: list[str] = []
    loss_patched: set[int] = set()
    try:
        for family in FAMILIES:
            loaded = _load_family(family)
            if isinstance(loaded, str):
                if family.required:
                    raise UnsupportedTransformersError(
                        f"elastic-moe cannot patch {family.name}: {loaded}. This transformers "
                        f"({transformers_version()}) differs from the tested {SUPPORTED_TRANSFORMERS_RANGE}; "
                        f"install a tested version."
                    )
                logger.debug("elastic-moe: skipping %s: %s", family.name, loaded)
                continue
            module, router_cls, layer_cls = loaded
            _replace(originals, router_cls, "forward", _make_router_forward(router_cls.__dict__["forward"], family))
            _replace(originals, layer_cls, "__init__",
                     _make_layer_init(layer_cls.__dict__["__init__"], router_cls))
            loss = module.__dict__.get("load_balancing_loss_func")
            if callable(loss) and id(module) not in loss_patched:
                loss_patched.add(id(module))
                _replace(originals, module, "load_balancing_loss_func", _make_load_balancing_loss(loss))
            families.append(family.name)
    except BaseException:
        _restore(originals)
        raise
    _state = _PatchState(config=config, originals=originals, families=tuple(families), generation=0)


def _replace(originals: list, owner: Any, name: str, replacement: Any) -> None:
    originals.append((owner, name, owner.__dict__[name]))
    setattr(owner, name, replacement)
    logger.debug("elastic-moe: patched %s.%s", getattr(owner, "__qualname__", getattr(owner, "__name__", owner)), name)


def _restore(originals: list) -> None:
    for owner, name, original in reversed(originals):
        setattr(owner, name, original)


def remove() -> None:
    """Restore every patched attribute by identity. A no-op if not applied."""
    with _lock:
        _remove_locked()


def _remove_locked() -> None:
    global _state
    if _state is None:
        return
    _restore(_state.originals)
    _state = None


def is_applied() -> bool:
    return _state is not None


def active_config() -> ElasticConfig | None:
    """The config of the current :func:`apply`, or None."""
    return _state.config if _state is not None else None


def patched_symbols() -> list[str]:
    """Dotted names of everything the active patch replaced (empty if not applied)."""
    state = _state
    if state is None:
        return []
    names = []
    for owner, name, _ in state.originals:
        prefix = owner.__name__ if inspect.ismodule(owner) else f"{owner.__module__}.{owner.__qualname__}"
        names.append(f"{prefix}.{name}")
    return names


@contextlib.contextmanager
def patched(config: ElasticConfig | None = None, *, model: torch.nn.Module | None = None) -> Iterator[None]:
    """Context manager: :func:`apply` on entry; on exit restore whatever was applied before."""
    previous = active_config()
    apply(config, model=model)
    try:
        yield
    finally:
        if previous is None:
            remove()
        else:
            apply(previous)


# ---------------------------------------------------------------------------------- patched code
def _make_router_forward(original: Callable, family: RouterFamily) -> Callable:
    @functools.wraps(original)
    def forward(self, hidden_states: torch.Tensor):
        state = _state
        plan = _training_plan(self, family, state) if state is not None else None
        if plan is None:
            return original(self, hidden_states)
        return elastic_route(self, plan, hidden_states)

    setattr(forward, _PATCH_MARKER, True)
    return forward


def _make_layer_init(original: Callable, router_cls: type) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        gate = getattr(getattr(self, "mlp", None), "gate", None)
        if not isinstance(gate, router_cls):
            return  # a dense layer (mlp_only_layers, decoder_sparse_step)
        try:
            arguments = signature.bind(self, *args, **kwargs).arguments
        except TypeError:  # the original accepted it, so this cannot happen; stay harmless anyway
            return
        layer_idx = arguments.get("layer_idx")
        if layer_idx is not None:
            gate.__dict__[_LAYER_ATTR] = int(layer_idx)
        _link_experts(gate, self.mlp)
        state = _state
        if state is not None and state.config.enabled:
            model_config = arguments.get("config")
            num_layers = getattr(model_config, "num_hidden_layers", None)
            validate_router(gate, state.config, num_layers=num_layers)

    setattr(__init__, _PATCH_MARKER, True)
    return __init__


def _make_load_balancing_loss(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return original(gate_logits, num_experts, top_k, attention_mask)
        realised = [_REALISED.get(layer) if isinstance(layer, torch.Tensor) else None for layer in gate_logits]
        if all(entry is None for entry in realised):
            # eval, static schedule, unpatched routers: the stock function, bit for bit
            return original(gate_logits, num_experts, top_k, attention_mask)
        return realised_load_balancing_loss(gate_logits, realised, num_experts, top_k, attention_mask)

    setattr(load_balancing_loss_func, _PATCH_MARKER, True)
    return load_balancing_loss_func


# ---------------------------------------------------------------------------------- plans
@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How one router routes in training, resolved from the config and the router."""

    schedule: BudgetSchedule
    gate: str  # "full_softmax" | "renormalized"
    sampling: str
    layer_index: int | None
    family: RouterFamily
    top_p: float | None = None  # mode="top_p": budgets from the cumulative probability
    top_p_width: int | None = None

    @property
    def width(self) -> int:
        """b: the number of candidate slots returned per token (all experts, or the cap, in top-p mode)."""
        return self.top_p_width if self.top_p is not None else self.schedule.high


def gate_for(router: torch.nn.Module, family: RouterFamily, config: ElasticConfig) -> str:
    """The weighing rule: ``config.gate`` unless ``"auto"``; then the family's own convention
    (``norm_topk_prob`` True → ``"renormalized"``, False → ``"full_softmax"``)."""
    if config.gate != "auto":
        return config.gate
    if family.reads_norm_topk_prob and not getattr(router, "norm_topk_prob", True):
        return "full_softmax"
    return "renormalized"


def validate_router(router: torch.nn.Module, config: ElasticConfig, *, num_layers: int | None = None) -> BudgetSchedule:
    """Check ``config`` against one router (top-k, expert count, layer count) and return its schedule.

    Raises:
        ConfigError: naming the setting, its value and the fix.
    """
    schedule = config.resolve(num_experts=int(router.num_experts), topk=int(router.top_k), num_layers=num_layers)
    if config.sampling == "balanced" and not schedule.is_static and schedule.low + schedule.high != 2 * schedule.center:
        raise ConfigError(
            f"sampling='balanced' needs a schedule symmetric around the model's top-{schedule.center}, got "
            f"{schedule.describe()}: use sampling='iid', or a range with low + high == 2 * {schedule.center}."
        )
    return schedule


def _training_plan(router, family: RouterFamily, state: _PatchState) -> LayerPlan | None:
    """The plan for this forward, or None when the stock forward must run (cached per router)."""
    if not router.training or not state.config.enabled:
        return None
    key = (state.generation, router.__dict__.get(_LAYER_ATTR))
    cached = router.__dict__.get(_PLAN_ATTR)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _resolve_plan(router, family, state.config)
    router.__dict__[_PLAN_ATTR] = (key, plan)
    return plan


def _resolve_plan(router, family: RouterFamily, config: ElasticConfig) -> LayerPlan | None:
    schedule = validate_router(router, config)
    if schedule.is_static and config.mode != "top_p":
        return None
    layer_index = router.__dict__.get(_LAYER_ATTR)
    if layer_index is None and config.layer_set is not None:
        raise ConfigError(
            f"layers={config.layers!r} needs each router's decoder-layer index, but this "
            f"{type(router).__name__} has none (the model was built before elastic_moe_plugin.hf.apply). "
            f"Call hf.apply(config, model=model) or hf.tag_layers(model), build the model after apply, "
            f"or leave `layers` unset."
        )
    if layer_index is not None and not config.layer_is_elastic(layer_index):
        return None
    gate = gate_for(router, family, config)
    if schedule.low == 1 and gate == "renormalized" and "low1" not in _warned:
        _warned.add("low1")
        logger.warning(
            "elastic-moe: schedule %s with a renormalised gate: tokens drawn with κ=1 get gate weight 1 and "
            "no task gradient through the router gate (seed 000). Consider low >= 2 or gate='full_softmax'.",
            schedule.describe())
    if config.mode == "top_p":
        width = config.top_p_max_experts or int(router.num_experts)
        return LayerPlan(schedule=schedule, gate=gate, sampling=config.sampling, layer_index=layer_index, family=family,
                         top_p=config.top_p, top_p_width=width)
    return LayerPlan(schedule=schedule, gate=gate, sampling=config.sampling, layer_index=layer_index, family=family)


# ---------------------------------------------------------------------------------- routing
#: router_logits tensor → (candidate ids LongTensor [T, b], kept-slot mask BoolTensor [T, b]).
#: Keyed by object identity (a tensor's == is elementwise) and weakly, so entries die with the logits.
_REALISED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _in_backward() -> bool:
    """True while autograd runs a backward pass, i.e. during a checkpoint's recompute.

    Reentrant checkpointing runs its first forward without grad and recomputes inside backward;
    non-reentrant recomputes inside backward too. Counting only outside backward counts every
    routed token exactly once per step in both modes (and without checkpointing).
    """
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def elastic_route(
    router: torch.nn.Module, plan: LayerPlan, hidden_states: torch.Tensor, budgets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elastic replacement of a covered router's ``forward`` for one training call (steps 1-6).

    Args:
        hidden_states: ``[..., H]`` (the MoE block passes ``[T, H]``).
        budgets: ``LongTensor[T]`` to use instead of drawing from the schedule (tests).

    Returns:
        ``router_logits [T, E]`` (the logits' dtype), ``top_k_weights [T, b]`` (the logits' dtype, or
        fp32 for families that keep fp32 weights), ``top_k_index LongTensor[T, b]``: the stock
        contract with width b; slots j >= κ_t have weight exactly 0 and hold the sentinel
        ``num_experts`` for eager experts (skipped, no compute), else a real expert id.
    """
    hidden = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden, router.weight)  # (1) exactly as the stock router
    num_tokens = router_logits.shape[0]
    width = plan.width
    if budgets is None and plan.top_p is None:
        budgets = plan.schedule.sample(num_tokens, plan.sampling, device=router_logits.device)  # (2)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (3) as stock: fp32 softmax
    candidates, candidate_ids = torch.topk(probs, width, dim=-1)  # sorted by rank, like stock top-k
    if budgets is None:  # mode="top_p": the smallest top-ranked set reaching the probability mass
        budgets = top_p_budgets(candidates.detach(), plan.top_p)
    kept = budget_mask(budgets, width)  # (4)
    if plan.gate == "renormalized":
        # The gradient reaches the kept logits only (w_i = softmax over the kept z), so a κ = 1 token
        # has weight exactly 1 and gate gradient exactly 0 (seed 000), not fp32 rounding residue.
        selected_logits = torch.gather(router_logits.float(), 1, candidate_ids)
        weights = weigh_candidates("renormalized", candidates, kept, selected_logits=selected_logits)
    else:
        weights = weigh_candidates(plan.gate, candidates, kept)
    retained_weight_sums = weights.detach().sum(dim=-1)
    if plan.family.casts_weights:
        weights = weights.to(router_logits.dtype)
    _remember(router, plan, router_logits, budgets, candidate_ids, kept, retained_weight_sums)  # (6)
    if _experts_skip_sentinel(router):
        # The eager experts loop skips index num_experts: slots beyond κ cost nothing, so expert
        # compute follows E[κ] = k instead of b (grouped_mm/batched_mm compute every slot; there
        # the real candidate with weight 0 keeps them correct).
        return router_logits, weights, torch.where(kept, candidate_ids, int(router.num_experts))  # (5)
    return router_logits, weights, candidate_ids  # (5)


def _link_experts(router: torch.nn.Module, mlp: torch.nn.Module | None) -> None:
    experts = getattr(mlp, "experts", None) if mlp is not None else None
    if isinstance(experts, torch.nn.Module):
        router.__dict__[_EXPERTS_ATTR] = weakref.ref(experts)


def _experts_skip_sentinel(router: torch.nn.Module) -> bool:
    """Whether the sibling experts run transformers' eager loop, which skips index num_experts.

    Only the eager loop honours that sentinel outside expert parallelism (frameworks.md); any
    other implementation, an unknown experts module, or expert parallelism keeps real indices.
    """
    reference = router.__dict__.get(_EXPERTS_ATTR)
    experts = reference() if reference is not None else None
    if experts is None or getattr(experts, "_is_expert_parallel", False):
        return False
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", "unknown")
    return implementation == "eager"


def _remember(router, plan: LayerPlan, router_logits, budgets, candidate_ids, kept, retained_weight_sums) -> None:
    _REALISED[router_logits] = (candidate_ids.detach(), kept)
    if _in_backward():
        return  # a checkpoint recompute replays the same κ; the step was counted in the forward
    router.__dict__[_RECORD_ATTR] = RoutingRecord(
        budgets=budgets.detach(),
        expert_ids=torch.where(kept, candidate_ids, -1).detach(),
        retained_weight_sums=retained_weight_sums,
    )
    histogram = router.__dict__.get(_HISTOGRAM_ATTR)
    if histogram is None or histogram.numel() != plan.width + 1 or histogram.device != budgets.device:
        histogram = torch.zeros(plan.width + 1, dtype=torch.long, device=budgets.device)
        router.__dict__[_HISTOGRAM_ATTR] = histogram
    histogram.scatter_add_(0, budgets, torch.ones_like(budgets))


# ---------------------------------------------------------------------------------- aux loss
def realised_load_balancing_loss(
    gate_logits: tuple[torch.Tensor, ...],
    realised: list[tuple[torch.Tensor, torch.Tensor] | None],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' Switch load-balancing loss, with each layer's counts from what was dispatched.

    With N = Σ_layers Σ_t m_t (m_t = attention-mask value of token t, 1 without a mask)::

        loss = E · Σ_e (c_e / N) · (P_e / N),   P_e = Σ_layers Σ_t m_t · softmax(z_t)_e
        c_e  = Σ_layers Σ_t m_t · #{kept slots of token t routed to e}

    This is transformers' own normalisation (``load_balancing_loss_func`` in 5.19); only c_e
    changes: realised counts for layers in ``realised``, the stock top-k recount (``top_k`` on the
    logits) for layers whose entry is None (eval, static layers). Σ_e c_e / N is the mean number
    of experts per (layer, token): k for static top-k, the realised mean κ for elastic layers.

    Args:
        gate_logits: per layer ``[T, E]`` router logits, T = batch × sequence.
        realised: per layer ``(candidate ids [T, b], kept mask [T, b])`` or None.
        attention_mask: ``[batch, sequence]``, 1 = real token, or None.
    """
    compute_device = gate_logits[0].device
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    total_rows: Any = 0.0
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=compute_device, dtype=torch.float32)

    for layer_gate, entry in zip(gate_logits, realised):
        # Stock P: softmax in the logits' dtype, then fp32 sums (kept identical to transformers).
        routing_weights = torch.nn.functional.softmax(layer_gate.to(compute_device), dim=-1)
        if entry is None:
            _, expert_ids = torch.topk(routing_weights, top_k, dim=-1)
            slot_weights = torch.ones(expert_ids.shape, dtype=torch.float32, device=compute_device)
        else:
            expert_ids = entry[0].to(compute_device)
            slot_weights = entry[1].to(device=compute_device, dtype=torch.float32)
        if flat_mask is None:
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:
            slot_weights = slot_weights * flat_mask.unsqueeze(-1)
            router_prob_sum = router_prob_sum + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
        # Unkept slots add weight 0: no boolean indexing, so no host sync.
        tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(
            num_experts, dtype=torch.float32, device=compute_device
        ).scatter_add_(0, expert_ids.reshape(-1), slot_weights.reshape(-1))

    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts


# ---------------------------------------------------------------------------------- models
def _routers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, RouterFamily]]:
    classes = covered_router_classes()
    for name, module in model.named_modules():
        family = classes.get(type(module))
        if family is not None:
            yield name, module, family


def _index_from_name(name: str) -> int | None:
    match = _ROUTER_NAME.search(name)
    return int(match.group(1)) if match else None


def tag_layers(model: torch.nn.Module) -> dict[str, int]:
    """Tag every covered router of ``model`` with its 0-based decoder-layer index.

    Models built after :func:`apply` are tagged at construction (from ``layer_idx``); this is the
    path for models built before. The index is the router's position in its ``layers``
    ModuleList (``...layers.<i>.mlp.gate``), which is ``layer_idx`` in every covered family.

    Returns:
        {module name: layer index} of the tagged routers.

    Raises:
        ValueError: ``model`` holds no covered router, or one whose name does not reveal its layer.
    """
    tagged: dict[str, int] = {}
    found = False
    for name, router, _ in _routers(model):
        found = True
        index = _index_from_name(name)
        if index is None:
            raise ValueError(
                f"cannot tell the decoder-layer index of router {name!r}: expected a module path ending in "
                f"'<layers>.<i>.mlp.gate'. Set router.{_LAYER_ATTR} = <0-based index> by hand."
            )
        router.__dict__[_LAYER_ATTR] = index
        _link_experts(router, model.get_submodule(name.rpartition(".")[0]) if "." in name else None)
        tagged[name] = index
    if not found:
        names = ", ".join(family.router for family in FAMILIES)
        raise ValueError(f"{type(model).__name__} contains no covered MoE router (covered: {names}).")
    return tagged


def validate_model(model: torch.nn.Module, config: ElasticConfig) -> None:
    """Check ``config`` against every covered router of ``model``.

    Raises:
        ConfigError: naming the setting, its value and the fix.
    """
    if not config.enabled:
        return
    for name, router, _ in _routers(model):
        num_layers = None
        parent_name = name.rsplit(".mlp.gate", 1)[0].rpartition(".")[0]
        with contextlib.suppress(AttributeError):
            num_layers = len(model.get_submodule(parent_name)) if parent_name else None
        validate_router(router, config, num_layers=num_layers)


def _collect(model: torch.nn.Module, attribute: str) -> dict[int, Any]:
    values: dict[int, Any] = {}
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        value = module.__dict__.get(attribute)
        if value is None:
            continue
        index = module.__dict__.get(_LAYER_ATTR)
        if index is None:
            index = _index_from_name(name)
        if index is None:
            index = len(values)
        if index in values:
            raise ValueError(
                f"routers {names[index]!r} and {name!r} both have decoder-layer index {index}: the model has "
                f"several MoE stacks (e.g. Qwen3-Omni's thinker and talker). Pass one stack, e.g. "
                f"routing_records(model.thinker)."
            )
        values[index] = value
        names[index] = name
    return dict(sorted(values.items()))


def routing_records(model: torch.nn.Module) -> dict[int, RoutingRecord]:
    """{0-based layer index: RoutingRecord} of every elastic router's latest training forward."""
    return _collect(model, _RECORD_ATTR)


def budget_histograms(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """{0-based layer index: LongTensor [b+1]}: κ counts (index = κ) since the last reset.

    Bounded in size; every routed token is counted once per step, also under gradient checkpointing.
    """
    return _collect(model, _HISTOGRAM_ATTR)


def reset_budget_histograms(model: torch.nn.Module) -> None:
    for histogram in budget_histograms(model).values():
        histogram.zero_()


def routing_metrics(model: torch.nn.Module) -> dict[str, float]:
    """Scalars for a trainer's logs from the records and κ histograms (one host sync per call).

    ``{"elastic_moe/layer_<i>/<name>": ..., "elastic_moe/<name>": ...}`` as computed by
    :func:`elastic_moe_plugin.core.metrics.routing_metrics` (mean κ, κ shares, exposure per rank,
    retained weight sums, expert load imbalance); empty if no router has routed elastically.
    Call :func:`reset_budget_histograms` after logging to make each log cover its own steps.
    """
    from elastic_moe_plugin.core import metrics

    records, histograms = routing_records(model), budget_histograms(model)
    # The schedule and expert count of an elastic router (its cached plan); a model's elastic
    # routers share both.
    for module in model.modules():
        cached = module.__dict__.get(_PLAN_ATTR)
        if cached is not None and cached[1] is not None and (records or histograms):
            return metrics.routing_metrics(records, histograms, cached[1].schedule, int(module.num_experts))
    return {}


__all__ = [
    "ALLOW_UNSUPPORTED_ENV", "FAMILIES", "SUPPORTED_TRANSFORMERS_RANGE", "LayerPlan", "RouterFamily",
    "RoutingRecord", "UnsupportedTransformersError", "active_config", "apply", "budget_histograms",
    "check_transformers_version", "covered_router_classes", "elastic_route", "gate_for", "is_applied",
    "patched", "patched_symbols", "realised_load_balancing_loss", "remove", "reset_budget_histograms",
    "routing_metrics", "routing_records", "tag_layers", "transformers_version", "validate_model", "validate_router",
]
