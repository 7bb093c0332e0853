"""The Megatron-core patch: version guard, install targets, start-up validation and per-router plans.

What is patched (all on ``megatron.core.transformer.moe.router.TopKRouter``, so subclasses such as
mcore-bridge's router and layers built from every stock spec are covered, whenever they were built):

- ``TopKRouter.routing``: in training, elastic layers run :func:`.routing.elastic_forward`; in eval
  mode, in layers outside ``ElasticConfig.layers``, in MTP layers, and for ``schedule="static"``
  the original method runs unchanged, so results are bit-for-bit stock (with ``moe_router_fusion``,
  Transformer Engine's fused top-k included; elastic layers route unfused). The replacement takes
  the stock method's arguments as ``*args, **kwargs`` and passes them all on; the elastic path
  reads ``padding_mask`` and refuses, at the first call, any other argument not at its default
  (:func:`.routing.elastic_arguments`), so a Megatron that adds one fails loudly rather than
  being silently ignored.
- ``TopKRouter.__init__``: runs the original, then validates the config against the router's model
  config (top-k, expert count, layer count, unsupported options), so a bad setting stops the run at
  model build on every rank instead of mid-training.
- the token-dispatcher fixes of :mod:`.dispatch`.

Not patched: the ``TopKRouter`` name itself. ``MoESubmodules.router`` binds its default at import
time, so rebinding the name would silently do nothing. The router's parameters and buffers are
untouched, so checkpoints stay interchangeable with stock Megatron and transformers. The lifecycle
(lock, idempotence, identity restore) is :class:`~elastic_moe_plugin.core.patching.PatchLifecycle`.

Plans, the same calls as in :mod:`elastic_moe_plugin.hf.patch`: :func:`gate_for` (the weighing
rule of a router under a config) and :func:`resolve_plan` (a router's training plan, uncached:
what the start-up plan line of :func:`log_plan` shows, and what the patched ``routing`` and
``ElasticTopKRouter`` resolve into the router's state, :func:`.routing.training_state`).
Visibility follows one rule in both adapters: what another module of the package calls or the
adapter package exports has no underscore and a docstring; what only this module uses is private.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator

import torch
from packaging.version import Version

from elastic_moe_plugin.core import plan as core_plan
from elastic_moe_plugin.core import records as core_records
from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import ConfigError, UnsupportedMegatronError
from elastic_moe_plugin.core.patching import AttributePatches, PatchLifecycle, VersionGuard
from elastic_moe_plugin.core.plan import LayerPlan, warn_if_top1_gate_is_constant
from elastic_moe_plugin.mcore import budget_rng, dispatch, hybrid_pattern
from elastic_moe_plugin.mcore.options import check_model_options
from elastic_moe_plugin.mcore.options import top_p_width as _top_p_width
from elastic_moe_plugin.mcore.records import is_mtp_router, model_chunks, router_sites
from elastic_moe_plugin.mcore.routing import patched_routing

logger = logging.getLogger("elastic_moe_plugin.mcore")

VERSION_GUARD = VersionGuard(
    "megatron-core",
    Version("0.16"),
    Version("0.20"),
    "ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE",
    UnsupportedMegatronError,
    extra="megatron",
    module="megatron.core",
)
SUPPORTED_MCORE_RANGE, ALLOW_UNSUPPORTED_ENV = VERSION_GUARD.range, VERSION_GUARD.override_env


def megatron_core_version() -> Version | None:
    """The version of the ``megatron.core`` Python imports, i.e. of the code :func:`apply` patches
    (:meth:`VersionGuard.imported_version`): ``megatron.core.__version__`` (``package_info.py``, in
    the wheel and in a Megatron-LM source tree alike), so that a checkout first on ``sys.path``, as
    ``python -m elastic_moe_plugin.megatron_lm SCRIPT`` arranges, is judged, not a wheel behind it.

    Raises:
        importlib.metadata.PackageNotFoundError: ``megatron.core`` is not importable.
    """
    return VERSION_GUARD.imported_version()


# ---------------------------------------------------------------------------------- install
def router_module():
    from megatron.core.transformer.moe import router

    return router


def _install(config: ElasticConfig, patches: AttributePatches) -> None:
    router_class = router_module().TopKRouter
    patches.wrap(
        router_class, "routing", functools.partial(patched_routing, lifecycle=_PATCH, resolve_plan=resolve_plan)
    )
    patches.wrap(router_class, "__init__", _patched_init)
    dispatch.install(patches)
    patches.on_restore(dispatch.reinstall_spec_fixes)


# The lambda reads megatron_core_version at call time (tests substitute it).
_PATCH = PatchLifecycle("mcore", _install, VERSION_GUARD, lambda: megatron_core_version(), logger)
#: raise UnsupportedMegatronError outside the tested range unless ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE=1
check_megatron_version = _PATCH.check_version


def _patched_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = _PATCH.config
        if config is not None:
            validate_router(self, config)
            _ROUTERS.add(self)
            if (
                config.enabled
                and not config.resolve(
                    num_experts=self.config.num_moe_experts, topk=self.config.moe_router_topk
                ).is_static
            ):
                # Seeded now, after Megatron seeds its tracker and before load_checkpoint restores
                # a saved stream (mcore.budget_rng).
                budget_rng.ensure_registered()

    return __init__


#: every TopKRouter built while the patch was applied (weakly), for logging hooks that get no model
_ROUTERS: weakref.WeakSet = weakref.WeakSet()


def built_routers() -> list[torch.nn.Module]:
    """The live ``TopKRouter`` instances built while the patch was applied, in no particular order."""
    return list(_ROUTERS)


# ---------------------------------------------------------------------------------- lifecycle
def apply(config: ElasticConfig | None = None) -> None:
    """Patch ``TopKRouter`` so elastic layers route with ``config`` in training.

    ``config`` defaults to :meth:`ElasticConfig.from_env`. Idempotent: applying the same config
    again does nothing; applying a different one replaces it (routers built earlier pick it up at
    their next forward). Call before building the model so the start-up checks run.
    """
    _PATCH.apply(config)


#: restore every patched attribute by identity (a no-op when not applied)
remove = _PATCH.remove
is_applied = _PATCH.is_applied
active_config = _PATCH.active_config
#: dotted names of everything the active patch replaced (empty when not applied)
patched_symbols = _PATCH.symbols


@contextlib.contextmanager
def patched(config: ElasticConfig | None = None) -> Iterator[None]:
    """Context manager: :func:`apply` on entry; on exit restore whatever was applied before."""
    with _PATCH.patched(apply, config):
        yield


# ---------------------------------------------------------------------------------- validation
def validate_router(router, config: ElasticConfig) -> None:
    """Start-up checks of ``config`` against one router's model config. Raises ConfigError /
    UnsupportedMegatronError with the option to change."""
    if not config.enabled:
        return
    inference_router = any(cls.__name__ == "InferenceTopKRouter" for cls in type(router).__mro__)
    schedule = check_model_options(
        router.config,
        config,
        score_function=router.score_function,
        routing_type=router.routing_type,
        router_class=type(router).__name__ if inference_router else None,
    )
    if schedule is not None:
        warn_if_top1_gate_is_constant(schedule, gate_for(router, config), f"layers {config.layers or 'all MoE layers'}")


def gate_for(router, config: ElasticConfig) -> str:
    """The weighing rule (``LayerPlan.gate``) of ``router`` under ``config``, for the router's score
    function now (``router.score_function``: what stock routes with; the config's
    ``moe_router_score_function`` is only read at construction): ``config.gate`` unless ``"auto"``
    (sigmoid / sqrtsoftplus: ``"auto"`` → ``"sigmoid_auto"``); softmax ``"auto"`` → ``"full_softmax"``
    with ``moe_router_pre_softmax``, else ``"renormalized"`` (``docs/gates.md``)."""
    if router.score_function in ("sigmoid", "sqrtsoftplus"):
        return {"auto": "sigmoid_auto", "renormalized": "renormalized", "full_softmax": "full_softmax"}[config.gate]
    if config.gate != "auto":
        return config.gate
    return "full_softmax" if router.config.moe_router_pre_softmax else "renormalized"


def resolve_plan(router, config: ElasticConfig) -> LayerPlan | None:
    """The training plan of ``router`` under ``config`` (uncached, start-up checks included), None
    for stock top-k: an MTP layer, a static schedule, a layer outside ``ElasticConfig.layers``.

    Raises:
        ConfigError: ``layers`` is set and the router has no layer number.
        UnsupportedMegatronError: :func:`validate_router` refuses the router's Megatron config.
    """
    if is_mtp_router(router):
        # megatron-core 0.17+ flags MTP routers; 0.16 numbers them after the decoder (num_layers + i)
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
        if not config.layer_is_elastic(layer_index):
            return None
    validate_router(router, config)
    if config.mode == "top_p":
        return LayerPlan(
            schedule=schedule,
            gate=gate_for(router, config),
            sampling="iid",
            layer_index=layer_index,
            top_p=config.top_p,
            top_p_width=_top_p_width(model, config),
        )
    return LayerPlan(
        schedule=schedule, gate=gate_for(router, config), sampling=config.sampling, layer_index=layer_index
    )


def model_plans(model) -> tuple[dict[int, LayerPlan | None], dict[int, int]]:
    """({0-based global layer index: training plan, None = stock top-k}, {layer index: top-k}) of
    the decoder-layer routers of a module or of model chunks (:func:`.records.router_sites`) under
    :func:`active_config`, resolved as a first training forward resolves them (:func:`resolve_plan`;
    nothing is cached); ``({}, {})`` without an active, enabled config."""
    config = _PATCH.config
    if config is None:
        return {}, {}
    plans, topk = core_records.model_plans(router_sites(model), config, lambda site: resolve_plan(site.router, config))
    return core_records.layer_indexed(plans), core_records.layer_indexed(topk)


def moe_indices(model) -> dict[int, int]:
    """{0-based layer number: MoE index} of the model's MoE layers, all pipeline stages: the ``E``
    layers of a ``HybridModel``'s pattern, else every ``moe_layer_freq``-th decoder layer
    (:func:`.hybrid_pattern.moe_layer_numbers`); empty without a router."""
    sites = router_sites(model)
    if not sites:
        return {}
    model_config = sites[0].router.config
    pattern = hybrid_pattern.pattern_of_modules(module for chunk in model_chunks(model) for module in chunk.modules())
    numbers = hybrid_pattern.moe_layer_numbers(
        int(model_config.num_layers), getattr(model_config, "moe_layer_freq", 1), pattern
    )
    return {layer: index for index, layer in enumerate(numbers)}


#: the plan line's note under ``moe_router_fusion`` when some layer routes elastically
ROUTER_FUSION_NOTE = (
    "moe_router_fusion: Transformer Engine's fused top-k stays on the static layers and in evaluation; "
    "the elastic layers route unfused in training"
)


def _fusion_note(model, plans: dict[int, LayerPlan | None]) -> str | None:
    """:data:`ROUTER_FUSION_NOTE` where the routers fuse and some layer routes elastically."""
    if not any(plan is not None for plan in plans.values()):
        return None
    sites = router_sites(model)
    return ROUTER_FUSION_NOTE if sites and getattr(sites[0].router.config, "moe_router_fusion", False) else None


def log_plan(model) -> str | None:
    """Log (rank 0, once) and return the start-up plan line for a module or model chunks; None
    without an active, enabled config. Where a layer's number is not its MoE index (a
    ``HybridModel``), the line shows both (:func:`moe_indices`); under ``moe_router_fusion`` it
    says where the fused top-k runs (:data:`ROUTER_FUSION_NOTE`)."""
    plans, topk = model_plans(model)
    moe_index = moe_indices(model) if plans else None
    note = _fusion_note(model, plans)
    return core_plan.log_plan(plans, topk, "megatron-core", _PATCH.active_config(), moe_index, note)
