"""The patch layer: version guard, ``apply``/``remove``/``patched``, start-up validation, per-router
plans, and the explicit-spec route (``ElasticTopKRouter``)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.metadata
import logging
import os
import threading
from typing import Any, Callable, Iterator

import torch

from packaging.version import Version

from elastic_moe_plugin.core.config import ConfigError, ElasticConfig
from elastic_moe_plugin.mcore import dispatch
from elastic_moe_plugin.mcore.routing import LayerPlan, UnsupportedMegatronError, elastic_routing

logger = logging.getLogger("elastic_moe_plugin.mcore")

SUPPORTED_MCORE_MIN = Version("0.16")
SUPPORTED_MCORE_MAX = Version("0.20")  # exclusive
SUPPORTED_MCORE_RANGE = ">=0.16,<0.20"
#: set to 1 to try an untested megatron-core version anyway
ALLOW_UNSUPPORTED_ENV = "ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE"

_PATCH_MARKER = "__elastic_moe_patched__"

# ---------------------------------------------------------------------------------- version
def megatron_core_version() -> Version:
    return Version(importlib.metadata.version("megatron-core"))


def check_megatron_version() -> Version:
    """Raise :class:`UnsupportedMegatronError` outside ``>=0.16,<0.20`` unless overridden."""
    found = megatron_core_version()
    if not SUPPORTED_MCORE_MIN <= Version(found.base_version) < SUPPORTED_MCORE_MAX:
        if os.environ.get(ALLOW_UNSUPPORTED_ENV, "").lower() in ("1", "true", "yes"):
            logger.warning("elastic-moe: megatron-core %s is outside the tested range %s; %s is set, trying anyway.",
                           found, SUPPORTED_MCORE_RANGE, ALLOW_UNSUPPORTED_ENV)
        else:
            raise UnsupportedMegatronError(
                f"elastic-moe supports megatron-core {SUPPORTED_MCORE_RANGE}, found {found}. Install a "
                f"supported version (pip install 'megatron-core{SUPPORTED_MCORE_RANGE}'), or set "
                f"{ALLOW_UNSUPPORTED_ENV}=1 to try anyway."
            )
    return found


# ---------------------------------------------------------------------------------- patch state
@dataclasses.dataclass
class _PatchState:
    config: ElasticConfig
    originals: dict[str, Any]
    generation: int


_state: _PatchState | None = None
_generation = 0
_lock = threading.Lock()
_warned: set[str] = set()


def _router_module():
    from megatron.core.transformer.moe import router

    return router


def apply(config: ElasticConfig | None = None) -> None:
    """Patch ``TopKRouter`` so elastic layers route with ``config`` in training.

    ``config`` defaults to :meth:`ElasticConfig.from_env`. Idempotent: applying the same config
    again does nothing; applying a different one replaces it (routers built earlier pick it up at
    their next forward). Call before building the model so the start-up checks run.
    """
    global _state, _generation
    config = ElasticConfig.from_env() if config is None else config
    if not isinstance(config, ElasticConfig):
        raise TypeError(f"mcore.apply expects an ElasticConfig, got {type(config).__name__}.")
    check_megatron_version()
    with _lock:
        if _state is not None and _state.config == config:
            return
        if _state is not None:
            _remove_locked()
        router_module = _router_module()
        cls = router_module.TopKRouter
        originals = {name: _unpatched(cls.__dict__[name]) for name in ("routing", "__init__")}
        cls.routing = _make_patched_routing(originals["routing"])
        cls.__init__ = _make_patched_init(originals["__init__"])
        dispatch.install("patch")
        _generation += 1
        _state = _PatchState(config=config, originals=originals, generation=_generation)
    logger.info("elastic-moe: patched megatron.core.transformer.moe.router.TopKRouter.{routing,__init__} and %s "
                "with %s", ", ".join(dispatch.installed_targets()), config)


def _unpatched(function: Callable) -> Callable:
    """The stock function under any elastic patch: a second copy of this module (ms-swift loads
    ``--external_plugins`` files under a hashed module name) must not wrap the first one's patch."""
    while getattr(function, _PATCH_MARKER, False):
        function = function.__wrapped__
    return function


def remove() -> None:
    """Restore every patched attribute of ``TopKRouter`` by identity. A no-op if not applied."""
    with _lock:
        _remove_locked()


