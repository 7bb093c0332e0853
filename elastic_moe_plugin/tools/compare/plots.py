"""PNG plots of a study (matplotlib, Agg backend; the ``plot`` extra).

- ``paired_differences.png``: one panel per quantity, one column of points per arm: each seed's
  difference (arm − baseline), their mean and its paired-t 95% interval, and the zero line;
- ``topk_sweep.png``: left, each arm's mean over seeds at every inference k' with a 95% t band of
  that mean; right, the paired difference against the baseline at every k' with its 95% t band;
- ``training_curves.png`` (demo studies): each arm's training loss per step, the mean over seeds
  and the band between the lowest and highest seed, and the held-out loss at the evaluation points.

Every function takes the results dict (and the rows of :func:`.report.comparisons`) and returns
the path written.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from elastic_moe_plugin.tools.compare import stats
from elastic_moe_plugin.tools.compare.study import arm_values
from elastic_moe_plugin.tools.diagnose.plots import pyplot, save_figure


def plot_differences(data: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> Path:
    """Per-seed paired differences, their mean and paired-t interval, per quantity and arm."""
    plt = pyplot()
    arms = data["plan"]["arms"][1:]
    names = list(dict.fromkeys(row["quantity"] for row in rows if not row["quantity"].startswith("router ")))
    columns = min(4, len(names))
    lines = math.ceil(len(names) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(3.2 * columns, 2.6 * lines), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for position, arm in enumerate(arms):
            row = next((r for r in rows if r["arm"] == arm and r["quantity"] == name), None)
            if row is None:
                continue
            spread = np.linspace(-0.12, 0.12, len(row["differences"])) if len(row["differences"]) > 1 else [0.0]
            ax.scatter(position + np.asarray(spread), row["differences"], s=12, color="0.55", zorder=2)
            low, high = row["t_interval"] or (row["mean_difference"], row["mean_difference"])
            ax.errorbar(position, row["mean_difference"], yerr=[[row["mean_difference"] - low],
                        [high - row["mean_difference"]]], fmt="o", color="C0", capsize=4, zorder=3)  # fmt: skip
        ax.axhline(0.0, color="k", linewidth=0.8)
        ax.set_xticks(range(len(arms)), arms)
        ax.set_title(name, fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle(f"arm - {data['plan']['arms'][0]} per seed (grey), mean and paired-t 95% interval", fontsize=9)
    return save_figure(plt, fig, path)


def sweep_series(data: dict[str, Any]) -> dict[int, Any]:
    """{k': reader} of the quantity swept over inference top-k (held-out loss or the suite average)."""
    first = next(iter(data["runs"].values()))
    if data.get("source") == "eval":
        return {int(k): _evaluation_average(k) for k in first["evals"]}
    return {int(k): _sweep_loss(k) for k in first["topk_sweep"]}


def _evaluation_average(k: str):
    return lambda run: (run["evals"].get(k) or {}).get("average")


def _sweep_loss(k: str):
    return lambda run: run["topk_sweep"].get(k)


def _band(values: list[float]) -> tuple[float, float, float]:
    mean = float(np.mean(values))
    interval = stats.t_interval(values)
    return (mean, mean, mean) if interval is None else (mean, interval.low, interval.high)


def plot_sweep(data: dict[str, Any], path: Path) -> Path:
    """Each arm's mean at every k' with a 95% band, and the paired differences against the baseline."""
    plt = pyplot()
    baseline, *arms = data["plan"]["arms"]
    series = sweep_series(data)
    ks = sorted(series)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for index, arm in enumerate([baseline, *arms]):
        bands = [_band(list(arm_values(data, arm, series[k]).values())) for k in ks]
        left.plot(ks, [b[0] for b in bands], marker="o", color=f"C{index}", label=arm)
        left.fill_between(ks, [b[1] for b in bands], [b[2] for b in bands], color=f"C{index}", alpha=0.2)
        if arm == baseline:
            continue
        differences = []
        for k in ks:
            base, other = arm_values(data, baseline, series[k]), arm_values(data, arm, series[k])
            differences.append(_band([other[s] - base[s] for s in sorted(set(base) & set(other))]))
        right.plot(ks, [d[0] for d in differences], marker="o", color=f"C{index}", label=f"{arm} - {baseline}")
        right.fill_between(ks, [d[1] for d in differences], [d[2] for d in differences], color=f"C{index}", alpha=0.2)
    topk = next(iter(data["runs"].values()))["topk"]
    measured = "suite average" if data.get("source") == "eval" else "held-out loss"
    for ax, title in ((left, f"{measured}, mean over seeds, 95% band"), (right, "paired difference, 95% band")):
        ax.axvline(topk, color="0.6", linestyle=":", linewidth=1)
        ax.set_xlabel("inference top-k'")
        ax.set_xticks(ks)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    right.axhline(0.0, color="k", linewidth=0.8)
    return save_figure(plt, fig, path)


def _smoothed(losses: np.ndarray, window: int) -> np.ndarray:
    """The moving mean of each row [seeds, steps] over ``window`` steps ('valid' part only)."""
    kernel = np.full(window, 1.0 / window)
    return np.stack([np.convolve(row, kernel, mode="valid") for row in losses])


def _arm_histories(data: dict[str, Any], arm: str) -> dict[int, dict[str, Any]]:
    return {int(run["seed"]): run["history"] for run in data["runs"].values() if run["arm"] == arm}


def plot_curves(data: dict[str, Any], path: Path) -> Path:
    """Left: each arm's training loss (moving mean over 5% of the steps, mean over seeds, band from
    the lowest to the highest seed) and held-out loss at the evaluation points. Right: the paired
    difference against the baseline of both, with a 95% t band for the held-out points."""
    plt = pyplot()
    baseline, *arms = data["plan"]["arms"]
    base = _arm_histories(data, baseline)
    first = next(iter(base.values()))
    window = max(1, len(first["step"]) // 20)
    steps = np.asarray(first["step"][window - 1 :])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, arm in enumerate([baseline, *arms]):
        histories = _arm_histories(data, arm)
        seeds = sorted(set(histories) & set(base))
        train = _smoothed(np.asarray([histories[s]["loss"] for s in seeds]), window)
        left.plot(steps, train.mean(0), color=f"C{index}", linewidth=1, label=f"{arm} train ({len(seeds)} seeds)")
        left.fill_between(steps, train.min(0), train.max(0), color=f"C{index}", alpha=0.15)
        heldout = np.asarray([histories[s]["eval_loss"] for s in seeds])
        left.plot(
            first["eval_step"], heldout.mean(0), color=f"C{index}", marker="o", linestyle="--", label=f"{arm} held-out"
        )
        if arm == baseline:
            continue
        base_train = _smoothed(np.asarray([base[s]["loss"] for s in seeds]), window)
        right.plot(
            steps, (train - base_train).mean(0), color=f"C{index}", linewidth=1, label=f"{arm} - {baseline} train"
        )
        bands = [_band(list(column)) for column in (heldout - np.asarray([base[s]["eval_loss"] for s in seeds])).T]
        right.errorbar(first["eval_step"], [b[0] for b in bands], yerr=[[b[0] - b[1] for b in bands],
                       [b[2] - b[0] for b in bands]], color=f"C{index}", fmt="o", capsize=3,
                       label=f"{arm} - {baseline} held-out, 95%")  # fmt: skip
    left.set_ylim(top=float(np.percentile(first["loss"], 90)))
    left.set_title(f"loss (train: moving mean over {window} steps; band: lowest to highest seed)", fontsize=9)
    right.axhline(0.0, color="k", linewidth=0.8)
    right.set_title("paired difference per step", fontsize=9)
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    return save_figure(plt, fig, path)


def plot_all(data: dict[str, Any], rows: list[dict[str, Any]], out: Path) -> list[str]:
    """Every plot the results allow, into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_differences(data, rows, out / "paired_differences.png"), plot_sweep(data, out / "topk_sweep.png")]
    if data.get("source", "demo") == "demo":
        written.append(plot_curves(data, out / "training_curves.png"))
    return [str(path) for path in written]


__all__ = ["plot_all", "plot_curves", "plot_differences", "plot_sweep", "sweep_series"]
