"""The torchtitan patch: version guard, install targets, layer tags, the start-up plan line and metrics.

What is patched (class-level, restored by identity; the lifecycle is
:class:`~elastic_moe_plugin.core.patching.PatchLifecycle`):

- ``torchtitan.models.common.moe.MoE.forward``: in training, elastic layers run
  :func:`.routing.elastic_forward`; in eval mode, for ``schedule="static"``, ``enabled=False`` and
  layers outside ``ElasticConfig.layers`` the stock forward runs, bit for bit. Every model
  torchtitan registers routes through this class (GPT-OSS's ``GptOssMoE`` inherits its forward).
- ``LocalTokenDispatcher._local_reorder`` (inherited by the all-to-all and TorchAO dispatchers):
  an elastic forward's call keeps only its Σκ kept pairs (:func:`.routing.kept_pairs_reorder`).
- ``Decoder.__init__``: runs the original, then tags each MoE of ``layers[i]`` with its 0-based
  layer index i (an MoE outside ``layers``, DeepSeek-V3's multi-token-prediction layers, stays
  static), checks the config against the model and logs the plan line (every rank, at model build).
- ``Trainer.Config._validate_cuda_graphs``, ``CheckpointManager.__init__``,
  ``MetricsProcessor.log``: :mod:`.trainer` (start-up refusals and κ's seed, κ's stream in DCP
  checkpoints, routing metrics), each installed when its module is imported.

Nothing else is touched: parameters, buffers and state-dict keys are stock, so checkpoints are
interchangeable with unpatched torchtitan (a resumed step checkpoint carries one more entry, κ's
stream).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from packaging.version import Version

from elastic_moe_plugin.core import metrics as core_metrics
from elastic_moe_plugin.core import plan as core_plan
from elastic_moe_plugin.core import records as core_records
from elastic_moe_plugin.core.config import ElasticConfig, log_layout
from elastic_moe_plugin.core.errors import UnsupportedTorchtitanError
from elastic_moe_plugin.core.layer_keys import LayerKey
from elastic_moe_plugin.core.patching import AttributePatches, PatchLifecycle, VersionGuard
from elastic_moe_plugin.core.plan import LayerPlan
from elastic_moe_plugin.core.records import RouterSite
from elastic_moe_plugin.core.router_state import ensure_state, state_of
from elastic_moe_plugin.titan import rules, trainer
from elastic_moe_plugin.titan.routing import kept_pairs_reorder, patched_moe_forward

logger = logging.getLogger("elastic_moe_plugin.titan")

# exclusive maximum: the release tested (0.3.0); torchtitan changes its MoE code between minors
VERSION_GUARD = VersionGuard(
    "torchtitan",
    Version("0.3"),
    Version("0.4"),
    "ELASTIC_MOE_ALLOW_UNSUPPORTED_TORCHTITAN",
    UnsupportedTorchtitanError,
    extra="titan",
    module="torchtitan",
)
SUPPORTED_TORCHTITAN_RANGE, ALLOW_UNSUPPORTED_ENV = VERSION_GUARD.range, VERSION_GUARD.override_env

#: MoE modules of a model outside its ``layers`` (multi-token prediction): static, never elastic
_OUTSIDE_LAYERS: weakref.WeakSet = weakref.WeakSet()


def torchtitan_version() -> Version | None:
    """The version of the ``torchtitan`` Python imports (:meth:`VersionGuard.imported_version`)."""
    return VERSION_GUARD.imported_version()


# ---------------------------------------------------------------------------------- install
def _install(config: ElasticConfig, patches: AttributePatches) -> None:
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.common.moe import MoE
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    patches.wrap(MoE, "forward", functools.partial(patched_moe_forward, lifecycle=_PATCH, resolve_plan=resolve_plan))
    patches.wrap(LocalTokenDispatcher, "_local_reorder", kept_pairs_reorder)
    patches.wrap(Decoder, "__init__", _tagging_init)
    patches.when_imported(
        "torchtitan.trainer",
        lambda module: patches.wrap(
            module.Trainer.Config,
            "_validate_cuda_graphs",
            functools.partial(trainer.validating_config, lifecycle=_PATCH),
        ),
    )
    patches.when_imported(
        "torchtitan.components.checkpointer.dcp",
        lambda module: patches.wrap(
            module.CheckpointManager, "__init__", functools.partial(trainer.with_stream_state, lifecycle=_PATCH)
        ),
    )
    patches.when_imported(
        "torchtitan.components.metrics",
        lambda module: patches.wrap(
            module.MetricsProcessor, "log", functools.partial(trainer.logging_metrics, read_metrics=logged_metrics)
        ),
    )


_PATCH = PatchLifecycle("titan", _install, VERSION_GUARD, lambda: torchtitan_version(), logger)
check_torchtitan_version = _PATCH.check_version
remove = _PATCH.remove
is_applied = _PATCH.is_applied
active_config = _PATCH.active_config
patched_symbols = _PATCH.symbols


def apply(config: ElasticConfig | None = None) -> None:
    """Patch torchtitan's MoE layers (class-level) so every model built afterwards routes elastically
    in training under ``config`` (None: :meth:`ElasticConfig.from_env`). Idempotent; call in every
    process before the trainer builds the model, or let ``--override.imports
    elastic_moe_plugin.titan.elastic_moe`` call it.

    Raises:
        UnsupportedTorchtitanError: the installed torchtitan is outside the tested range.
    """
    _PATCH.apply(config)


@contextlib.contextmanager
def patched(config: ElasticConfig | None = None) -> Iterator[None]:
    """``apply(config)`` for the block; the previous state (another config, or none) afterwards."""
    with _PATCH.patched(apply, config):
        yield


# ---------------------------------------------------------------------------------- layers
def _tagging_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        tag_layers(self)
        if _PATCH.config is not None:
            log_plan(self)

    return __init__


def tag_layers(model: torch.nn.Module) -> dict[str, int]:
    """Tag every MoE of ``model.layers[i]`` with its 0-based layer index i; an MoE elsewhere in the
    model (multi-token prediction) stays static. Returns {module name: layer index}."""
    from torchtitan.models.common.moe import MoE

    tagged: dict[str, int] = {}
    layers = getattr(model, "layers", None)
    for index, layer in layers.items() if layers is not None else ():
        for name, module in layer.named_modules():
            if isinstance(module, MoE):
                ensure_state(module).layer_index = int(index)
                tagged[f"layers.{index}.{name}"] = int(index)
    for module in model.modules():
        if isinstance(module, MoE) and state_of(module) is None:
            _OUTSIDE_LAYERS.add(module)
    return tagged


def resolve_plan(moe: torch.nn.Module, config: ElasticConfig) -> LayerPlan | None:
    """The MoE's training plan under ``config`` (:func:`.rules.resolve_plan`); None outside ``layers``."""
    if moe in _OUTSIDE_LAYERS:
        return None
    return rules.resolve_plan(moe, config)


