"""Live routing metrics from routing records: framework-free, computed only when a logger asks.

Both adapters keep, per elastic layer, the latest training forward's
:class:`~elastic_moe_plugin.core.records.RoutingRecord` (``budgets`` κ [T], ``expert_ids`` [T, b]
with −1 beyond κ, ``retained_weight_sums`` [T]) and a running κ histogram [b+1] since the last
reset. :func:`routing_metrics` turns them into flat scalars named ``elastic_moe/layer_{i}/{name}``
(plus ``elastic_moe/{name}`` averages over layers; or only those, one per name) for Megatron's
tracker, TensorBoard, W&B or swift's log; :func:`model_routing_metrics` does it for the routers an
adapter enumerates (both adapters' ``routing_metrics(model)``). Nothing here runs unless a logging hook calls it, so
training without logging pays nothing.

Per layer:
    mean_kappa, kappa_frac_{r}          the κ histogram since the last reset, normalised
    exposure_rank_{r}, survival_rank_{r}  observed P(κ ≥ r) against the schedule's a(r) (a
                                        constant of the config: a means-only log leaves it out,
                                        see :data:`SCHEDULE_CONSTANTS`)
    retained_weight_sum_mean / _min     Σ kept gate weights per token (1 for renormalised gates)
    tokens_per_expert_max_over_mean     load imbalance of the latest step (1 = perfectly even)
    tokens_per_expert_cv                coefficient of variation of the per-expert counts
    topk_set_changed_frac               share of tokens whose top-κ set differs from their static
                                        top-k set; top-κ is a prefix of the router ranking, so this
                                        is exactly the share with κ ≠ k
    capacity_dropped_frac               with a capacity factor: the share of selected (token,
                                        expert) assignments that capacity dropped
    capacity_dropped_frac_top_k         the same share among router ranks 1..k (what static top-k
                                        also selects)
    capacity_dropped_frac_beyond_k      the same share among ranks k+1..κ, the extra experts of
                                        tokens with κ > k (0 when no token has κ > k)

Static layers (outside ``ElasticConfig.layers``, or every layer of a ``static`` schedule) route
stock top-k and keep no record; they are reported at their fixed κ = k (``mean_kappa = k``,
``kappa_frac_k = 1``, the static step as exposure, ``topk_set_changed_frac = 0``), so a dashboard
shows every MoE layer. The model-wide ``elastic_moe/mean_kappa`` and ``topk_set_changed_frac``
average over all of them; the weight and load averages over the layers that have records.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch

from elastic_moe_plugin.core import records
from elastic_moe_plugin.core.layer_keys import LayerKey
from elastic_moe_plugin.core.records import RouterSite, RoutingRecord
from elastic_moe_plugin.core.schedule import BudgetSchedule

PREFIX = "elastic_moe"


def observed_survival(histogram: torch.Tensor) -> torch.Tensor:
    """P(κ ≥ r) for r = 0..b from a κ histogram [b+1] indexed by budget: float64 [b+1], the
    observed counterpart of the schedule's a(r) (paper Eq. 7); NaN when the histogram is empty."""
    counts = histogram.double()
    return torch.flip(torch.cumsum(torch.flip(counts, [0]), 0), [0]) / counts.sum()


def max_over_mean(per_expert: torch.Tensor) -> float:
    """Load imbalance max_e c_e / mean_e c_e of per-expert counts [E] (1 = perfectly even; 0 for
    no tokens at all). Synchronises once."""
    counts = per_expert.double()
    mean = counts.mean()
    return float(counts.max() / mean) if mean > 0 else 0.0


#: what :func:`record_statistics` gives per record, in this order
RECORD_STATISTICS = (
    "retained_weight_sum_mean",
    "retained_weight_sum_min",
    "tokens_per_expert_max",
    "tokens_per_expert_mean",
    "tokens_per_expert_std",
    "topk_set_changed_frac",
    "mean_kappa",
)


