"""Live routing metrics of a Megatron-core model, written through Megatron's own MoE tracker.

Three calls, all for logging steps only (nothing here runs in the forward pass; a training run
that never calls them pays nothing beyond the records and κ histograms the patch keeps anyway)::

    from elastic_moe_plugin.mcore import tracking

    values = tracking.routing_metrics(model)            # {"elastic_moe/layer_<i>/<name>": ..., ...}
    tracking.log_routing_metrics(model, iteration)       # -> Megatron's TensorBoard / W&B writers
    names = tracking.record_routing_metrics(model)       # or: record only, report with your own call

``model`` is one module or a list of model chunks (virtual pipeline stages); every chunk's elastic
routers count, keyed by their global 0-based layer index (``layer_number - 1``). The routers are
those :func:`elastic_moe_plugin.mcore.records.router_sites` enumerates; the records, static layers,
metric dict and plan line are the core's front end (:mod:`elastic_moe_plugin.core.records`,
:func:`elastic_moe_plugin.core.metrics.model_routing_metrics`). ``static_layers``, ``model_plans``
and ``log_plan`` are re-exported here from :mod:`.records` and :mod:`.patch`; this module adds
Megatron's tracker and report path.

The numbers are :func:`elastic_moe_plugin.core.metrics.layer_metrics` of each elastic router's latest
:class:`~elastic_moe_plugin.mcore.RoutingRecord` and of its running κ histogram, with the schedule
of :func:`elastic_moe_plugin.mcore.active_config` resolved against the router's
``TransformerConfig`` (``num_moe_experts``, ``moe_router_topk``): mean κ and κ shares, observed
exposure P(κ ≥ r) next to the schedule's survival a(r) (paper Eq. 7), retained gate-weight sums,
tokens-per-expert max/mean and CV, and the share of tokens whose top-κ set differs from static
top-k.

How they reach Megatron's logs. Megatron-core keeps one process-global MoE metrics tracker
(0.17+: ``moe_logging.MoEMetricsTracker``; 0.16: the dict of ``moe_utils.save_to_aux_losses_tracker``)
that routers fill per layer in the forward and the training loop reports once per step
(``tracker.report(...)`` / ``track_moe_metrics(...)``): PP sum, DP average, the mean over MoE
layers as scalar ``<name>``, and with per-layer logging ``moe/<name>_layer_<i>``, to TensorBoard
and W&B. :func:`record_routing_metrics` writes each per-layer value into that tracker under the name
``elastic_moe/<metric>``; a loop that reports with ``track_names=None`` or appends the returned names
to its ``track_names`` then logs them with the aux losses. Megatron-LM's ``training_log`` reports a
fixed list of names (the aux losses), so for it :func:`log_routing_metrics` runs the same report
path itself, on a tracker of its own, with the same writers: the aux losses recorded in this step
are neither synchronised, written nor cleared by it.

Reduction across ranks: values are averaged over the data-parallel group (0.17+: ``needs_dp_avg``;
0.16: ``avg_group`` = the data-parallel group), summed over pipeline stages (each layer lives on
one stage); the layer mean divides by the number of elastic MoE layers. Per-rank ratios such as
max/mean are averaged, not recomputed from global counts. :func:`log_routing_metrics` reports on a
tracker of its own whose reduction is packed: one pipeline sum and one data-parallel average for all
names together (``compat.megatron_tracker.isolated``), the values those of Megatron's per-name one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from elastic_moe_plugin.compat import megatron_tracker
from elastic_moe_plugin.core import metrics
from elastic_moe_plugin.core import records as core_records
from elastic_moe_plugin.core.config import ElasticConfig, log_layout
from elastic_moe_plugin.core.schedule import BudgetSchedule
from elastic_moe_plugin.mcore import hybrid_pattern, patch
from elastic_moe_plugin.mcore.patch import log_plan, model_plans
from elastic_moe_plugin.mcore.records import model_chunks, router_sites, static_layers

logger = logging.getLogger("elastic_moe_plugin.mcore.tracking")

#: prefix of every tracker entry this module writes; Megatron logs ``<name>`` and ``moe/<name>_layer_<i>``
TRACKER_PREFIX = metrics.PREFIX + "/"


# ---------------------------------------------------------------------------------- metrics
def resolve_schedule(model) -> tuple[BudgetSchedule, int, Any] | None:
    """(schedule, num_experts, TransformerConfig) of the model's elastic routers, or None.

    The config is :func:`mcore.active_config` (the monkey-patch), else the ``elastic_config`` of an
    ``ElasticTopKRouter`` (the explicit-spec route); it is resolved against the router's own
    ``TransformerConfig`` exactly as the router resolves it, so ``center`` is the model's top-k.
    """
    active = patch.active_config()
    for site in router_sites(model):
        router = site.router
        config: ElasticConfig | None = active if active is not None else getattr(router, "elastic_config", None)
        if config is None or not config.enabled:
            continue
        model_config = router.config
        schedule = config.resolve(num_experts=model_config.num_moe_experts, topk=model_config.moe_router_topk)
        return schedule, int(model_config.num_moe_experts), model_config
    if active is not None and active.enabled:
        model_config = _moe_config_of_chunks(model)
        if model_config is not None:
            schedule = active.resolve(num_experts=model_config.num_moe_experts, topk=model_config.moe_router_topk)
            return schedule, int(model_config.num_moe_experts), model_config
    return None


def _moe_config_of_chunks(model) -> Any | None:
    """The first MoE ``TransformerConfig`` (one with ``num_moe_experts``) among the chunks' modules:
    a pipeline stage whose layers are all dense has no router, and the model's config has the rest."""
    for chunk in model_chunks(model):
        for module in chunk.modules():
            model_config = getattr(module, "config", None)
            if getattr(model_config, "num_moe_experts", None):
                return model_config
    return None


