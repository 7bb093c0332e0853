"""The transformers patch: version guard, install targets, the start-up plan line and the model checks.

Per covered family (``transformers.models.<family>.modeling_<family>``, see :mod:`.families`):

- ``<Router>.forward`` (or the block's routing method, DBRX's and Jamba 5.19's
  ``route_tokens_to_experts``): in training, elastic layers run :func:`.routing.patched_forward`'s
  elastic path; in eval mode, for ``schedule="static"``, for ``enabled=False`` and in layers outside
  ``ElasticConfig.layers`` the original method runs, so results are bit-for-bit stock.
- ``<DecoderLayer>.__init__`` (each class that builds the router): runs the original, then tags its
  routers (``self.mlp.gate``, or the family's sites: ``mlp.router``, ``router``, ...) with the
  0-based decoder-layer index (``layer_idx``; the router itself does not know it) and checks the
  config against the model (:class:`~elastic_moe_plugin.core.errors.ConfigError` at model build).
- ``<Family>Experts.forward`` (transformers' implementation dispatcher): a call whose
  ``top_k_index`` an elastic router marked multiplies only the Σκ kept rows, in every experts
  implementation (:mod:`.experts`); any other call runs the stock dispatcher, bitwise stock. The
  family's own experts that sum over slots (DBRX, Step-3.7 in 5.19, Ergo) run their own forward
  on the kept pairs (:func:`.experts.own_experts_forward`).
- ERNIE-4.5-VL's ``Ernie4_5_VLMoeMoeBlock.forward``: the slots its two routers dispatched, merged
  by token type for the logits the loss reads (:func:`.routing.merging_block_forward`).
- ``modeling_<family>.load_balancing_loss_func``: counts the *realised* assignments of logits that
  came from an elastic router (paper §3.2); for any other logits the original runs, bitwise stock.
- ``transformers.trainer.Trainer._save_rng_state`` / ``_load_rng_state``: the Trainer's
  ``rng_state`` files also carry κ's stream (:mod:`.budget_rng`), so a resumed run continues the κ
  sequence.
- ``torch.manual_seed`` / ``torch.random.manual_seed``: run the original, then reset κ's stream to
  the same seed (what ``transformers.set_seed`` and the Trainer's seeding call), so an explicit
  re-seed reaches κ (:mod:`.budget_rng`; two integer assignments per call).
- ``transformers.distributed.mixin.DistributedMixin.maybe_distribute_model`` (a classmethod,
  redirected): runs the original, then tags the routers of a tensor-parallel model with their
  tensor-parallel group, so TP peers draw the same κ (:func:`.budget_rng.tag_tensor_parallel`).

Nothing else is touched: parameters, buffers and state-dict keys are stock, so checkpoints are
interchangeable with unpatched transformers. The lifecycle (lock, idempotence,
identity restore) is :class:`~elastic_moe_plugin.core.patching.PatchLifecycle`.

Plans, the same calls as in :mod:`elastic_moe_plugin.mcore.patch`, live in :mod:`.plans`:
``gate_for`` (the weighing rule of a router under a config) and ``resolve_plan`` (a router's
training plan, uncached: what the start-up plan line shows, and what the patched forward resolves
into the router's state once per patch generation, :func:`.routing.resolve_state`). Visibility
follows one rule in both adapters: what another module of the package calls or the adapter
package exports has no underscore and a docstring; what only this module uses is private.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from packaging.version import Version

from elastic_moe_plugin.core import plan as core_plan
from elastic_moe_plugin.core import records as core_records
from elastic_moe_plugin.core.config import ElasticConfig, log_layout
from elastic_moe_plugin.core.errors import ConfigError, UnsupportedTransformersError
from elastic_moe_plugin.core.layer_keys import LayerKey
from elastic_moe_plugin.core.patching import AttributePatches, PatchLifecycle, VersionGuard
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.hf import budget_rng
from elastic_moe_plugin.hf.experts import experts_forward, install_expert_parallel, own_experts_forward
from elastic_moe_plugin.hf.families import (
    FAMILIES,
    RouterFamily,
    covered_routers,
    imported_router_classes,
    installed_family,
    layer_index_from_name,
    load_family,
    router_site,
    set_layer_index,
    static_routers,
    uncovered_moe,
)
from elastic_moe_plugin.hf.plans import resolve_plan, validate_router
from elastic_moe_plugin.hf.records import router_keys, router_sites, routing_metrics
from elastic_moe_plugin.hf.routing import (
    dispatched_slots,
    merging_block_forward,
    patched_forward,
    realised_load_balancing_loss,
)

logger = logging.getLogger("elastic_moe_plugin.hf")


def transformers_version() -> Version | None:
    """The version of the ``transformers`` Python imports, i.e. of the code :func:`apply` patches
    (:meth:`VersionGuard.imported_version`: the imported package's ``__version__`` first, as the
    Megatron guard reads it).

    Raises:
        importlib.metadata.PackageNotFoundError: ``transformers`` is not importable.
    """
    return VERSION_GUARD.imported_version()


# exclusive maximum: the newest release tested (5.25); ms-swift 4.6 caps its own door at <5.20
VERSION_GUARD = VersionGuard(
    "transformers",
    Version("5.0"),
    Version("5.26"),
    "ELASTIC_MOE_ALLOW_UNSUPPORTED_TRANSFORMERS",
    UnsupportedTransformersError,
    extra="hf",
    module="transformers",
)
SUPPORTED_TRANSFORMERS_RANGE, ALLOW_UNSUPPORTED_ENV = VERSION_GUARD.range, VERSION_GUARD.override_env


# ---------------------------------------------------------------------------------- install
def _install(config: ElasticConfig, patches: AttributePatches) -> None:
    """Wrap the router forward, the decoder-layer ``__init__``, the experts forward and the aux loss
    of every covered family: the required families (OLMoE, Qwen3-MoE) now, so that a transformers
    without them fails here; every other family when its modeling module is imported (now if it
    is), so that a process pays for the modules its model uses, not for every family's (importing
    the other 50 took about 1.2 s of a process's start-up on a CPU core)."""
    loss_patched: set[int] = set()  # families sharing a modeling module share one loss function
    for family in FAMILIES:
        if family.required:
            _install_family(family, patches, loss_patched)
        else:
            patches.when_imported(
                family.module_path,
                functools.partial(_install_imported_family, family=family, patches=patches, loss_patched=loss_patched),
            )
    from transformers.modeling_utils import PreTrainedModel

    patches.wrap(PreTrainedModel, "post_init", _refuse_uncovered_moe)  # never silently static
    install_expert_parallel(patches)  # transformers' expert-parallel styles dispatch only the kept pairs
    budget_rng.install(patches)  # κ's stream: the Trainer's rng_state files, the re-seed, TP tagging