def _remove_locked() -> None:
    global _state
    if _state is None:
        return
    cls = _router_module().TopKRouter
    for name, original in _state.originals.items():
        setattr(cls, name, original)
    dispatch.uninstall("patch")
    _state = None


def is_applied() -> bool:
    return _state is not None


def active_config() -> ElasticConfig | None:
    """The config of the current :func:`apply`, or None."""
    return _state.config if _state is not None else None


@contextlib.contextmanager
def patched(config: ElasticConfig | None = None) -> Iterator[None]:
    """Context manager: :func:`apply` on entry; on exit restore whatever was applied before."""
    previous = active_config()
    apply(config)
    try:
        yield
    finally:
        if previous is None:
            remove()
        else:
            apply(previous)


def _make_patched_routing(original: Callable) -> Callable:
    @functools.wraps(original)
    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        state = _state
        plan = _training_plan(self, state.config, state.generation) if state is not None else None
        if plan is None:
            return original(self, logits, padding_mask=padding_mask)
        return elastic_routing(self, plan, logits, padding_mask)

    setattr(routing, _PATCH_MARKER, True)
    routing.__wrapped__ = original
    return routing


def _make_patched_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        state = _state
        if state is not None:
            validate_router(self, state.config)

    setattr(__init__, _PATCH_MARKER, True)
    __init__.__wrapped__ = original
    return __init__


# ---------------------------------------------------------------------------------- validation
def _model_num_layers(config) -> int:
    return int(config.num_layers)


def validate_router(router, config: ElasticConfig) -> None:
    """Start-up checks of ``config`` against one router's model config. Raises ConfigError /
    UnsupportedMegatronError with the option to change."""
    if not config.enabled:
        return
    model = router.config
    schedule = config.resolve(num_experts=model.num_moe_experts, topk=model.moe_router_topk,
                              num_layers=_model_num_layers(model))
    top_p = config.mode == "top_p"
    if schedule.is_static and not top_p:
        return
    width = _top_p_width(model, config) if top_p else schedule.high
    problems = []
    if top_p and model.moe_router_score_function != "softmax":
        problems.append(f"mode='top_p' reads the budget off full-softmax probabilities, but "
                        f"moe_router_score_function={model.moe_router_score_function!r}; use mode='elastic'")
    if router.routing_type in ("sinkhorn", "quantile_balancing"):
        problems.append(f"moe_router_load_balancing_type={router.routing_type!r} picks experts by its own "
                        f"balancing algorithm with a fixed k; use 'aux_loss', 'seq_aux_loss', "
                        f"'global_aux_loss' or 'none'")
    if getattr(model, "moe_router_fusion", False):
        problems.append("moe_router_fusion=True (Transformer Engine's fused top-k takes one scalar k); set "
                        "--moe-router-fusion off for elastic training")
    if getattr(model, "moe_enable_routing_replay", False):
        problems.append("moe_enable_routing_replay=True replays [T, topk] buffers recorded with a fixed k; "
                        "disable routing replay")
    inference_router = any(cls.__name__ == "InferenceTopKRouter" for cls in type(router).__mro__)
    if getattr(model, "transformer_impl", None) == "inference_optimized" or inference_router:
        what = ("transformer_impl='inference_optimized'" if getattr(model, "transformer_impl", None) == "inference_optimized"
                else f"the router class {type(router).__name__} (an InferenceTopKRouter)")
        problems.append(f"{what}: InferenceTopKRouter and the inference-optimised token dispatchers exchange dense "
                        f"[T, topk] buffers with a fixed k; train with the stock TopKRouter, transformer_impl="
                        f"'transformer_engine' or 'local' (elastic layers route static top-k in eval, so the "
                        f"checkpoint then serves on the inference-optimised layers unchanged)")
    if (_captures_moe_preprocess(model) and config.sampling == "iid" and not model.moe_pad_expert_input_to_capacity
            and model.moe_token_dispatcher_type == "alltoall"):
        problems.append("a CUDA graph that captures the dispatcher's preprocess (scope 'moe_preprocess' in "
                        "cuda_graph_modules, cuda_graph_scope before megatron-core 0.19, which cuda_graph_impl='local' "
                        "adds to 'moe_router'; a whole-layer scope; or cuda_graph_impl='full_iteration') with "
                        "sampling='iid': a dropless alltoall dispatch is then sized from the realised Σκ, a "
                        "device-to-host sync Megatron also refuses to capture (as with a capacity factor); remove "
                        "'moe_preprocess' (and 'moe_router' with cuda_graph_impl='local') from the CUDA-graph scope, "
                        "or use sampling='balanced' (Σκ = T·k, no sync) or drop-and-pad "
                        "(moe_pad_expert_input_to_capacity)")
    num_groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    if group_topk:
        per_group = model.num_moe_experts // num_groups
        reachable = group_topk * per_group
        if width > reachable or width // group_topk < 1:
            problems.append(f"group-limited routing keeps {group_topk} of {num_groups} groups "
                            f"({reachable} experts), fewer than the upper budget {width}; "
                            + ("set top_p_max_experts to at most that" if top_p else "narrow the schedule")
                            + " or raise moe_router_group_topk")
    if problems:
        what = f"mode='top_p' (p={config.top_p})" if top_p else f"schedule {schedule.describe()}"
        raise UnsupportedMegatronError(
            f"elastic-moe cannot route {what} with this Megatron config: " + "; ".join(problems) + "."
        )
    if schedule.low == 1 and _gate_for(model, config) in ("renormalized", "sigmoid_auto") and "low1" not in _warned:
        _warned.add("low1")
        layers = config.layers or "all MoE layers"
        logger.warning(
            "elastic-moe: schedule %s with a renormalised gate (layers %s): tokens drawn with κ=1 get "
            "gate weight 1 and no task gradient through the router gate (seed 000). Consider low >= 2 "
            "or gate='full_softmax'.", schedule.describe(), layers)