def routing_metrics(model, *, include_static: bool = True, per_layer: bool = True) -> dict[str, float]:
    """Flat scalars of the model's routers (one device read for all layers; logging steps only).

    Returns ``{"elastic_moe/layer_<i>/<name>": value, "elastic_moe/<name>": mean over layers}``
    as :func:`elastic_moe_plugin.core.metrics.model_routing_metrics` defines them, named after
    :func:`resolve_schedule`, with the static layers at κ = k unless ``include_static=False``
    (Megatron's tracker path, whose layer mean divides by the elastic layers); with
    ``per_layer=False`` only ``elastic_moe/<name>``, the layer mean of every name
    (:func:`per_layer_logging` says which a Megatron run asked for); ``{}`` before the first
    training forward or without an active config.
    """
    sites = router_sites(model)  # enumerated once: the schedule and the metrics read the same routers

    def schedule() -> tuple[BudgetSchedule, int] | None:
        resolved = resolve_schedule(sites)
        return None if resolved is None else resolved[:2]

    return metrics.model_routing_metrics(sites, schedule, include_static=include_static, per_layer=per_layer)


def per_layer_logging(model) -> bool:
    """Whether the run logs MoE metrics per layer: ``TransformerConfig.moe_per_layer_logging`` of
    the model's routers (Megatron-LM ``--moe-per-layer-logging``; ``megatron sft``
    ``--megatron_extra_kwargs '{"moe_per_layer_logging": true}'``), Megatron's own switch for its
    aux losses. Off, a log holds the layer means only, the schedule's constants left out
    (``core.metrics.SCHEDULE_CONSTANTS``): 21 scalars of a 6-10 schedule, where per-layer logging
    writes 31 per layer (1488 for 48 layers), each one a TensorBoard/W&B write at every logging step.

    The switch is read from the routers' config (else, on a stage without routers, from the first
    MoE ``TransformerConfig`` of the chunks) whether or not the patch is applied at the time: a
    caller that caches it at its first log gets the run's setting even if that log is static."""
    sites = router_sites(model)
    model_config = sites[0].router.config if sites else _moe_config_of_chunks(model)
    return bool(getattr(model_config, "moe_per_layer_logging", False))


def per_layer_metrics(model) -> dict[int, dict[str, float]]:
    """{0-based layer index: {metric name: value}} of the elastic layers (the per-layer part of
    :func:`routing_metrics` with ``include_static=False``)."""
    return _layers_from_flat(routing_metrics(model, include_static=False))


def reset(model) -> None:
    """Zero every elastic router's κ histogram, so the next log covers only the steps after this one."""
    core_records.reset_budget_histograms(router_sites(model))


# ---------------------------------------------------------------------------------- Megatron's tracker
def _data_parallel_group():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)


def _pipeline_world_size() -> int:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def _records_and_histograms(sites: Sequence[core_records.RouterSite]) -> tuple[dict[int, Any], dict[int, torch.Tensor]]:
    return (
        core_records.layer_indexed(core_records.routing_records(sites)),
        core_records.layer_indexed(core_records.budget_histograms(sites)),
    )