def record_statistics(
    layer_records: Mapping[LayerKey, RoutingRecord], num_experts: int, topk: int
) -> dict[LayerKey, tuple[float, ...]]:
    """Per layer, the :data:`RECORD_STATISTICS` of its record: mean and min over tokens of the
    retained weight sums, max, mean and population std over experts of the tokens per expert c_e,
    the share of tokens with κ ≠ k, and mean κ. Layers without tokens are left out.

    All layers at once: records of one :meth:`~RoutingRecord.stack_key` are stacked to [L, T, b]
    and reduced together, the counts of every layer in one ``scatter_add_`` (layer l's expert e in
    bin l·E + e, each slot adding 1 if selected, else 0), and everything is read in one device
    read: a log runs the same operators for 2 layers or 48, where one pass per layer ran ~25 each
    (on a GPU, a kernel launch each). float64 throughout.

    When the host has a record's κ histogram n [b+1] (``RoutingRecord.budget_counts``, κ drawn on
    the host), the κ terms come from it with no device op: T = Σ n, mean κ = Σ_r r·n_r / T, the
    share κ ≠ k = (T − n_k) / T, and mean_e c_e = Σκ / E (every selected slot is one of the Σκ
    kept slots). Each is a ratio of exact integers, rounded once, as the device's float64 means.
    """
    groups: dict[tuple, list[LayerKey]] = {}
    for layer, record in layer_records.items():
        if record.budgets.numel() > 0:
            groups.setdefault(record.stack_key(), []).append(layer)
    if not groups:
        return {}
    order: list[LayerKey] = []
    rows: list[torch.Tensor] = []
    host_terms: list[tuple[float, float, float] | None] = []
    for layers in groups.values():
        group = [layer_records[layer] for layer in layers]
        on_host = group[0].budget_counts is not None
        budgets, ids, selected, sums = records.stacked_records(group, with_budgets=not on_host)
        num_layers = len(layers)
        bins = (ids + _layer_offsets(num_layers, num_experts, ids.device)).reshape(-1)
        per_expert = torch.zeros(num_layers * num_experts, dtype=torch.float64, device=ids.device)
        per_expert = per_expert.scatter_add_(0, bins, selected.reshape(-1).to(torch.float64)).view(
            num_layers, num_experts
        )
        # stack promotes the float32 minimum to float64 exactly
        columns = [
            sums.mean(dim=1, dtype=torch.float64),
            sums.amin(dim=1),
            per_expert.amax(dim=1),
            per_expert.std(dim=1, correction=0),
        ]
        if budgets is not None:  # κ on the device: its terms from the stack
            columns += [
                per_expert.mean(dim=1),
                (budgets != topk).mean(dim=1, dtype=torch.float64),
                budgets.mean(dim=1, dtype=torch.float64),
            ]
        rows.append(torch.stack(columns, dim=1))
        host_terms.extend(
            [_host_budget_terms(record.budget_counts, num_experts, topk) if on_host else None for record in group]
        )
        order.extend(layers)
    return {
        layer: _statistics_of(values, terms)
        for layer, values, terms in zip(order, _read_rows(rows), host_terms, strict=True)
    }


def _read_rows(rows: list[torch.Tensor]) -> list[list[float]]:
    """The rows of every group's [L_g, columns_g] statistics, in one device read."""
    if len(rows) == 1:
        return rows[0].tolist()
    device = rows[0].device
    flat = torch.cat([row.to(device).reshape(-1) for row in rows]).tolist()
    values: list[list[float]] = []
    start = 0
    for row in rows:
        layers, width = row.shape
        values.extend(flat[start + i * width : start + (i + 1) * width] for i in range(layers))
        start += layers * width
    return values


def _host_budget_terms(counts, num_experts: int, topk: int) -> tuple[float, float, float]:
    """(mean_e c_e, share κ ≠ k, mean κ) from κ's histogram n [b+1] on the host (exact integers)."""
    histogram = counts.tolist()
    tokens, total = _tokens_and_budget_sum(histogram)
    at_k = histogram[topk] if topk < len(histogram) else 0
    return total / num_experts, (tokens - at_k) / tokens, total / tokens


