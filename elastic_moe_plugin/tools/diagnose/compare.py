"""``compare``: stream probe tasks through checkpoints and summarise every model pair (paper §6).

Per batch, every model runs one forward at its own static top-k: its router logits per MoE layer
become distributions p [T_b, E] of the valid tokens, and its logits [B, S, V] give the next-token
loss; one more forward per extra inference top-k of the sweep. Each pair's per-layer sums
(:func:`~elastic_moe_plugin.tools.diagnose.divergence.pair_token_sums`) and the loss sums are all
that outlive the batch.

Summaries (docs/diagnostics.md, "Definitions and choices"): per-layer means within a task, then
the unweighted mean over tasks; D1 and Dk are the means over the MoE layers (Eq. 11-12); boundary
layers are the first and last ``boundary`` MoE layers; the peak block is the ``block_width``
consecutive non-boundary layers of largest mean JS; the near-cutoff share is
Σ_{j=k−w+1..k}(1 − ρ(j)) / Σ_{j≤k}(1 − ρ(j)) of the rank retention ρ.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from elastic_moe_plugin.tools.diagnose.divergence import PairAccumulator, pair_token_sums
from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError
from elastic_moe_plugin.tools.diagnose.models import ModelInfo, RoutedModel
from elastic_moe_plugin.tools.diagnose.probe import ProbeTask, chunk_sequences, probe_batches

FORMAT = "elastic-moe-diagnostics/1"
#: default inference top-k sweep: k-2 .. k+2 of the models' deployment top-k (clipped to 1..E)
SWEEP_HALF_WIDTH = 2
#: longest default probe window, whatever the models' maximum positions
DEFAULT_MAX_SEQ_LEN = 1024

#: (model index, task name, top-k) -> [Σ next-token NLL, tokens]
LossSums = dict[tuple[int, str, int], list[float]]


@dataclasses.dataclass
class CompareSettings:
    """Choices of ``compare`` (see the module docstring and docs/diagnostics.md)."""

    k: int | None = None  # deployment top-k of the sets in Dk (default: the models')
    sweep: tuple[int, ...] | None = None  # inference top-k values; None: k-2..k+2; () : no sweep
    boundary: int = 1  # first/last MoE layers that count as boundary layers
    boundary_layers: tuple[int, ...] | None = None  # explicit boundary layers (overrides ``boundary``)
    block_width: int = 5  # width of the peak non-boundary block (paper: L3-L7)
    cutoff_window: int = 2  # w: the last deployed ranks counted as "near the cutoff"
    log_base: float = 2.0  # JS in bits by default (0 ≤ JS ≤ 1)
    batch_size: int = 8
    seq_len: int | None = None  # default: the models' smallest max positions (≤ 1024)
    max_sequences: int | None = None  # per probe file, after chunking
    all_pairs: bool = False  # every pair instead of (first model, each other)


# ---------------------------------------------------------------------------------- checks
def _check_same_architecture(models: Sequence[RoutedModel]) -> None:
    first = models[0].info
    for model in models[1:]:
        info = model.info
        if info.num_experts != first.num_experts:
            raise DiagnosticsError(
                f"{first.label} has {first.num_experts} experts per layer but {info.label} has "
                f"{info.num_experts}: router distributions over different experts cannot be compared."
            )
        if info.num_layers != first.num_layers or info.moe_layers != first.moe_layers:
            raise DiagnosticsError(
                f"{first.label} has {first.num_layers} layers (MoE layers {list(first.moe_layers)}) but "
                f"{info.label} has {info.num_layers} (MoE layers {list(info.moe_layers)}): the "
                f"layer-by-layer comparison needs the same architecture."
            )


def _shared_topk(models: Sequence[RoutedModel], settings: CompareSettings) -> int:
    if settings.k is not None:
        return settings.k
    topks = {m.info.topk for m in models}
    if len(topks) > 1:
        raise DiagnosticsError(
            f"the models route to different top-k ({sorted(topks)}); pass --k to choose the set size of Dk."
        )
    return models[0].info.topk


def check_compatible(models: Sequence[RoutedModel], settings: CompareSettings) -> tuple[tuple[int, ...], int]:
    """The MoE layers and the top-k every model shares. Raises DiagnosticsError on a mismatch."""
    _check_same_architecture(models)
    first = models[0].info
    k = _shared_topk(models, settings)
    if not 1 <= k <= first.num_experts:
        raise DiagnosticsError(f"--k {k} is invalid: the models have {first.num_experts} experts.")
    for value in settings.sweep or ():
        if not 1 <= value <= first.num_experts:
            raise DiagnosticsError(
                f"--topk-sweep value {value} is outside 1..{first.num_experts} (the experts per layer)."
            )
    if settings.boundary_layers is not None:
        outside = sorted(set(settings.boundary_layers) - set(first.moe_layers))
        if outside:
            raise DiagnosticsError(
                f"--boundary-layers {outside} are not MoE layers of the models "
                f"(0-based MoE layers: {list(first.moe_layers)})."
            )
    return first.moe_layers, k


# ---------------------------------------------------------------------------------- summaries
def boundary_layers(layers: Sequence[int], settings: CompareSettings) -> tuple[int, ...]:
    """The paper's boundary layers: the first and last ``settings.boundary`` MoE layers (L0 and
    L15 of OLMoE's 16), or ``settings.boundary_layers`` when given."""
    if settings.boundary_layers is not None:
        return tuple(sorted(settings.boundary_layers))
    n = max(0, settings.boundary)
    ordered = sorted(layers)
    if 2 * n >= len(ordered):
        return tuple(ordered)
    return tuple(ordered[:n] + ordered[len(ordered) - n :])