def _install_imported_family(
    module: Any, *, family: RouterFamily, patches: AttributePatches, loss_patched: set[int]
) -> None:
    _install_family(family, patches, loss_patched)


def _install_family(family: RouterFamily, patches: AttributePatches, loss_patched: set[int]) -> None:
    loaded = load_family(family)
    if isinstance(loaded, str):
        if family.required:
            raise UnsupportedTransformersError(
                f"elastic-moe cannot patch {family.name}: {loaded}. This transformers "
                f"({transformers_version()}) differs from the tested {SUPPORTED_TRANSFORMERS_RANGE}; "
                f"install a tested version."
            )
        logger.debug("elastic-moe: skipping %s: %s", family.name, loaded)
        return
    installed = installed_family(family, loaded)
    patches.wrap(
        loaded.router,
        family.patched_method,
        functools.partial(patched_forward, family=installed, lifecycle=_PATCH, resolve_plan=resolve_plan),
    )
    for layer_cls in loaded.decoder_layers:
        patches.wrap(layer_cls, "__init__", functools.partial(_layer_init, router_cls=loaded.router, family=installed))
    if loaded.experts is not None:
        patches.wrap(loaded.experts, "forward", own_experts_forward if loaded.own_experts else experts_forward)
    elif family.required:
        raise UnsupportedTransformersError(
            f"elastic-moe cannot cut expert compute to κ in {family.name}: {family.module_path}.{family.experts} "
            f"is not transformers' experts dispatcher over forward(hidden_states, top_k_index, top_k_weights). "
            f"This transformers ({transformers_version()}) differs from the tested {SUPPORTED_TRANSFORMERS_RANGE}; "
            f"install a tested version."
        )
    else:
        logger.debug(
            "elastic-moe: %s experts stay stock (every slot computed): %s.%s has another shape",
            family.name,
            family.module_path,
            family.experts,
        )
    module = loaded.module
    if family.merging_block is not None:
        patches.wrap(getattr(module, family.merging_block), "forward", merging_block_forward)
    if callable(module.__dict__.get("load_balancing_loss_func")) and id(module) not in loss_patched:
        loss_patched.add(id(module))
        patches.wrap(module, "load_balancing_loss_func", _load_balancing_loss)


