"""Human- and machine-readable reports of a :class:`BudgetSchedule` (``elastic-moe schedule``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.schedule import BudgetSchedule


def schedule_summary(schedule: BudgetSchedule, num_ranks: int | None = None) -> dict[str, Any]:
    """Everything ``elastic-moe schedule`` prints, as plain data.

    ``survival`` lists a(j) = P(κ >= j) for ranks j = 1..num_ranks (default high + 2), next to the
    static step [j <= center] it replaces.
    """
    num_ranks = num_ranks if num_ranks is not None else schedule.high + 2
    return {
        "schedule": schedule.spec(),
        "center": schedule.center,
        "sigma": schedule.sigma,
        "budgets": list(schedule.budgets),
        "pmf": list(schedule.pmf),
        "mean": schedule.mean,
        "std": schedule.std,
        "mean_abs_deviation": schedule.mean_abs_deviation,
        "off_center_share": schedule.off_center_share,
        "ranks": list(range(1, num_ranks + 1)),
        "survival": list(schedule.exposure(num_ranks)),
        "static_step": [1.0 if rank <= schedule.center else 0.0 for rank in range(1, num_ranks + 1)],
    }


def format_summary(summary: dict[str, Any]) -> str:
    """A fixed-width text table of :func:`schedule_summary`."""
    resolved = (
        " (resolved from the top-k: 'auto', k-2..k+2 within the experts)" if summary.get("resolved_from_model") else ""
    )
    lines = [
        f"schedule {summary['schedule']} around k={summary['center']} (sigma={summary['sigma']:g}){resolved}",
        "",
        f"{'budget':>8} {'pmf':>8}",
    ]
    lines += [f"{budget:>8} {q:>8.4f}" for budget, q in zip(summary["budgets"], summary["pmf"], strict=True)]
    lines += ["", f"{'rank':>8} {'P(k>=r)':>8} {'static':>8}"]
    lines += [
        f"{rank:>8} {a:>8.4f} {step:>8.0f}"
        for rank, a, step in zip(summary["ranks"], summary["survival"], summary["static_step"], strict=True)
    ]
    lines += [
        "",
        f"E[kappa]          = {summary['mean']:.4f}",
        f"SD(kappa)         = {summary['std']:.4f}",
        f"E|kappa - k|      = {summary['mean_abs_deviation']:.4f}",
        f"P(kappa != k)     = {summary['off_center_share']:.4f}",
    ]
    return "\n".join(lines)


def plot_schedule(schedule: BudgetSchedule, path: str | Path) -> Path:
    """Write a PNG: the pmf (left) and the exposure curve against the static step (right)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plot needs matplotlib: pip install 'elastic-moe-plugin[plot]'") from error
    summary = schedule_summary(schedule)
    fig, (ax_pmf, ax_exposure) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax_pmf.bar(summary["budgets"], summary["pmf"], color="#4C72B0")
    ax_pmf.set_xlabel("budget κ")
    ax_pmf.set_ylabel("q(κ)")
    ax_pmf.set_title(f"pmf {schedule.describe()}")
    ax_exposure.step(
        summary["ranks"], summary["static_step"], where="mid", label=f"static top-{schedule.center}", color="gray"
    )
    ax_exposure.plot(summary["ranks"], summary["survival"], "o-", label="elastic P(κ ≥ rank)", color="#DD8452")
    ax_exposure.set_xlabel("router rank")
    ax_exposure.set_ylabel("exposure")
    ax_exposure.set_title("rank exposure")
    ax_exposure.legend(frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