def _device(records, histograms) -> torch.device:
    """Where the tracker entries live: the routers' device, else (a stage without elastic layers)
    the current CUDA device, as Megatron's own entries. Records first: a κ histogram counted on
    the host is a CPU tensor whatever the routers' device."""
    for tensor in [record.budgets for record in records.values()] + list(histograms.values()):
        return tensor.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def num_elastic_moe_layers(
    model_config, elastic: ElasticConfig | None, local_layers: Iterable[int], pattern: str | None = None
) -> int:
    """Divisor of Megatron's layer mean: elastic MoE layers of the whole model (all pipeline stages).

    The MoE layers are the ``E`` symbols of a hybrid ``pattern`` (:mod:`.hybrid_pattern`: every
    symbol is a layer, so ``*E*E*E*E`` has 4 of 8), else every ``moe_layer_freq``-th layer."""
    frequency = getattr(model_config, "moe_layer_freq", 1)
    moe_layers = set(hybrid_pattern.moe_layer_numbers(int(model_config.num_layers), frequency, pattern))
    if elastic is not None and elastic.layer_set is not None:
        moe_layers &= set(elastic.layer_set)
    return len(moe_layers) or len(set(local_layers)) or 1


def record_routing_metrics(model, *, loss_scale: float = 1.0) -> list[str]:
    """Record every per-layer routing metric into Megatron's global MoE metrics tracker.

    Each value lands at ``values[layer_number - 1]`` of the entry ``elastic_moe/<metric>``
    (tensor [num_layers] on the routers' device), divided by ``loss_scale`` so that a report
    with that ``loss_scale`` (Megatron multiplies by it; ``1 / num_microbatches`` in
    Megatron-LM) gives back the value. Call once per logging step, right before the report
    whose ``track_names`` include the returned names.

    Returns:
        the tracker names written (sorted); ``[]`` when there is nothing to record, or
        ``ElasticConfig.log_metrics`` is ``"off"``. The tracker needs every layer's value to
        report a mean, so they are recorded under ``"means"`` too: the report's own
        ``per_layer_logging`` decides what is written; under ``"means"`` report with it off, as
        :func:`log_routing_metrics` does.
    """
    chunks = model_chunks(model)
    elastic = _elastic_config(router_sites(chunks))
    if elastic is not None and elastic.log_metrics == "off":
        return []
    return _record(chunks, routing_metrics(chunks, include_static=False), loss_scale)


def _layers_from_flat(flat: dict[str, float]) -> dict[int, dict[str, float]]:
    """{layer: {name: value}} from ``elastic_moe/layer_<i>/<name>`` keys (no recomputation)."""
    layers: dict[int, dict[str, float]] = {}
    prefix = TRACKER_PREFIX + "layer_"
    for key, value in flat.items():
        if key.startswith(prefix):
            layer, _, name = key[len(prefix) :].partition("/")
            layers.setdefault(int(layer), {})[name] = value
    return dict(sorted(layers.items()))


def _record(chunks: Sequence[torch.nn.Module], flat: dict[str, float], loss_scale: float) -> list[str]:
    layers = _layers_from_flat(flat)
    if not layers:
        return []
    resolved = resolve_schedule(chunks)
    if resolved is None:  # routers without an elastic config log nothing of ours
        return []
    model_config = resolved[2]
    device = _device(*_records_and_histograms(router_sites(chunks)))
    return record_layer_table(layers, int(model_config.num_layers), device, loss_scale=loss_scale)


def record_layer_table(
    per_layer: dict[int, dict[str, float]], num_layers: int, device: Any, *, loss_scale: float = 1.0
) -> list[str]:
    """Record ``{0-based layer: {metric: value}}`` into Megatron's current MoE tracker.

    Each value lands at ``values[layer]`` of ``elastic_moe/<metric>`` (tensor [num_layers] on
    ``device``), divided by ``loss_scale``, averaged over data parallelism when reported. One
    host-to-device copy of the whole table, then one indexed add per metric.

    Returns:
        the tracker names written (sorted); ``[]`` for an empty table.
    """
    if not per_layer:
        return []
    names = sorted({name for values in per_layer.values() for name in values})
    layers = list(per_layer)
    table = torch.tensor(
        [[per_layer[layer].get(name, 0.0) / loss_scale for layer in layers] for name in names], dtype=torch.float64
    ).to(device=device, dtype=torch.float32)
    dp_group = None if megatron_tracker.has_metrics_tracker() else _data_parallel_group()
    for row, name in enumerate(names):
        present = [column for column, layer in enumerate(layers) if name in per_layer[layer]]
        values = table[row] if len(present) == len(layers) else table[row, present]
        megatron_tracker.record_layers(
            TRACKER_PREFIX + name, values, [layers[column] + 1 for column in present], num_layers, dp_group
        )
    return [TRACKER_PREFIX + name for name in names]


def _megatron_lm_writers() -> tuple[Any, Any]:
    """Megatron-LM's global TensorBoard and W&B writers, if a Megatron-LM run has set them up.

    Looked up in ``sys.modules`` only: importing ``megatron.training`` is heavy (and fails on some
    Python versions), and without a Megatron-LM run there are no writers to find anyway.
    """
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None:
        return None, None
    writer = getattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", None)
    wandb_writer = getattr(global_vars, "_GLOBAL_WANDB_WRITER", None)
    return writer, wandb_writer