def _tokens_and_budget_sum(counts: list[int]) -> tuple[int, int]:
    """(T, Σκ) of a κ histogram's integer counts (index = κ), exactly."""
    return sum(counts), sum(budget * count for budget, count in enumerate(counts))


def _statistics_of(values: list[float], host_terms: tuple[float, float, float] | None) -> tuple[float, ...]:
    # RECORD_STATISTICS order: the device's four, then c_e's mean, κ ≠ k, mean κ from either side
    if host_terms is None:
        sum_mean, sum_min, expert_max, expert_std, expert_mean, changed, kappa_mean = values
    else:
        sum_mean, sum_min, expert_max, expert_std = values
        expert_mean, changed, kappa_mean = host_terms
    return sum_mean, sum_min, expert_max, expert_mean, expert_std, changed, kappa_mean


@functools.lru_cache(maxsize=32)
def _layer_offsets(num_layers: int, num_experts: int, device: torch.device) -> torch.Tensor:
    # [L, 1, 1]: l·E, made once per shape (outside inference mode, as core.routing's cached tensors)
    with torch.inference_mode(False):
        return (torch.arange(num_layers, device=device) * num_experts).view(num_layers, 1, 1)


def layer_metrics(
    record: RoutingRecord | None,
    histogram: torch.Tensor | None,
    schedule: BudgetSchedule,
    num_experts: int,
    statistics: tuple[float, ...] | None = None,
) -> dict[str, float]:
    """Scalars for one layer (see the module docstring). Reads the κ histogram [b+1] (on the host
    when κ was drawn there, else one device read), then the record's statistics (one device read),
    so call it only at logging steps. ``statistics``: the layer's :func:`record_statistics` when the
    caller read every layer's at once.

    The histogram's shares are computed on the host from its integer counts: each sum is exact in
    float64, so the values equal :func:`observed_survival`'s and the device's divisions bit for bit.
    """
    metrics: dict[str, float] = {}
    counts = histogram.tolist() if histogram is not None else []
    total, budget_sum = _tokens_and_budget_sum(counts)
    if total > 0:
        metrics["mean_kappa"] = budget_sum / total
        fraction_names, rank_rows = _histogram_names(schedule)
        for budget, name in fraction_names:
            metrics[name] = counts[budget] / total if budget < len(counts) else 0.0
        at_least = 0
        survival = [0.0] * len(counts)
        for budget in range(len(counts) - 1, -1, -1):
            at_least += counts[budget]
            survival[budget] = at_least / total
        for rank, exposure_name, survival_name, scheduled in rank_rows:
            metrics[exposure_name] = survival[rank] if rank < len(survival) else 0.0
            metrics[survival_name] = scheduled
    if record is not None and statistics is None:
        statistics = record_statistics({0: record}, num_experts, schedule.center).get(0)
    if statistics is not None:
        sum_mean, sum_min, expert_max, expert_mean, expert_std, changed, kappa_mean = statistics
        metrics["retained_weight_sum_mean"] = sum_mean
        metrics["retained_weight_sum_min"] = sum_min
        metrics["tokens_per_expert_max_over_mean"] = expert_max / expert_mean if expert_mean > 0 else 0.0
        metrics["tokens_per_expert_cv"] = expert_std / expert_mean if expert_mean > 0 else 0.0
        metrics["topk_set_changed_frac"] = changed
        if "mean_kappa" not in metrics:
            metrics["mean_kappa"] = kappa_mean
        if record is not None and record.capacity_dropped is not None:
            metrics.update(capacity_drop_shares(record, schedule.center))
    return metrics


@functools.lru_cache(maxsize=16)
def _histogram_names(
    schedule: BudgetSchedule,
) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[int, str, str, float], ...]]:
    # per schedule, once: ((κ, "kappa_frac_κ"), ...) and ((r, "exposure_rank_r", "survival_rank_r", a(r)), ...)
    fractions = tuple((budget, f"kappa_frac_{budget}") for budget in schedule.budgets)
    ranks = tuple(
        (rank, f"exposure_rank_{rank}", f"survival_rank_{rank}", schedule.survival(rank))
        for rank in range(1, schedule.high + 1)
    )
    return fractions, ranks