def _top_p_width(model_config, config: ElasticConfig) -> int:
    """Candidate slots of ``mode="top_p"``: every expert, or ``top_p_max_experts``."""
    return config.top_p_max_experts or model_config.num_moe_experts


def _captures_moe_preprocess(model_config) -> bool:
    """Whether a per-layer CUDA graph captures ``MoELayer.preprocess`` (the dispatcher's sizing).

    megatron-core 0.19 names the scope list ``cuda_graph_modules`` (``cuda_graph_scope`` is migrated
    into it); 0.16 names it ``cuda_graph_scope``. Entries are enums or, set by hand, strings.
    """
    impl = getattr(model_config, "cuda_graph_impl", "none")
    if impl in (None, "none"):
        return False
    if impl == "full_iteration":  # 0.19: one graph for the whole forward-backward
        return True
    scopes = getattr(model_config, "cuda_graph_modules", None)
    if scopes is None:
        scopes = getattr(model_config, "cuda_graph_scope", None)
    if isinstance(scopes, str):
        scopes = scopes.split(",")
    names = {getattr(scope, "name", scope) for scope in scopes or ()} - {"full"}
    if not names:  # an empty scope (or the deprecated "full") captures the whole layer
        return True
    if impl == "local" and "moe_router" in names:
        names.add("moe_preprocess")  # Megatron's local implementation captures both together
    return "moe_preprocess" in names


def _gate_for(model_config, config: ElasticConfig) -> str:
    if model_config.moe_router_score_function in ("sigmoid", "sqrtsoftplus"):
        return {"auto": "sigmoid_auto", "renormalized": "renormalized", "full_softmax": "full_softmax"}[config.gate]
    if config.gate != "auto":
        return config.gate
    return "full_softmax" if model_config.moe_router_pre_softmax else "renormalized"


def _training_plan(router, config: ElasticConfig, generation: int) -> LayerPlan | None:
    """The plan for this forward, or None when the stock path must run (cached per router)."""
    if not router.training or not config.enabled:
        return None
    key = (generation, router.layer_number)
    cached = router.__dict__.get("_elastic_plan_cache")
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _resolve_plan(router, config)
    router.__dict__["_elastic_plan_cache"] = (key, plan)
    return plan