def moe_sites(model_parts: list[torch.nn.Module] | torch.nn.Module) -> list[RouterSite]:
    """Every tagged MoE of the model parts, in module order, as the records front end reads them."""
    from torchtitan.models.common.moe import MoE

    parts = model_parts if isinstance(model_parts, list) else [model_parts]
    sites = []
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE) and module not in _OUTSIDE_LAYERS:
                state = state_of(module)
                index = None if state is None else state.layer_index
                sites.append(RouterSite(name, module, index, module.router.top_k, module.router.num_experts))
    return sites


def model_plans(model: torch.nn.Module) -> tuple[dict[LayerKey, LayerPlan | None], dict[LayerKey, int]]:
    """``({layer: training plan, None = stock top-k}, {layer: k})`` under the active config."""
    sites = moe_sites(model)
    num_layers = len(getattr(model, "layers", ())) or None
    config = _PATCH.config
    return core_records.model_plans(
        sites,
        config,
        lambda site: None if config is None else rules.resolve_plan(site.router, config, num_layers=num_layers),
    )


def log_plan(model: torch.nn.Module) -> str | None:
    """Check the active config against ``model`` and log (rank 0, once) its start-up plan line.

    Raises:
        ConfigError: the config does not fit the model (every rank raises it at model build).
    """
    plans, topk = model_plans(model)
    return core_plan.log_plan(plans, topk, "torchtitan", _PATCH.config)


def logged_metrics(model_parts: list[torch.nn.Module]) -> dict[str, float]:
    """The routing metrics a step's log gets (``ElasticConfig.log_metrics``: every layer's and the
    layer means, the means only, or none), then the κ histograms restart."""
    config = _PATCH.config
    if config is None or log_layout(config.log_metrics) == "off":
        return {}
    sites = moe_sites(model_parts)
    values = core_metrics.model_routing_metrics(sites, per_layer=log_layout(config.log_metrics) == "layers")
    core_records.reset_budget_histograms(sites)
    return values


__all__ = [
    "ALLOW_UNSUPPORTED_ENV",
    "SUPPORTED_TORCHTITAN_RANGE",
    "VERSION_GUARD",
    "active_config",
    "apply",
    "check_torchtitan_version",
    "is_applied",
    "log_plan",
    "logged_metrics",
    "model_plans",
    "moe_sites",
    "patched",
    "patched_symbols",
    "remove",
    "resolve_plan",
    "tag_layers",
    "torchtitan_version",
]