# The lambda reads transformers_version at call time (tests substitute it).
_PATCH = PatchLifecycle("hf", _install, VERSION_GUARD, lambda: transformers_version(), logger)
#: raise UnsupportedTransformersError outside the tested range unless ELASTIC_MOE_ALLOW_UNSUPPORTED_TRANSFORMERS=1
check_transformers_version = _PATCH.check_version


def _site(layer: torch.nn.Module, site: str) -> Any:
    """The module at ``site`` (``"mlp.gate"``) of ``layer``, or None where the layer has none."""
    found: Any = layer
    for part in site.split("."):
        found = getattr(found, part, None)
    return found


def _layer_init(original: Callable, router_cls: type, family: RouterFamily) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # every router the layer holds (ERNIE-4.5-VL: a text and a vision one)
        gates = [
            router for router in map(functools.partial(_site, self), family.sites) if isinstance(router, router_cls)
        ]
        if not gates:
            return  # a dense layer (mlp_only_layers, first_k_dense_replace), or a static router's
        try:
            arguments = signature.bind(self, *args, **kwargs).arguments
        except TypeError:  # the original accepted it, so this cannot happen; stay harmless anyway
            return
        layer_idx, model_config, config = arguments.get("layer_idx"), arguments.get("config"), _PATCH.config
        for gate in gates:
            if layer_idx is not None:
                set_layer_index(gate, int(layer_idx))
            if config is not None and config.enabled:
                num_layers = getattr(model_config, "num_hidden_layers", None)
                validate_router(gate, family, config, num_layers=num_layers, model_config=model_config)

    return __init__


def _refuse_uncovered_moe(original: Callable) -> Callable:
    """``PreTrainedModel.post_init`` (the last step of every model's ``__init__``), then: refuse a
    mixture-of-experts model none of whose routers this adapter covers, while an enabled config is
    active, unless the config allows it (it would train silently at static top-k)."""

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        config = _PATCH.config
        if config is not None and config.enabled and not config.allow_uncovered_routers:
            reason = uncovered_moe(self)
            if reason is not None:
                raise ConfigError(
                    f"{reason}: elastic-moe cannot route it elastically, and it would train at static top-k. "
                    f"Set {config.spell('allow_uncovered_routers', True)} to train it static on purpose, "
                    f"or {config.spell('enabled', False)} (docs/transformers.md lists the covered families).",
                    field="allow_uncovered_routers",
                    fixes=({"allow_uncovered_routers": True}, {"enabled": False}),
                )
        return result

    return post_init


def _load_balancing_loss(original: Callable) -> Callable:
    @functools.wraps(original)
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return original(gate_logits, num_experts, top_k, attention_mask)
        dispatched = dispatched_slots(gate_logits)
        if all(entry is None for entry in dispatched):
            # eval, static schedule, unpatched routers: the stock function, bit for bit
            return original(gate_logits, num_experts, top_k, attention_mask)
        return realised_load_balancing_loss(gate_logits, dispatched, num_experts, top_k, attention_mask)

    return load_balancing_loss_func


# ---------------------------------------------------------------------------------- lifecycle
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
    config = _PATCH.resolve(config)
    with _PATCH.rollback_on_error():
        _PATCH.apply(config)
        if model is not None:
            tag_layers(model)
            validate_model(model, config)
            log_plan(model)


#: restore every patched attribute by identity (a no-op when not applied)
remove = _PATCH.remove
is_applied = _PATCH.is_applied
active_config = _PATCH.active_config
#: dotted names of everything the active patch replaced (empty when not applied)
patched_symbols = _PATCH.symbols