def log_routing_metrics(
    model,
    iteration: int,
    writer: Any = None,
    wandb_writer: Any = None,
    *,
    per_layer_logging: bool = True,
    reset_histograms: bool = True,
    pg_collection: Any = None,
) -> dict[str, float]:
    """Write the routing metrics through Megatron's MoE tracker report path, at one logging step.

    Args:
        model: a module or the list of model chunks.
        iteration: the step written with every scalar.
        writer: a TensorBoard ``SummaryWriter`` (anything with ``add_scalar(tag, value, step)``);
            ``None`` takes Megatron-LM's global writer when ``megatron.training`` has one.
        wandb_writer: a W&B run (``log(dict, step)``); ``None`` likewise.
        per_layer_logging: also write ``moe/elastic_moe/<metric>_layer_<i>``, if ``log_metrics`` is
            ``"layers"``; ``"means"``: layer means only, without the schedule's constants; ``"off"``: ``{}``.
        reset_histograms: zero the κ histograms afterwards (each log covers its own steps).
        pg_collection: passed to the report (0.17+) as Megatron's own loop does.

    Writes ``elastic_moe/<metric>`` = mean over the elastic MoE layers (Megatron's aggregation)
    for every metric, with the same reduction as Megatron's aux losses (module docstring).

    Returns:
        :func:`routing_metrics` of this rank (before the cross-rank average), for console logs.
    """
    chunks = model_chunks(model)
    sites = router_sites(chunks)
    resolved = resolve_schedule(chunks)
    elastic = _elastic_config(sites)
    static = resolved is not None and resolved[0].is_static and elastic is not None and elastic.mode != "top_p"
    if resolved is None or elastic is None or elastic.log_metrics == "off" or static:
        return {}  # the same answer on every rank: the config is global
    per_layer_logging = log_layout(elastic.log_metrics, per_layer_logging) == "layers"
    schedule, num_experts, model_config = resolved
    values = routing_metrics(chunks, include_static=False)
    if not values and _pipeline_world_size() == 1:
        return {}  # nothing recorded yet, and no other stage waits for this one
    if writer is None and wandb_writer is None:
        writer, wandb_writer = _megatron_lm_writers()
    records, histograms = _records_and_histograms(sites)
    pattern = hybrid_pattern.pattern_of_modules(module for chunk in chunks for module in chunk.modules())
    divisor = num_elastic_moe_layers(model_config, elastic, set(records) | set(histograms), pattern)
    recorded, names = _reported(values, schedule, num_experts, model_config, per_layer_logging)
    device = _device(records, histograms)
    with megatron_tracker.isolated():
        _record(chunks, recorded, 1.0)
        # A stage without elastic layers reports every name too (zeros, which the pipeline sum
        # leaves unchanged): the report all-reduces each name, and the other stages would wait.
        for name in names:
            megatron_tracker.ensure(name, int(model_config.num_layers), device)
        report = dict(writer=writer, wandb_writer=wandb_writer, per_layer_logging=per_layer_logging)
        megatron_tracker.report(names, iteration, **report, num_layers=divisor, pg_collection=pg_collection)
    if reset_histograms:
        reset(chunks)
    return values


def _reported(
    values: dict[str, float], schedule: BudgetSchedule, num_experts: int, model_config: Any, per_layer: bool
) -> tuple[dict[str, float], list[str]]:
    """(the flat values to record, the tracker names to report): every metric name, the schedule's
    constants (``core.metrics.SCHEDULE_CONSTANTS``) only where every layer's values are written. Both
    are filtered: megatron-core 0.16's report writes every entry of the tracker, not only its names."""
    capacity = getattr(model_config, "moe_expert_capacity_factor", None) is not None
    every = metrics.metric_names(schedule, num_experts, capacity, with_survival=per_layer)
    kept = set(every)
    recorded = {key: value for key, value in values.items() if key.rpartition("/")[2] in kept}
    return recorded, [TRACKER_PREFIX + name for name in every]


def _elastic_config(sites: Sequence[core_records.RouterSite]) -> ElasticConfig | None:
    """The active config (the monkey-patch), else the first ``ElasticTopKRouter``'s own (the explicit spec)."""
    active = patch.active_config()
    if active is not None:
        return active
    found = (getattr(site.router, "elastic_config", None) for site in sites)
    return next((config for config in found if config is not None), None)


__all__ = [
    "TRACKER_PREFIX",
    "log_plan",
    "log_routing_metrics",
    "model_plans",
    "num_elastic_moe_layers",
    "per_layer_logging",
    "per_layer_metrics",
    "record_routing_metrics",
    "reset",
    "resolve_schedule",
    "routing_metrics",
    "static_layers",
]