def _consecutive_runs(layers: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def peak_block(values: dict[int, float], excluded: Sequence[int], width: int) -> dict[str, Any] | None:
    """The run of ``width`` consecutive non-boundary layers with the largest mean value (ties: first).

    Layers must be consecutive integers; the width shrinks to the longest run available.
    """
    runs = _consecutive_runs(sorted(layer for layer in values if layer not in set(excluded)))
    if not runs:
        return None
    width = max(1, min(width, max(len(run) for run in runs)))
    best: dict[str, Any] | None = None
    for run in runs:
        for start in range(len(run) - width + 1):
            block = run[start : start + width]
            mean = sum(values[layer] for layer in block) / width
            if best is None or mean > best["mean"]:
                best = {
                    "layers": f"{block[0]}-{block[-1]}" if width > 1 else str(block[0]),
                    "first": block[0],
                    "last": block[-1],
                    "mean": mean,
                }
    return best


def _mean(values: Sequence[float]) -> float | None:
    return _average(values) if values else None


def _average(values: Sequence[float]) -> float:
    """The mean of a non-empty sequence."""
    return sum(values) / len(values)


def _layers_over_tasks(
    per_task: dict[str, dict[int, dict[str, Any]]], k: int, boundary: Sequence[int]
) -> dict[int, dict[str, Any]]:
    """{layer: the task means of js / d1 / dk / retention, tokens summed, dk_experts = k·dk}."""
    tasks = list(per_task)
    per_layer: dict[int, dict[str, Any]] = {}
    for layer in sorted(per_task[tasks[0]]):
        entries = [per_task[task][layer] for task in tasks]
        retention = [
            sum(e["retention"][j] for e in entries) / len(entries) for j in range(len(entries[0]["retention"]))
        ]
        per_layer[layer] = {
            "layer": layer,
            "boundary": layer in boundary,
            "tokens": sum(e["tokens"] for e in entries),
            "js": _mean([e["js"] for e in entries]),
            "d1": _mean([e["d1"] for e in entries]),
            "dk": _mean([e["dk"] for e in entries]),
            "retention": retention,
        }
        per_layer[layer]["dk_experts"] = k * per_layer[layer]["dk"]
    return per_layer


def _prioritisation(
    per_task: dict[str, dict[int, dict[str, Any]]],
    per_layer: dict[int, dict[str, Any]],
    d1: float | None,
    dk: float | None,
    k: int,
    settings: CompareSettings,
) -> dict[str, Any]:
    """D1/Dk, the top-1 reorder share, rank retention and the near-cutoff share of one pair."""
    layers = list(per_layer)
    # reorder share: pooled over layers within a task, then averaged over tasks
    shares = []
    for entries in per_task.values():
        changed = sum(entries[layer]["d1_count"] for layer in layers)
        if changed > 0:
            shares.append(sum(entries[layer]["reorder_count"] for layer in layers) / changed)
    retention = [
        _average([per_layer[layer]["retention"][j] for layer in layers])
        for j in range(len(per_layer[layers[0]]["retention"]))
    ]
    lost = [1.0 - value for value in retention[:k]]
    window = max(1, min(settings.cutoff_window, k))
    return {
        "d1_over_dk": (d1 / dk) if d1 is not None and dk else None,
        "top1_reorder_share": _mean(shares),
        "rank_retention": retention,
        "near_cutoff_share": sum(lost[k - window :]) / sum(lost) if sum(lost) > 1e-12 else None,
        "cutoff_window": window,
    }


def summarize_pair(
    per_task: dict[str, dict[int, dict[str, Any]]], k: int, boundary: Sequence[int], settings: CompareSettings
) -> dict[str, Any]:
    """Per-layer values averaged over tasks (each task weighs the same, as the paper averages over
    tasks), then the pair's summary numbers."""
    per_layer = _layers_over_tasks(per_task, k, boundary)
    layers = list(per_layer)
    inner = [layer for layer in layers if layer not in boundary]
    outer = [layer for layer in layers if layer in boundary]
    d1 = _mean([per_layer[layer]["d1"] for layer in layers])
    dk = _mean([per_layer[layer]["dk"] for layer in layers])
    js_values = {layer: per_layer[layer]["js"] for layer in layers}
    return {
        "layers": [per_layer[layer] for layer in layers],
        "js_mean": _mean(list(js_values.values())),
        "js_nonboundary_mean": _mean([js_values[layer] for layer in inner]),
        "js_boundary_mean": _mean([js_values[layer] for layer in outer]),
        "boundary_layers": list(boundary),
        "peak_nonboundary_block": peak_block(js_values, boundary, settings.block_width),
        "D1": d1,
        "Dk": dk,
        "k": k,
        "Dk_experts": None if dk is None else k * dk,
        "D1_nonboundary": _mean([per_layer[layer]["d1"] for layer in inner]),
        "Dk_nonboundary": _mean([per_layer[layer]["dk"] for layer in inner]),
        "prioritisation": _prioritisation(per_task, per_layer, d1, dk, k, settings),
    }


# ---------------------------------------------------------------------------------- the pass
def _sweep_values(first: ModelInfo, sweep: tuple[int, ...] | None) -> tuple[int, ...]:
    if sweep is not None:
        return sweep
    native = first.topk
    return tuple(range(max(1, native - SWEEP_HALF_WIDTH), min(first.num_experts, native + SWEEP_HALF_WIDTH) + 1))


def _window_length(models: Sequence[RoutedModel], seq_len: int | None) -> int:
    limits = [m.info.max_positions for m in models if m.info.max_positions]
    seq_len = seq_len or min(limits + [DEFAULT_MAX_SEQ_LEN])
    if limits and seq_len > min(limits):
        raise DiagnosticsError(f"--seq-len {seq_len} exceeds the models' maximum positions ({min(limits)}).")
    return seq_len


def _model_pairs(count: int, all_pairs: bool) -> list[tuple[int, int]]:
    if count == 1:
        return []
    if all_pairs:
        return [(i, j) for i in range(count) for j in range(i + 1, count)]
    return [(0, j) for j in range(1, count)]


def _task_windows(task: ProbeTask, seq_len: int, max_sequences: int | None, vocab: int) -> list[torch.Tensor]:
    windows = chunk_sequences(task.sequences, seq_len)
    if max_sequences is not None:
        windows = windows[:max_sequences]
    largest = max(int(s.max()) for s in windows)
    if largest >= vocab or min(int(s.min()) for s in windows) < 0:
        raise DiagnosticsError(
            f"probe file {task.path}: token id {largest} is outside the models' vocabulary (0..{vocab - 1})."
        )
    return windows


def _add_loss(
    sums: LossSums, key: tuple[int, str, int], logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor
) -> None:
    """Σ next-token NLL over positions t whose token t and target t+1 are both real (float64)."""
    target_valid = valid[:, 1:] & valid[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).double()
    entry = sums.setdefault(key, [0.0, 0])
    entry[0] += float((nll * target_valid.reshape(-1)).sum())
    entry[1] += int(target_valid.sum())


def _run_model_on_batch(
    model: RoutedModel,
    index: int,
    task: str,
    ids: torch.Tensor,
    valid: torch.Tensor,
    sweep: tuple[int, ...],
    capture: bool,
    loss_sums: LossSums,
) -> dict[int, torch.Tensor]:
    """Add the batch's loss at every top-k of the sweep; return {layer: distribution [T_valid, E]}."""
    # routers are compared as deployed: each model at its own static top-k
    native_k = model.info.topk
    rows = valid.reshape(-1)
    logits, routers = model.forward(ids, valid, capture=capture)
    _add_loss(loss_sums, (index, task, native_k), logits, ids, valid)
    distributions = {layer: model.router_distribution(routers[layer][rows]) for layer in routers}
    del logits, routers
    for value in sweep:
        if value == native_k:
            continue
        with model.topk(value):
            logits, _ = model.forward(ids, valid, capture=False)
        _add_loss(loss_sums, (index, task, value), logits, ids, valid)
        del logits
    return distributions


def _results_header(
    models: Sequence[RoutedModel],
    probe_info: list[dict[str, Any]],
    seq_len: int,
    k: int,
    sweep: tuple[int, ...],
    boundary: tuple[int, ...],
    settings: CompareSettings,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "models": [m.info.describe() for m in models],
        "probe": {
            "tasks": probe_info,
            "seq_len": seq_len,
            "batch_size": settings.batch_size,
            "positions": "every non-padding token of every probe window, teacher-forced, same inputs for all models",
        },
        "settings": {
            "k": k,
            "sweep": list(sweep),
            "boundary": settings.boundary,
            "boundary_layers": list(boundary),
            "block_width": settings.block_width,
            "cutoff_window": settings.cutoff_window,
            "js_log_base": settings.log_base,
            "task_average": "per-task means, then the unweighted mean over tasks",
        },
        "pairs": {},
        "topk_sweep": {},
    }


def _pair_result(
    per_task: dict[str, dict[int, dict[str, Any]]],
    a: str,
    b: str,
    k: int,
    boundary: tuple[int, ...],
    settings: CompareSettings,
) -> dict[str, Any]:
    summary = summarize_pair(per_task, k, boundary, settings)
    summary["per_task"] = {
        task: {
            "D1": _mean([v["d1"] for v in values.values()]),
            "Dk": _mean([v["dk"] for v in values.values()]),
            "js_mean": _mean([v["js"] for v in values.values()]),
        }
        for task, values in per_task.items()
    }
    summary["a"], summary["b"] = a, b
    return summary


def _sweep_result(
    loss_sums: LossSums, index: int, native_topk: int, sweep: tuple[int, ...], tasks: Sequence[ProbeTask]
) -> dict[str, Any]:
    entry: dict[str, Any] = {"native_topk": native_topk, "k": {}}
    for value in sorted({native_topk, *sweep}):
        sums = [loss_sums[(index, task.name, value)] for task in tasks]
        nll = sum(s[0] for s in sums)
        count = sum(s[1] for s in sums)
        entry["k"][str(value)] = {
            "loss": nll / count,
            "perplexity": math.exp(nll / count),
            "tokens": int(count),
            "loss_per_task": {task.name: s[0] / s[1] for task, s in zip(tasks, sums, strict=True)},
        }
    return entry


def compare(
    models: Sequence[RoutedModel],
    tasks: Sequence[ProbeTask],
    settings: CompareSettings,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Stream every probe task through every model; return the results dict of ``diagnostics.json``.

    Per batch: one static-top-k forward per model captures the router logits of every MoE layer
    (turned into distributions of the valid tokens) and gives the top-k loss; one more forward
    per extra sweep value; then each pair's per-layer sums are added. Nothing per token survives
    the batch.
    """
    if not models:
        raise DiagnosticsError("no checkpoint given.")
    layers, k = check_compatible(models, settings)
    sweep = _sweep_values(models[0].info, settings.sweep)
    seq_len = _window_length(models, settings.seq_len)
    vocab = min(m.info.vocab_size for m in models)
    pairs = _model_pairs(len(models), settings.all_pairs)
    boundary = boundary_layers(layers, settings)

    pair_sums = {(i, j, task.name): PairAccumulator() for (i, j) in pairs for task in tasks}
    loss_sums: LossSums = {}
    probe_info = []
    for task in tasks:
        windows = _task_windows(task, seq_len, settings.max_sequences, vocab)
        probe_info.append(
            {
                "name": task.name,
                "path": task.path,
                "sequences": len(windows),
                "tokens": sum(int(s.numel()) for s in windows),
            }
        )
        batches = math.ceil(len(windows) / settings.batch_size)
        for number, (ids, valid) in enumerate(probe_batches(windows, settings.batch_size)):
            if progress is not None:
                progress(f"{task.name}: batch {number + 1}/{batches}")
            distributions = [
                _run_model_on_batch(model, index, task.name, ids, valid, sweep, bool(pairs), loss_sums)
                for index, model in enumerate(models)
            ]
            for i, j in pairs:
                for layer in layers:
                    pair_sums[(i, j, task.name)].add(
                        layer, pair_token_sums(distributions[i][layer], distributions[j][layer], k, settings.log_base)
                    )
            del distributions

    results = _results_header(models, probe_info, seq_len, k, sweep, boundary, settings)
    for i, j in pairs:
        a, b = models[i].info.label, models[j].info.label
        per_task = {task.name: pair_sums[(i, j, task.name)].layer_means() for task in tasks}
        results["pairs"][f"{a} vs {b}"] = _pair_result(per_task, a, b, k, boundary, settings)
    for index, model in enumerate(models):
        results["topk_sweep"][model.info.label] = _sweep_result(loss_sums, index, model.info.topk, sweep, tasks)
    return results
