"""Routing metrics in Megatron-LM's own log: a wrap of ``megatron.training.training.training_log``.

``python -m elastic_moe_plugin.megatron_lm`` installs it unless ``ElasticConfig.log_metrics`` is
``off`` (``--elastic-moe-log-metrics off``); a script of one's own can call :func:`install` before
training (a step under ``off`` then writes nothing). At every
step on which Megatron-LM prints its console line (``iteration % --log-interval == 0``, and the
first iteration), on every rank, before Megatron's own logging:

1. the per-layer routing metrics of the elastic routers (:mod:`elastic_moe_plugin.core.metrics`:
   realised κ and its histogram, exposure P(κ ≥ r) next to the schedule's a(r), retained gate
   weight, tokens-per-expert imbalance, share of tokens off the static top-k set) are recorded
   into a Megatron MoE metrics tracker and reported with Megatron's own report: summed over
   pipeline stages, averaged over data parallelism (all names in two collectives:
   ``compat.megatron_tracker.isolated``), written to Megatron-LM's TensorBoard and W&B
   writers as ``elastic_moe/<name>`` (mean over the model's elastic MoE layers), and with
   ``--moe-per-layer-logging`` (Megatron's switch for its aux losses) and ``log_metrics`` ``layers``
   (the default; ``means``: the layer means only) also as ``moe/elastic_moe/<name>_layer_<i>``; a
   run without ``--tensorboard-dir`` or ``--wandb-project`` reports only the console's metrics
   (:func:`reported_metrics`);
2. a few of them (:data:`CONSOLE_METRICS`, layer means) are appended to the MoE section of
   Megatron's console line, next to ``load_balancing_loss``: megatron-core >= 0.17 builds that
   section from ``MoEMetricsTracker.report``'s return value, which a second wrap extends while
   this step's ``training_log`` runs (0.16 has no such section: TensorBoard/W&B only);
3. the κ histograms are reset, so each log covers the steps since the previous one.

Why ``training_log``: it is the one function Megatron-LM's ``train()`` calls once per iteration to
log, on every rank (the report's collectives need them all), after the optimizer step, with the
iteration number; it has had that role and name in every Megatron-LM release, and ``train()`` looks
it up in the module at call time, so a module-level wrap reaches it. The alternatives are either
too wide (``MoEMetricsTracker.report`` also serves other loops and has no notion of a logging step)
or too deep (the console string is built inside ``training_log``). Nothing runs on other steps
beyond one modulo, so non-logging steps pay no host sync; a logging step pays what the metrics
cost (one read per metric, ``docs/diagnostics.md``).

Version guard: at install (when ``megatron.training.training`` is imported) the signature of
``training_log`` must bind an ``iteration`` argument, else :class:`UnsupportedMegatronError` names
the symbol and the flag that turns the hook off. The router patch's version range applies as well
(the entry point applies it first, on the same Megatron).

The metrics need no model: the routers come from :func:`elastic_moe_plugin.mcore.patch.built_routers`
(every ``TopKRouter`` built while the patch was applied), the schedule from the active config and
Megatron-LM's arguments (``--num-experts``, ``--moe-router-topk``, ``--num-layers``,
``--moe-layer-freq``), identical on every rank, so every rank reports the same names even where a
pipeline stage holds no elastic layer.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from elastic_moe_plugin.compat import megatron_tracker
from elastic_moe_plugin.core import metrics
from elastic_moe_plugin.core.config import ElasticConfig, log_layout
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.core.patching import AttributePatches, PatchSwitch
from elastic_moe_plugin.core.schedule import BudgetSchedule
from elastic_moe_plugin.mcore import hybrid_pattern, patch, tracking

logger = logging.getLogger("elastic_moe_plugin.mcore.training_log")

TRAINING_MODULE = "megatron.training.training"
#: layer means shown on Megatron's console line (everything goes to TensorBoard / W&B)
CONSOLE_METRICS = ("mean_kappa", "retained_weight_sum_mean", "tokens_per_expert_max_over_mean", "topk_set_changed_frac")

#: the console fragment of the logging step in progress, consumed by the next MoE report
_PENDING_CONSOLE: list[str] = []


# ---------------------------------------------------------------------------------- lifecycle
def install() -> None:
    """Wrap Megatron-LM's ``training_log`` (now, or when ``megatron.training.training`` is
    imported). Idempotent; :func:`remove` restores it by identity.

    Raises:
        UnsupportedMegatronError: this ``training_log`` takes no ``iteration`` argument.
    """
    _SWITCH.on()


def remove() -> None:
    """Restore ``training_log`` (and ``MoEMetricsTracker.report``) and ``setup_model_and_optimizer``;
    cancel a pending install."""
    _SWITCH.off()
    _PLAN_SWITCH.off()
    _PENDING_CONSOLE.clear()


def install_plan_line() -> None:
    """Print the start-up plan line (:func:`elastic_moe_plugin.mcore.log_plan`: which layers route
    elastically, with their MoE index in a ``HybridModel``) once Megatron-LM has built the model:
    a wrap of ``megatron.training.training.setup_model_and_optimizer``, now or at its import.
    Idempotent; a Megatron-LM without that function is left alone (no plan line)."""
    _PLAN_SWITCH.on()


def is_installed() -> bool:
    """Whether :func:`install` is in effect (the wrap may still wait for the module's import)."""
    return _SWITCH.is_on


def _install(patches: AttributePatches, module: types.ModuleType) -> None:
    stock = vars(module).get("training_log")
    parameters = inspect.signature(stock).parameters if callable(stock) else {}
    if "iteration" not in parameters:
        raise UnsupportedMegatronError(
            f"elastic-moe logs its routing metrics by wrapping {TRAINING_MODULE}.training_log(..., iteration, ...), "
            f"but this Megatron-LM has {'no such function' if stock is None else 'no iteration argument there'}. "
            f"Pass --elastic-moe-log-metrics off, and log with elastic_moe_plugin.mcore.log_routing_metrics."
        )
    patches.wrap(module, "training_log", _logging_step)
    if megatron_tracker.has_metrics_tracker():
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

        patches.wrap(MoEMetricsTracker, "report", _with_console_fragment)


_SWITCH = PatchSwitch(lambda patches: patches.when_imported(TRAINING_MODULE, functools.partial(_install, patches)))


def _install_plan_line(patches: AttributePatches, module: types.ModuleType) -> None:
    if callable(vars(module).get("setup_model_and_optimizer")):
        patches.wrap(module, "setup_model_and_optimizer", _with_plan_line)


_PLAN_SWITCH = PatchSwitch(
    lambda patches: patches.when_imported(TRAINING_MODULE, functools.partial(_install_plan_line, patches))
)


def _with_plan_line(original: Callable) -> Callable:
    @functools.wraps(original)
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        line = patch.log_plan(result[0])  # the model chunks; logged at INFO on rank 0
        plan_logger = logging.getLogger("elastic_moe_plugin.core.plan")
        shown = plan_logger.isEnabledFor(logging.INFO) and plan_logger.hasHandlers()
        if line and not shown and int(os.environ.get("RANK", "0")) == 0:
            print(line, flush=True)  # Megatron-LM's console, where its logging has no handler
        return result

    return setup_model_and_optimizer


# ---------------------------------------------------------------------------------- the wraps
def _logging_step(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind_partial(*args, **kwargs).arguments
        iteration = arguments["iteration"]
        megatron_args = _megatron_args()
        logging_step = iteration % megatron_args.log_interval == 0 or bool(arguments.get("is_first_iteration"))
        if not logging_step:
            return original(*args, **kwargs)
        fragment = log_step(iteration, megatron_args, pg_collection=arguments.get("pg_collection"))
        _PENDING_CONSOLE[:] = [fragment] if fragment else []
        try:
            return original(*args, **kwargs)
        finally:
            _PENDING_CONSOLE.clear()

    return training_log


def _with_console_fragment(original: Callable) -> Callable:
    @functools.wraps(original)
    def report(self, *args: Any, **kwargs: Any) -> Any:
        text = original(self, *args, **kwargs)
        if _PENDING_CONSOLE and isinstance(text, str):
            text += _PENDING_CONSOLE.pop()  # the first report of the step: training_log's MoE section
        return text

    return report


def _megatron_args():
    from megatron.training import get_args

    return get_args()


# ---------------------------------------------------------------------------------- one logging step
class _Capture:
    """A TensorBoard-like writer that remembers every scalar and forwards it to ``writer``."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.scalars: dict[str, float] = {}

    def add_scalar(self, tag: str, value: Any, step: int, *args: Any, **kwargs: Any) -> None:
        self.scalars[tag] = float(value)
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step, *args, **kwargs)


def _schedule(config, megatron_args) -> BudgetSchedule | None:
    if config is None or not config.enabled:
        return None
    schedule = config.resolve(num_experts=megatron_args.num_experts, topk=megatron_args.moe_router_topk)
    return None if schedule.is_static and config.mode != "top_p" else schedule


def writes_per_layer(megatron_args, config: ElasticConfig | None = None) -> bool:
    """Whether a logging step writes every layer's values: ``--moe-per-layer-logging`` and
    ``ElasticConfig.log_metrics`` ``layers`` (``config``: the active one by default)."""
    config = patch.active_config() if config is None else config
    switch = bool(getattr(megatron_args, "moe_per_layer_logging", False))
    return log_layout(None if config is None else config.log_metrics, switch) == "layers"


def reported_metrics(schedule: BudgetSchedule, megatron_args, per_layer_values: bool | None = None) -> Sequence[str]:
    """The metric names a logging step reports: all of ``core.metrics.metric_names`` when the run
    writes TensorBoard or W&B (``--tensorboard-dir``, ``--wandb-project``; the schedule's constants,
    ``core.metrics.SCHEDULE_CONSTANTS``, only where every layer's values are written:
    ``per_layer_values``, by default :func:`writes_per_layer`), else only
    :data:`CONSOLE_METRICS`, the ones the console line shows (the rest would be reduced and then
    dropped). Decided from Megatron-LM's arguments, identical on every rank, not from the writers,
    which only the last rank holds: every rank must enter the same all-reduces."""
    with_capacity = getattr(megatron_args, "moe_expert_capacity_factor", None) is not None
    # the schedule's constants only where a layer's values are written
    layers = writes_per_layer(megatron_args) if per_layer_values is None else per_layer_values
    every = metrics.metric_names(schedule, int(megatron_args.num_experts), with_capacity, with_survival=layers)
    if getattr(megatron_args, "tensorboard_dir", None) or getattr(megatron_args, "wandb_project", None):
        return every
    return [name for name in every if name in CONSOLE_METRICS]


def log_step(iteration: int, megatron_args, *, pg_collection: Any = None) -> str:
    """Report the routing metrics of this logging step (call on every rank); the console fragment.

    Returns:
        ``" elastic_moe/<name>: <value> |"`` for :data:`CONSOLE_METRICS` (layer means after the
        cross-rank reduction; ``""`` when no elastic schedule is active).
    """
    config = patch.active_config()
    schedule = _schedule(config, megatron_args) if megatron_args.num_experts else None
    if schedule is None or config is None or config.log_metrics == "off":
        return ""
    from megatron.training import get_tensorboard_writer, get_wandb_writer

    routers = [router for router in patch.built_routers() if router.training]
    routers = tracking.router_sites(routers) if routers else routers  # enumerated once for the metrics and the reset
    layers = writes_per_layer(megatron_args, config)
    reported = reported_metrics(schedule, megatron_args, layers)
    per_layer = tracking.per_layer_metrics(routers) if routers else {}
    per_layer = {
        layer: {name: value for name, value in values.items() if name in reported}
        for layer, values in per_layer.items()
    }
    names = [tracking.TRACKER_PREFIX + name for name in reported]
    num_layers = int(megatron_args.num_layers)
    pattern = hybrid_pattern.pattern_of(megatron_args)  # a HybridModel: its E layers, not every layer
    divisor = tracking.num_elastic_moe_layers(megatron_args, config, per_layer, pattern)  # one rule for both hooks
    writer = _Capture(get_tensorboard_writer())
    device = torch.cuda.current_device()
    with megatron_tracker.isolated():
        tracking.record_layer_table(per_layer, num_layers, device)
        for name in names:
            megatron_tracker.ensure(name, num_layers, device)
        megatron_tracker.report(
            names,
            iteration,
            writer=writer,
            wandb_writer=get_wandb_writer(),
            per_layer_logging=layers,
            num_layers=divisor,
            pg_collection=pg_collection,
        )
    if routers:
        tracking.reset(routers)
    return "".join(
        f" {tracking.TRACKER_PREFIX}{name}: {writer.scalars[tracking.TRACKER_PREFIX + name]:.2f} |"
        for name in CONSOLE_METRICS
        if tracking.TRACKER_PREFIX + name in writer.scalars
    )


__all__ = [
    "CONSOLE_METRICS",
    "TRAINING_MODULE",
    "install",
    "install_plan_line",
    "is_installed",
    "log_step",
    "remove",
    "reported_metrics",
    "writes_per_layer",
]
