"""Outputs of ``elastic-moe diagnose``: ``diagnostics.json``, the CSVs, the PNGs and the text report.

``write_outputs`` writes what the results hold: per-layer and per-pair CSVs when there are pairs,
``topk_sweep.csv`` when there is a sweep, ``kappa.csv`` when κ data is given, and the plots of
:mod:`elastic_moe_plugin.tools.diagnose.plots`. Numbers in the CSVs carry 8 significant digits.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from elastic_moe_plugin.tools.diagnose.plots import plot_all


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.8g}"


def _num(value: float | None, spec: str = ".5f") -> str:
    return "n/a" if value is None else format(value, spec)


def _kappa_json(kappa: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """κ data with string keys, as JSON stores them."""
    return {
        label: {
            "observed": {
                str(layer): {str(b): s for b, s in shares.items()} for layer, shares in entry["observed"].items()
            },
            "pmf": {str(b): q for b, q in entry["pmf"].items()},
            "source": entry.get("source"),
        }
        for label, entry in kappa.items()
    }


def _write_divergence_csv(pairs: dict[str, Any], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["pair", "layer", "boundary", "js", "d1", "dk", "dk_experts", "tokens"])
        for pair, summary in pairs.items():
            for row in summary["layers"]:
                writer.writerow(
                    [
                        pair,
                        row["layer"],
                        int(row["boundary"]),
                        f"{row['js']:.8g}",
                        f"{row['d1']:.8g}",
                        f"{row['dk']:.8g}",
                        f"{row['dk_experts']:.8g}",
                        row["tokens"],
                    ]
                )


def _write_pairs_csv(pairs: dict[str, Any], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "pair",
                "js_mean",
                "js_nonboundary_mean",
                "js_boundary_mean",
                "peak_nonboundary_block",
                "D1",
                "Dk",
                "k",
                "Dk_experts",
                "d1_over_dk",
                "top1_reorder_share",
                "near_cutoff_share",
            ]
        )
        for pair, s in pairs.items():
            p = s["prioritisation"]
            writer.writerow(
                [
                    pair,
                    _fmt(s["js_mean"]),
                    _fmt(s["js_nonboundary_mean"]),
                    _fmt(s["js_boundary_mean"]),
                    (s["peak_nonboundary_block"] or {}).get("layers", ""),
                    _fmt(s["D1"]),
                    _fmt(s["Dk"]),
                    s["k"],
                    _fmt(s["Dk_experts"]),
                    _fmt(p["d1_over_dk"]),
                    _fmt(p["top1_reorder_share"]),
                    _fmt(p["near_cutoff_share"]),
                ]
            )


def _write_sweep_csv(sweep: dict[str, Any], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "k", "native_topk", "loss", "perplexity", "tokens"])
        for label, entry in sweep.items():
            for value, row in entry["k"].items():
                writer.writerow(
                    [
                        label,
                        value,
                        entry["native_topk"],
                        f"{row['loss']:.8g}",
                        f"{row['perplexity']:.8g}",
                        row["tokens"],
                    ]
                )


def _write_kappa_csv(kappa: dict[str, dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["source", "layer", "kappa", "observed_share", "pmf"])
        for label, entry in kappa.items():
            for layer, shares in sorted(entry["observed"].items()):
                for budget in sorted(set(shares) | set(entry["pmf"])):
                    writer.writerow(
                        [label, layer, budget, _fmt(shares.get(budget, 0.0)), _fmt(entry["pmf"].get(budget, 0.0))]
                    )


def write_outputs(
    results: dict[str, Any], out: Path, kappa: dict[str, dict[str, Any]], plots: bool = True
) -> list[str]:
    """diagnostics.json, the CSVs and (``plots``) the PNGs; returns the file names written.

    Adds ``kappa``, ``files`` and (``plots``) ``plots`` to ``results`` before writing it.
    """
    out.mkdir(parents=True, exist_ok=True)
    files = ["diagnostics.json"]
    results["kappa"] = _kappa_json(kappa)
    if results.get("pairs"):
        _write_divergence_csv(results["pairs"], out / "divergence_by_layer.csv")
        _write_pairs_csv(results["pairs"], out / "pairs.csv")
        files += ["divergence_by_layer.csv", "pairs.csv"]
    if results.get("topk_sweep"):
        _write_sweep_csv(results["topk_sweep"], out / "topk_sweep.csv")
        files.append("topk_sweep.csv")
    if kappa:
        _write_kappa_csv(kappa, out / "kappa.csv")
        files.append("kappa.csv")
    if plots:
        written = plot_all(results, kappa, out)
        results["plots"] = written
        files += written
    results["files"] = files
    (out / "diagnostics.json").write_text(json.dumps(results, indent=2))
    return files


def _format_pair(pair: str, s: dict[str, Any]) -> list[str]:
    p = s["prioritisation"]
    peak = s["peak_nonboundary_block"]
    lines = [f"\n{pair}", f"  {'layer':>5} {'JS':>10} {'D1':>8} {'Dk':>8}  "]
    for row in s["layers"]:
        lines.append(
            f"  {row['layer']:>5} {row['js']:>10.5f} {row['d1']:>8.4f} {row['dk']:>8.4f}"
            f"{'  boundary' if row['boundary'] else ''}"
        )
    lines.append(
        f"  JS mean {s['js_mean']:.5f} | non-boundary {_num(s['js_nonboundary_mean'])} | boundary "
        f"{_num(s['js_boundary_mean'])} (layers {s['boundary_layers']})"
        + (f" | peak non-boundary block L{peak['layers']} ({peak['mean']:.5f})" if peak else "")
    )
    lines.append(
        f"  D1 {s['D1']:.4f}  Dk {s['Dk']:.4f} (= {s['Dk_experts']:.3f} of {s['k']} experts)  "
        f"D1/Dk {_num(p['d1_over_dk'], '.3f')}  top-1 reorders inside the shared set "
        f"{_num(p['top1_reorder_share'], '.3f')}  near-cutoff share (last {p['cutoff_window']} ranks) "
        f"{_num(p['near_cutoff_share'], '.3f')}"
    )
    lines.append(
        "  rank retention P(rank j of one model in the other's top-k): "
        + " ".join(f"{j + 1}:{v:.3f}" for j, v in enumerate(p["rank_retention"]))
    )
    return lines


def _format_sweep(sweep: dict[str, Any]) -> list[str]:
    labels = list(sweep)
    ks = sorted({int(v) for entry in sweep.values() for v in entry["k"]})
    lines = [
        "\ninference top-k sweep, probe loss (perplexity):",
        "  " + f"{'k':>3} " + " ".join(f"{label:>22}" for label in labels),
    ]
    for value in ks:
        cells = []
        for label in labels:
            row = sweep[label]["k"].get(str(value))
            native = sweep[label]["native_topk"]
            cells.append(
                f"{row['loss']:.4f} ({row['perplexity']:.2f}){'*' if value == native else ' '}" if row else "-"
            )
        lines.append("  " + f"{value:>3} " + " ".join(f"{c:>22}" for c in cells))
    lines.append("  (* = the checkpoint's own top-k)")
    return lines


def format_report(results: dict[str, Any]) -> str:
    """A short human-readable summary of ``diagnostics.json``."""
    probe = results["probe"]
    tokens = sum(task["tokens"] for task in probe["tasks"])
    lines = [
        f"probe: {len(probe['tasks'])} file(s), {tokens} tokens in windows of <= {probe['seq_len']}; "
        f"k = {results['settings']['k']}; JS in log base {results['settings']['js_log_base']:g}"
    ]
    for pair, summary in results["pairs"].items():
        lines += _format_pair(pair, summary)
    if results["topk_sweep"]:
        lines += _format_sweep(results["topk_sweep"])
    return "\n".join(lines)
