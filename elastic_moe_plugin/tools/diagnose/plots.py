"""PNG plots of ``elastic-moe diagnose`` results (matplotlib, Agg backend; the ``plot`` extra).

- ``divergence_by_layer.png``: JS divergence by layer, one line per model pair (paper Figure 2),
  boundary layers hatched, the peak non-boundary block shaded;
- ``disagreement.png``: D1 and Dk per pair (Figure 3), with their per-layer values beside;
- ``topk_sweep.png``: probe loss against the inference top-k, one line per model (Figure 4);
- ``kappa_histogram.png``: realised κ shares (mean over layers, per-layer markers) against the
  schedule's pmf q(κ) (Eq. 5).

Every function takes the plain dicts of :func:`~elastic_moe_plugin.tools.diagnose.compare.compare`
(``results["pairs"]``, ``results["topk_sweep"]``) or of
:func:`~elastic_moe_plugin.tools.diagnose.kappa.load_kappa`, and returns the path written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display); shared by the compare plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` as a 120-dpi PNG, close it; returns ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)  # figures stay registered with pyplot (and in memory) until closed
    return path


def plot_divergence_by_layer(pairs: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    boundary: set[int] = set()
    peak = None
    for label, summary in pairs.items():
        layers = [row["layer"] for row in summary["layers"]]
        ax.plot(layers, [row["js"] for row in summary["layers"]], marker="o", label=label)
        boundary |= set(summary["boundary_layers"])
        peak = peak or summary.get("peak_nonboundary_block")
    for layer in sorted(boundary):
        ax.axvspan(layer - 0.5, layer + 0.5, color="0.85", hatch="//", alpha=0.5, lw=0)
    if peak is not None:
        ax.axvspan(
            peak["first"] - 0.5,
            peak["last"] + 0.5,
            color="tab:orange",
            alpha=0.15,
            label=f"peak non-boundary block L{peak['layers']}",
        )
    ax.set_xlabel("MoE layer (0-based; hatched: boundary layers)")
    ax.set_ylabel("mean Jensen-Shannon divergence")
    ax.set_title("Router divergence by layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def plot_disagreement(pairs: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
    labels = list(pairs)
    width = 0.38
    positions = range(len(labels))
    k = next(iter(pairs.values()))["k"]
    d1 = [pairs[label]["D1"] for label in labels]
    dk = [pairs[label]["Dk"] for label in labels]
    left.bar([p - width / 2 for p in positions], d1, width, label="D1 (top-1 differs)")
    left.bar([p + width / 2 for p in positions], dk, width, label=f"D{k} (1 - |S∩S'|/{k})")
    for p, a, b in zip(positions, d1, dk, strict=True):
        left.text(p - width / 2, a, f"{a:.3f}", ha="center", va="bottom", fontsize=7)
        left.text(p + width / 2, b, f"{b:.3f}", ha="center", va="bottom", fontsize=7)
    # headroom above the bars for the value labels and the legend
    left.set_ylim(0, max(d1 + dk + [1e-3]) * 1.45)
    left.set_xticks(list(positions))
    left.set_xticklabels(labels, fontsize=7, rotation=10)
    left.set_ylabel("disagreement rate")
    left.set_title("Expert-selection disagreement (Eq. 11-12)")
    left.legend(fontsize=8, loc="upper right")
    for label in labels:
        rows = pairs[label]["layers"]
        layers = [row["layer"] for row in rows]
        (line,) = right.plot(layers, [row["d1"] for row in rows], marker="o", label=f"{label}: D1")
        right.plot(
            layers, [row["dk"] for row in rows], marker="s", ls="--", color=line.get_color(), label=f"{label}: D{k}"
        )
    right.set_xlabel("MoE layer")
    right.set_title("per layer")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    return save_figure(plt, fig, path)


def plot_topk_sweep(sweep: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    natives = set()
    for label, entry in sweep.items():
        ks = sorted(int(value) for value in entry["k"])
        ax.plot(ks, [entry["k"][str(value)]["loss"] for value in ks], marker="o", label=label)
        natives.add(entry["native_topk"])
    for native in natives:
        ax.axvline(native, color="0.5", ls=":", lw=1)
    ax.set_xlabel("inference top-k (dotted: the checkpoints' own)")
    ax.set_ylabel("probe next-token loss (nats)")
    ax.set_title("Inference top-k sweep")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def plot_kappa(kappa: dict[str, dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    panels = list(kappa)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.0), squeeze=False)
    for ax, label in zip(axes[0], panels, strict=True):
        entry = kappa[label]
        observed = entry["observed"]
        pmf = entry["pmf"]
        budgets = sorted({b for shares in observed.values() for b in shares} | set(pmf))
        mean = [sum(shares.get(b, 0.0) for shares in observed.values()) / len(observed) for b in budgets]
        ax.bar(budgets, mean, width=0.6, alpha=0.6, label=f"observed, mean of {len(observed)} layer(s)")
        for _layer, shares in sorted(observed.items()):  # in layer order
            ax.plot(budgets, [shares.get(b, 0.0) for b in budgets], ls="none", marker="_", ms=14, color="0.3")
        if pmf:
            ax.plot(budgets, [pmf.get(b, 0.0) for b in budgets], color="tab:red", marker="o", label="schedule pmf q(κ)")
        ax.set_xticks(budgets)
        ax.set_xlabel("budget κ (experts per token)")
        ax.set_ylabel("share of tokens")
        ax.set_title(f"κ histogram: {label}")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    return save_figure(plt, fig, path)


def plot_all(results: dict[str, Any], kappa: dict[str, dict[str, Any]], out: Path) -> list[str]:
    """Every plot the data allows; returns the file names written into ``out``."""
    written = []
    if results.get("pairs"):
        written.append(plot_divergence_by_layer(results["pairs"], out / "divergence_by_layer.png").name)
        written.append(plot_disagreement(results["pairs"], out / "disagreement.png").name)
    if results.get("topk_sweep"):
        written.append(plot_topk_sweep(results["topk_sweep"], out / "topk_sweep.png").name)
    if kappa:
        written.append(plot_kappa(kappa, out / "kappa_histogram.png").name)
    return written
