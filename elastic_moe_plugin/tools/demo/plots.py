"""The demo's three PNGs, drawn from ``summary.json``'s data (needs matplotlib: the ``plot`` extra).

- ``loss_curves.png``: training loss (moving average over ``steps // 50`` steps) and held-out loss
  against training tokens, in full and zoomed on the second half;
- ``topk_sweep.png``: held-out loss against the inference top-k' of both runs;
- ``kappa_histogram.png``: the elastic run's share of training tokens per budget κ, per elastic
  layer, against the schedule's pmf q(κ).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.schedule import BudgetSchedule

_COLORS = {"static": "#4C72B0", "elastic": "#DD8452"}


def _labels(summary: dict[str, Any]) -> dict[str, str]:
    return {
        "static": f"static top-{summary['settings']['topk']}",
        "elastic": f"elastic {summary['runs']['elastic']['schedule']}",
    }


def _moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def _loss_curves(plt, summary: dict[str, Any], out: Path) -> str:
    runs, s, labels = summary["runs"], summary["settings"], _labels(summary)
    tokens_per_step = s["batch_size"] * s["seq_len"]
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4))
    smoothed = {}
    for name, run in runs.items():
        steps, losses = run["history"]["step"], run["history"]["loss"]
        window = max(1, len(losses) // 50)
        smoothed[name] = _moving_average(losses, window)
        tokens = [step * tokens_per_step for step in steps]
        eval_tokens = [step * tokens_per_step for step in run["history"]["eval_step"]]
        for axis in (ax, zoom):
            axis.plot(
                tokens,
                smoothed[name],
                color=_COLORS[name],
                alpha=0.6,
                label=f"{labels[name]} train (moving avg {window})",
            )
            axis.plot(
                eval_tokens, run["history"]["eval_loss"], "o--", color=_COLORS[name], label=f"{labels[name]} held-out"
            )
    for axis in (ax, zoom):
        axis.set_xlabel("training tokens")
        axis.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss curves (seed {s['seed']})")
    ax.legend(frameon=False, fontsize=8)
    # right: the second half of training, where the two runs separate (if at all)
    half = s["steps"] * tokens_per_step / 2
    tail = [
        v
        for run in runs.values()
        for step, v in zip(run["history"]["eval_step"], run["history"]["eval_loss"], strict=True)
        if step * tokens_per_step >= half
    ]
    tail += [
        v
        for name, run in runs.items()
        for step, v in zip(run["history"]["step"], smoothed[name], strict=True)
        if step * tokens_per_step >= half
    ]
    if tail:
        spread = max(tail) - min(tail)
        zoom.set_xlim(half, s["steps"] * tokens_per_step * 1.02)
        zoom.set_ylim(min(tail) - 0.05 * spread, max(tail) + 0.05 * spread)
    zoom.set_title("second half, zoomed")
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)
    return "loss_curves.png"


def _topk_sweep(plt, summary: dict[str, Any], out: Path) -> str:
    runs, s, labels = summary["runs"], summary["settings"], _labels(summary)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, run in runs.items():
        ks = [int(k) for k in run["topk_sweep"]]
        ax.plot(ks, list(run["topk_sweep"].values()), "o-", color=_COLORS[name], label=labels[name])
    ax.axvline(s["topk"], color="gray", linestyle=":", label=f"trained k={s['topk']}")
    ax.set_xticks([int(k) for k in runs["static"]["topk_sweep"]])
    ax.set_xlabel("inference top-k'")
    ax.set_ylabel("held-out loss")
    ax.set_title("inference top-k sweep (static routing)")
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(out / "topk_sweep.png", dpi=110)
    plt.close(fig)
    return "topk_sweep.png"


def _kappa_histogram(plt, summary: dict[str, Any], out: Path, schedule: BudgetSchedule) -> str:
    elastic = summary["runs"]["elastic"]
    layers = elastic["elastic_layers"] or list(range(summary["settings"]["num_layers"]))
    budgets = list(range(max(1, schedule.low - 1), schedule.high + 2))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / len(layers)
    for i, layer in enumerate(layers):
        entry = elastic["kappa"][str(layer)]
        total = entry["tokens"]
        freq = [entry["histogram"].get(str(r), 0) / total for r in budgets]
        ax.bar([r - 0.4 + width * (i + 0.5) for r in budgets], freq, width=width, alpha=0.8, label=f"layer {layer}")
    ax.plot(
        budgets,
        [schedule.probability(r) for r in budgets],
        "k_",
        markersize=22,
        mew=2,
        label=f"pmf {schedule.describe()}",
    )
    ax.set_xticks(budgets)
    ax.set_xlabel("budget κ")
    ax.set_ylabel("share of training tokens")
    ax.set_title("realised κ (elastic run) vs the schedule")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "kappa_histogram.png", dpi=110)
    plt.close(fig)
    return "kappa_histogram.png"


def write_plots(summary: dict[str, Any], out: Path, schedule: BudgetSchedule) -> list[str]:
    """Write the three PNGs into ``out``; returns their file names. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return [
        _loss_curves(plt, summary, out),
        _topk_sweep(plt, summary, out),
        _kappa_histogram(plt, summary, out, schedule),
    ]