@functools.lru_cache(maxsize=16)
def metric_names(
    schedule: BudgetSchedule, num_experts: int, with_capacity: bool = False, with_survival: bool = True
) -> tuple[str, ...]:
    """Every per-layer name :func:`layer_metrics` gives an elastic layer of ``schedule``, sorted,
    with the ``capacity_dropped_frac*`` shares when ``with_capacity`` (a capacity factor is set),
    without the schedule's constants (:data:`SCHEDULE_CONSTANTS`) unless ``with_survival``.

    The names depend on the schedule only, never on the data, so every rank can list them, a
    pipeline stage without elastic layers included: a report that all-reduces each name over the
    pipeline group needs the same names on every stage. Read off one synthetic token.
    """
    width = schedule.high
    histogram = torch.zeros(width + 1, dtype=torch.long)
    histogram[list(schedule.budgets)] = 1
    ids = torch.full((1, width), -1, dtype=torch.long)
    ids[0, : min(schedule.center, num_experts)] = torch.arange(min(schedule.center, num_experts))
    record = RoutingRecord(
        budgets=torch.tensor([schedule.center]),
        expert_ids=ids,
        retained_weight_sums=torch.ones(1),
        capacity_dropped=torch.zeros((1, width), dtype=torch.bool) if with_capacity else None,
    )
    names = layer_metrics(record, histogram, schedule, num_experts)
    return tuple(sorted(name for name in names if with_survival or not is_schedule_constant(name)))


def static_layer_metrics(topk: int, schedule: BudgetSchedule) -> dict[str, float]:
    """Scalars of a layer that routes stock top-``topk`` in training (κ = k for every token), under
    the names :func:`layer_metrics` gives an elastic layer of ``schedule`` (module docstring)."""
    metrics = {"mean_kappa": float(topk), "topk_set_changed_frac": 0.0}
    for budget in schedule.budgets:
        metrics[f"kappa_frac_{budget}"] = 1.0 if budget == topk else 0.0
    for rank in range(1, max(schedule.high, topk) + 1):
        metrics[f"exposure_rank_{rank}"] = metrics[f"survival_rank_{rank}"] = 1.0 if rank <= topk else 0.0
    return metrics


def capacity_drop_shares(record: RoutingRecord, topk: int) -> dict[str, float]:
    """Dropped / selected assignments of ``record``: overall, at router ranks 1..k, at ranks > k.

    Slot j of ``expert_ids`` holds router rank j + 1. A share with nothing selected (no token with
    κ > k, say) is 0. Synchronises once.
    """
    selected = record.expert_ids >= 0
    if record.capacity_dropped is None:
        raise ValueError("capacity_drop_shares needs a record with capacity drops (a capacity factor was set).")
    dropped = record.capacity_dropped & selected
    parts = {"": slice(None), "_top_k": slice(None, topk), "_beyond_k": slice(topk, None)}
    counts = torch.stack(
        [count for columns in parts.values() for count in (dropped[:, columns].sum(), selected[:, columns].sum())]
    ).tolist()
    return {
        "capacity_dropped_frac" + name: (counts[2 * i] / counts[2 * i + 1] if counts[2 * i + 1] else 0.0)
        for i, name in enumerate(parts)
    }


#: Per-layer names whose value is a constant of the config, the same at every step: the schedule's
#: a(r) (paper Eq. 7). A means-only log (Megatron's default, no per-layer logging) leaves them out:
#: every scalar a trainer logs costs its training thread time with TensorBoard, whose writer thread
#: checksums every event in pure Python under the GIL (docs/performance.md measures it).
#: ``elastic-moe schedule`` prints them, and the per-layer logs keep them.
SCHEDULE_CONSTANTS = ("survival_rank_",)


def is_schedule_constant(name: str) -> bool:
    """Whether the per-layer metric ``name`` is one of :data:`SCHEDULE_CONSTANTS`."""
    return name.startswith(SCHEDULE_CONSTANTS)