def _resolve_plan(router, config: ElasticConfig) -> LayerPlan | None:
    if getattr(router, "is_mtp_layer", False):
        return None
    model = router.config
    schedule = config.resolve(num_experts=model.num_moe_experts, topk=model.moe_router_topk)
    if schedule.is_static and config.mode != "top_p":
        return None
    layer_number = getattr(router, "layer_number", None)
    if layer_number is None:
        if config.layer_set is not None:
            raise ConfigError(
                f"layers={config.layers!r} needs the router's layer number, but this TopKRouter has none "
                f"(Megatron sets it when a TransformerLayer is built). Call router.set_layer_number(n) "
                f"with the 1-based layer number, or leave `layers` unset."
            )
        layer_index = None
    else:
        layer_index = int(layer_number) - 1  # Megatron: 1-based, pipeline offsets included
        if layer_index >= _model_num_layers(model):
            # An MTP layer: megatron-core 0.16 numbers them after the decoder (num_layers + i) and
            # has no is_mtp_layer flag on the router; MTP layers stay stock.
            return None
        if not config.layer_is_elastic(layer_index):
            return None
    validate_router(router, config)
    if config.mode == "top_p":
        return LayerPlan(schedule=schedule, gate=_gate_for(model, config), sampling="iid", layer_index=layer_index,
                         top_p=config.top_p, top_p_width=_top_p_width(model, config))
    return LayerPlan(schedule=schedule, gate=_gate_for(model, config), sampling=config.sampling, layer_index=layer_index)


# ---------------------------------------------------------------------------------- explicit spec
def _stock_routing() -> Callable:
    """The unpatched ``TopKRouter.routing``, whether or not :func:`apply` is active."""
    state = _state
    return state.originals["routing"] if state is not None else _unpatched(_router_module().TopKRouter.__dict__["routing"])


def _elastic_router_class():
    router_module = _router_module()

    class ElasticTopKRouter(router_module.TopKRouter):
        """A ``TopKRouter`` that routes elastically with its class's ``elastic_config``.

        Build one bound to a config with :meth:`with_config` (what :func:`elastic_router_spec`
        does). Shares :func:`elastic_routing` with the monkey-patch.
        """

        elastic_config: ElasticConfig = ElasticConfig()

        def __init__(self, *args, **kwargs):
            check_megatron_version()
            super().__init__(*args, **kwargs)
            validate_router(self, self.elastic_config)
            # Its maps reach stock dispatchers too; the fixes stay for the life of the process.
            dispatch.install("spec")

        @classmethod
        def with_config(cls, config: ElasticConfig) -> type:
            return type(cls.__name__, (cls,), {"elastic_config": config, "__module__": __name__})

        def routing(self, logits, padding_mask=None):
            plan = _training_plan(self, self.elastic_config, -id(self.elastic_config))
            if plan is None:
                return _stock_routing()(self, logits, padding_mask=padding_mask)
            return elastic_routing(self, plan, logits, padding_mask)

    return ElasticTopKRouter


_elastic_router_cls = None


def __getattr__(name: str):
    global _elastic_router_cls
    if name == "ElasticTopKRouter":
        if _elastic_router_cls is None:
            _elastic_router_cls = _elastic_router_class()
        return _elastic_router_cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def elastic_router_spec(spec, config: ElasticConfig):
    """A deep copy of a layer/block/MoE ``ModuleSpec`` whose MoE routers are ``ElasticTopKRouter``
    bound to ``config``. Raises ValueError if the spec contains no MoE submodules."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    router_class = __getattr__("ElasticTopKRouter").with_config(config)
    spec = copy.deepcopy(spec)
    replaced = 0

    def visit(node, seen):
        nonlocal replaced
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, MoESubmodules):
            node.router = router_class
            replaced += 1
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                visit(getattr(node, field.name), seen)
        elif isinstance(node, functools.partial):
            # megatron-core >= 0.19 specs are partials, e.g. partial(MoELayer, submodules=MoESubmodules(...))
            visit(node.args, seen)
            visit(node.keywords, seen)
        elif isinstance(node, (list, tuple)):
            for item in node:
                visit(item, seen)
        elif isinstance(node, dict):
            for item in node.values():
                visit(item, seen)
        elif hasattr(node, "submodules") and not isinstance(node, type):
            visit(node.submodules, seen)

    visit(spec, set())
    if replaced == 0:
        raise ValueError("elastic_router_spec: the spec contains no MoE layer (no MoESubmodules found).")
    return spec
