"""Realised κ histograms next to the schedule's pmf, read from logged routing metrics.

Sources: flat routing-metrics dicts (``elastic_moe/layer_<i>/kappa_frac_<r>``: the share of
tokens with budget r; ``.../survival_rank_<r>``: the schedule's a(r) = Σ_{s≥r} q(s), so
q(r) = a(r) − a(r+1), Eq. 8), a trainer's log history of such dicts (averaged), and the training
κ histograms of an ``elastic-moe demo`` ``summary.json``. Every loader returns
{label: {"observed": {layer: {κ: share}}, "pmf": {κ: q(κ)}, "source": path}}.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_moe_plugin.tools.diagnose.checkpoints import DEMO_FORMAT_PREFIX
from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError

if TYPE_CHECKING:
    from elastic_moe_plugin.tools.diagnose.models import RoutedModel

_KAPPA_SHARE_KEY = re.compile(r"elastic_moe/layer_(\d+)/kappa_frac_(\d+)")
_SURVIVAL_KEY = re.compile(r"elastic_moe/layer_\d+/survival_rank_(\d+)")
_LAYER_MEAN_SHARE_KEY = re.compile(r"elastic_moe/kappa_frac_\d+")


def _kappa_from_flat(metrics: dict[str, float]) -> dict[int, dict[int, float]]:
    shares: dict[int, dict[int, float]] = {}
    for key, value in metrics.items():
        match = _KAPPA_SHARE_KEY.fullmatch(key)
        if match:
            shares.setdefault(int(match.group(1)), {})[int(match.group(2))] = float(value)
    return shares


def _pmf_from_survival(metrics: dict[str, float]) -> dict[int, float]:
    """q(r) = a(r) − a(r+1) (Eq. 8) from the logged ``survival_rank_<r>`` of any layer."""
    survival: dict[int, float] = {}
    for key, value in metrics.items():
        match = _SURVIVAL_KEY.fullmatch(key)
        if match:
            survival[int(match.group(1))] = float(value)
    if not survival:
        return {}
    high = max(survival)
    return {
        r: survival[r] - survival.get(r + 1, 0.0)
        for r in range(1, high + 1)
        if survival[r] - survival.get(r + 1, 0.0) > 0
    }


def _read_json_or_lines(file: Path, path: str | os.PathLike[str]) -> Any:
    text = file.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise DiagnosticsError(f"{path}: neither JSON nor JSON lines ({error}).") from None


def _mean_shares(entries: Sequence[dict[str, float]]) -> dict[int, dict[int, float]]:
    observed: dict[int, dict[int, float]] = {}
    for entry in entries:
        for layer, shares in _kappa_from_flat(entry).items():
            for budget, share in shares.items():
                observed.setdefault(layer, {}).setdefault(budget, 0.0)
                observed[layer][budget] += share / len(entries)
    return observed


def load_kappa(path: str | os.PathLike[str], label: str | None = None) -> dict[str, dict[str, Any]]:
    """κ histograms against the schedule's pmf from a file.

    Accepts a routing-metrics JSON (one dict of ``elastic_moe/layer_<i>/kappa_frac_<r>`` and
    ``.../survival_rank_<r>``, as ``hf.routing_metrics`` / ``mcore.tracking.routing_metrics``
    return), a list or JSON-lines of such dicts (a trainer's log history; entries are averaged),
    a ``{"log_history": [...]}`` trainer state, or an ``elastic-moe demo`` ``summary.json``
    (its elastic runs' training κ histograms).

    Returns:
        {label: {"observed": {layer: {κ: share}}, "pmf": {κ: q(κ)}, "source": path}}.

    Raises:
        DiagnosticsError: missing file, or no κ shares in it.
    """
    file = Path(path)
    if not file.is_file():
        raise DiagnosticsError(f"κ metrics file {str(path)!r} does not exist.")
    data = _read_json_or_lines(file, path)
    name = label or file.stem
    if isinstance(data, dict) and str(data.get("format", "")).startswith(DEMO_FORMAT_PREFIX) and "runs" in data:
        return _kappa_from_demo_summary(data, str(path))
    if isinstance(data, dict) and isinstance(data.get("log_history"), list):
        data = data["log_history"]
    entries = [e for e in (data if isinstance(data, list) else [data]) if isinstance(e, dict)]
    with_shares = [e for e in entries if _kappa_from_flat(e)]
    if not with_shares:
        means_only = any(_LAYER_MEAN_SHARE_KEY.fullmatch(key) for entry in entries for key in entry)
        hint = (
            " It holds layer means only ('elastic_moe/kappa_frac_<r>'), as megatron sft and Megatron-LM log "
            "unless Megatron's per-layer switch is on, and every launcher with log_metrics 'means': train with "
            "--megatron_extra_kwargs '{\"moe_per_layer_logging\": true}' (megatron sft) or --moe-per-layer-logging "
            "(Megatron-LM), with log_metrics 'layers', the default (ELASTIC_MOE_LOG_METRICS=layers)."
            if means_only
            else ""
        )
        raise DiagnosticsError(f"{path}: no 'elastic_moe/layer_<i>/kappa_frac_<r>' values in it.{hint}")
    return {
        name: {"observed": _mean_shares(with_shares), "pmf": _pmf_from_survival(with_shares[-1]), "source": str(path)}
    }


def _kappa_from_demo_summary(
    summary: dict[str, Any], where: str, runs: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    out = {}
    schedule = summary.get("schedule") or {}
    pmf = {int(b): float(q) for b, q in zip(schedule.get("budgets", []), schedule.get("pmf", []), strict=True)}
    for run, entry in summary["runs"].items():
        if runs is not None and run not in runs:
            continue
        if not entry.get("elastic_layers"):
            continue
        observed = {}
        for layer, values in (entry.get("kappa") or {}).items():
            histogram = {int(b): float(c) for b, c in (values.get("histogram") or {}).items()}
            total = sum(histogram.values())
            if total > 0 and values.get("elastic", True):
                observed[int(layer)] = {b: c / total for b, c in histogram.items()}
        if observed:
            out[run] = {"observed": observed, "pmf": pmf, "source": where}
    return out


def demo_kappa_for(models: Sequence[RoutedModel]) -> dict[str, dict[str, Any]]:
    """Training κ histograms of demo runs, from the ``summary.json`` next to their checkpoints."""
    out: dict[str, dict[str, Any]] = {}
    for model in models:
        info = model.info
        if info.kind != "megatron-demo" or info.run is None:
            continue
        summary_file = Path(info.path) / "summary.json"
        if not summary_file.is_file():
            continue
        try:
            summary = json.loads(summary_file.read_text())
            found = _kappa_from_demo_summary(summary, str(summary_file), runs=[info.run])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            continue  # the demo's summary format is the demo's; a change there only drops this plot
        for entry in found.values():
            out[info.label] = entry
    return out