@contextlib.contextmanager
def patched(config: ElasticConfig | None = None, *, model: torch.nn.Module | None = None) -> Iterator[None]:
    """Context manager: :func:`apply` on entry; on exit restore whatever was applied before."""
    with _PATCH.patched(apply, config, model=model):
        yield


# ---------------------------------------------------------------------------------- plans
def model_plans(model: torch.nn.Module) -> tuple[dict[LayerKey, LayerPlan | None], dict[LayerKey, int]]:
    """({layer index: training plan, None = stock top-k}, {layer index: top-k}) of every covered
    router of ``model`` under the active config, resolved as the router's first training forward
    resolves it (:func:`resolve_plan`; nothing is cached); ``({}, {})`` when no config is active
    or it is disabled. Layer indices as :mod:`.records` keys them."""
    config = _PATCH.config
    if config is None:
        return {}, {}
    families = imported_router_classes()
    plans, topk = core_records.model_plans(
        router_sites(model), config, lambda site: resolve_plan(site.router, families[type(site.router)], config)
    )
    return plans, topk


def _static_reasons(model: torch.nn.Module) -> dict[LayerKey, str]:
    """{key: why} of the routers that cannot rank (:func:`.families.static_routers`)."""
    keys = router_keys(model)
    return {keys[name]: why for name, _, _, why in static_routers(model) if name in keys}


def log_plan(model: torch.nn.Module) -> str | None:
    """Log (rank 0, once) and return the start-up line of :func:`~elastic_moe_plugin.core.plan.describe_plans`
    for ``model``; None when no config is active. Layers whose router cannot rank are shown static
    with the reason (DeepSeek-V4's hash-routed layers)."""
    plans, topk = model_plans(model)
    return core_plan.log_plan(
        plans, topk, "transformers", _PATCH.active_config(), static_reasons=_static_reasons(model)
    )


def logged_metrics(model: torch.nn.Module) -> dict[str, float]:
    """The routing metrics a training log gets, as the active config's ``log_metrics`` says (the
    default when none is active): every layer's and the layer means (``layers``: transformers has
    no per-layer switch of its own), the layer means only (``means``), or ``{}`` with nothing read
    (``off``); :func:`.records.routing_metrics` otherwise. Call
    :func:`.records.reset_budget_histograms` after logging."""
    config = _PATCH.active_config()
    layout = log_layout(None if config is None else config.log_metrics)
    if layout == "off":
        return {}
    return routing_metrics(model, per_layer=layout == "layers")


# ---------------------------------------------------------------------------------- models
def tag_layers(model: torch.nn.Module) -> dict[str, int]:
    """Tag every covered router of ``model`` with its 0-based decoder-layer index.

    Models built after :func:`apply` are tagged at construction (from ``layer_idx``); this is the
    path for models built before. The index is the router's position in its ``layers``
    ModuleList (``...layers.<i>.<site>``, e.g. ``mlp.gate``), which is ``layer_idx`` in every covered family.

    Returns:
        {module name: layer index} of the tagged routers.

    Raises:
        ValueError: ``model`` holds no covered router, or one whose name does not reveal its layer.
    """
    tagged: dict[str, int] = {}
    found = False
    for name, router, _ in covered_routers(model):
        found = True
        index = layer_index_from_name(name)
        if index is None:
            raise ValueError(
                f"cannot tell the decoder-layer index of router {name!r}: expected a module path ending in "
                f"'<layers>.<i>.mlp.gate' (or another router site of its family). "
                f"Call elastic_moe_plugin.hf.set_layer_index(router, <0-based index>)."
            )
        set_layer_index(router, index)
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
    for name, router, family in covered_routers(model):
        num_layers: Any = None
        site = router_site(name)
        parent_name = name.removesuffix(f".{site}").rpartition(".")[0] if site else ""
        with contextlib.suppress(AttributeError):
            layers = model.get_submodule(parent_name) if parent_name else None
            num_layers = len(layers) if isinstance(layers, Sized) else None
        validate_router(router, family, config, num_layers=num_layers, model_config=getattr(model, "config", None))