#: the layer means written next to the per-layer values (every name's, without them)
SUMMARY_NAMES = (
    "mean_kappa",
    "retained_weight_sum_mean",
    "tokens_per_expert_max_over_mean",
    "topk_set_changed_frac",
    "capacity_dropped_frac",
    "retained_weight_sum_min",
)


def routing_metrics(
    records: Mapping[LayerKey, RoutingRecord],
    histograms: Mapping[LayerKey, torch.Tensor],
    schedule: BudgetSchedule,
    num_experts: int,
    static_layers: Mapping[LayerKey, int] | None = None,
    *,
    per_layer: bool = True,
) -> dict[str, float]:
    """``{"elastic_moe/layer_{i}/{name}": value, "elastic_moe/{name}": mean over layers}``.

    ``static_layers``: ``{layer index: k}`` of the layers that routed stock top-k (no record),
    reported at κ = k (module docstring).

    A layer mean is over the layers that give the name (the minimum for
    ``retained_weight_sum_min``). With ``per_layer`` (default) the flat dict holds every layer's
    values and the means of :data:`SUMMARY_NAMES`; without, the mean of every name but the
    schedule's constants (:data:`SCHEDULE_CONSTANTS`) and no per-layer value, as Megatron logs its
    MoE metrics unless ``moe_per_layer_logging`` is set."""
    flat: dict[str, float] = {}
    per_name: dict[str, list[float]] = {}
    static_layers = {
        layer: k for layer, k in (static_layers or {}).items() if layer not in records and layer not in histograms
    }
    statistics = record_statistics(records, num_experts, schedule.center)
    for layer in sorted(set(records) | set(histograms) | set(static_layers)):
        if layer in static_layers:
            values = static_layer_metrics(static_layers[layer], schedule)
        else:
            values = layer_metrics(
                records.get(layer), histograms.get(layer), schedule, num_experts, statistics.get(layer)
            )
        for name, value in values.items():
            if per_layer:
                flat[f"{PREFIX}/layer_{layer}/{name}"] = value
            per_name.setdefault(name, []).append(value)
    means = SUMMARY_NAMES if per_layer else sorted(name for name in per_name if not is_schedule_constant(name))
    for name in means:
        if per_name.get(name):
            across_layers = min if name == "retained_weight_sum_min" else _mean
            flat[f"{PREFIX}/{name}"] = across_layers(per_name[name])
    return flat


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def model_routing_metrics(
    sites: Sequence[RouterSite],
    schedule: Callable[[], tuple[BudgetSchedule, int] | None] | None = None,
    *,
    include_static: bool = True,
    per_layer: bool = True,
) -> dict[str, float]:
    """:func:`routing_metrics` of the routers an adapter enumerates (one device read for all layers).

    Args:
        sites: the adapter's routers (:class:`~elastic_moe_plugin.core.records.RouterSite`).
        schedule: returns ``(the schedule the names follow, E)``, or None for no metrics; called
            only when some router holds a record, a histogram or a static plan. Default:
            :func:`~elastic_moe_plugin.core.records.trained_schedule` (the routers' cached plans).
        include_static: report the static layers at κ = k (False: elastic layers only, as
            Megatron's tracker path, whose layer mean divides by the elastic layers).
        per_layer: every layer's values (default), else only the layer mean of every name but
            the schedule's constants (:data:`SCHEDULE_CONSTANTS`).

    Returns:
        ``{"elastic_moe/layer_<i>/<name>": ..., "elastic_moe/<name>": ...}``; ``{}`` before the
        first training forward, or when ``schedule`` gives None.

    Raises:
        ValueError: two routers share a layer index (the message names both).
    """
    layer_records, histograms = records.routing_records(sites), records.budget_histograms(sites)
    static = records.static_layers(sites)
    if not (layer_records or histograms or static):
        return {}
    resolved = schedule() if schedule is not None else records.trained_schedule(sites)
    if resolved is None:
        return {}
    return routing_metrics(
        layer_records, histograms, *resolved, static if include_static else None, per_layer=per_layer
    )
