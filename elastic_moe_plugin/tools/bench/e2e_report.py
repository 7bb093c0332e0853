"""The output of ``elastic-moe bench --only e2e`` (:mod:`.e2e`): its text table and its schema rows."""

from __future__ import annotations

from elastic_moe_plugin.tools.bench.e2e import E2EResult
from elastic_moe_plugin.tools.bench.schema import BenchRow, Metric, row

COLUMNS = ("launcher", "schedule", "steps/s", "x static", "min-max x", "peak RSS MiB", "syncs/step", "mean κ")


def format_table(results: list[E2EResult]) -> str:
    """One row per launcher and schedule; the ratio columns on the elastic row (a launcher that could
    not run here: one line saying why)."""
    widths = (14, 8, 8, 8, 13, 12, 10, 7)
    header = " ".join(
        f"{name:{width}s}" if i < 2 else f"{name:>{width}s}"
        for i, (name, width) in enumerate(zip(COLUMNS, widths, strict=True))
    )
    lines = [header]
    for result in results:
        if result.unavailable is not None:
            lines.append(f"-- {result.label}: not run: {result.unavailable}")
            continue
        summary = result.summary()
        lines.append(
            f"-- {result.label}: {result.model}; {result.steps} steps, {result.warmup} warm-up, "
            f"{summary['rounds']} round(s); steps/s {result.timing}"
        )
        for schedule, column in ((result.static, summary["static"]), (result.elastic, summary["elastic"])):
            elastic = schedule == result.elastic
            cells = [
                f"{result.label:14s}",
                f"{schedule:8s}",
                f"{column['median_steps_per_second']:8.4f}",
                f"{summary['ratio_median']:8.3f}" if elastic else f"{'1':>8s}",
                (f"{summary['ratio_min']:6.3f}-{summary['ratio_max']:6.3f}" if elastic else f"{'':13s}"),
                f"{column['peak_rss_bytes'] / 2**20:12.0f}",
                f"{_or_na(column['syncs_per_step']):>10s}",
                f"{column['mean_kappa']:7.3f}" if column["mean_kappa"] is not None else f"{'-':>7s}",
            ]
            lines.append(" ".join(cells))
    lines.append(
        "steps/s: median over rounds, steady state (after the warm-up steps), from the launcher's own "
        "timings, or for an interleaved row from the one process's step times; x static: median of the "
        "rounds' elastic/static ratios (an interleaved round's: the median of its block pairs'), min-max "
        "across rounds; peak RSS: largest process of the run (ru_maxrss); syncs/step: host reads of device "
        "values in one training step (step = warm-up's last; interleaved: each mode's first after the "
        "warm-up); mean κ: the realised experts per token the run logged"
    )
    return "\n".join(lines)


def _or_na(value) -> str:
    return "n/a" if value is None else str(value)


def rows(results: list[E2EResult]) -> list[BenchRow]:
    """The schema rows: per launcher one row per schedule (static, then elastic against it). The
    metrics are the table's columns and, per round in order, what each run measured. A launcher
    that could not run here has none (the table says why)."""
    out = []
    for result in results:
        if result.unavailable is not None:
            continue
        summary = result.summary()
        shape = (
            f"{result.label}: {result.model}; {result.steps} steps, {result.warmup} warm-up; steps/s {result.timing}"
        )
        params = dict(
            launcher=result.launcher,
            label=result.label,
            model=result.model,
            steps=result.steps,
            warmup=result.warmup,
            rounds=summary["rounds"],
            interleave_block=result.interleave_block,
        )
        for schedule, column in ((result.static, summary["static"]), (result.elastic, summary["elastic"])):
            runs = result.of(schedule)
            elastic = schedule == result.elastic
            metrics: dict[str, Metric] = dict(column)
            metrics.update(
                round_steps_per_second=[run.steps_per_second for run in runs],
                round_peak_rss_bytes=[run.peak_rss_bytes for run in runs],
                round_syncs_per_step=[run.syncs_per_step for run in runs],
                round_mean_kappa=[run.mean_kappa for run in runs],
                round_wall_s=[run.wall_s for run in runs],
            )
            if elastic:
                metrics["round_ratios"] = list(result.round_ratios())
                metrics["pair_ratios"] = [ratio for run in runs for ratio in run.pair_ratios or []]
            out.append(
                row(
                    "e2e",
                    result.launcher,
                    shape,
                    schedule,
                    params=params,
                    metrics=metrics,
                    baseline=result.static if elastic else None,
                    ratios=(
                        {
                            "steps_per_second_ratio": summary["ratio_median"],
                            "steps_per_second_ratio_min": summary["ratio_min"],
                            "steps_per_second_ratio_max": summary["ratio_max"],
                        }
                        if elastic
                        else None
                    ),
                )
            )
    return out


__all__ = ["COLUMNS", "format_table", "rows"]
