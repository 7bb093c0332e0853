"""From lm-eval's result dicts to the run's summary: scores, the suite average, ``summary.json``,
``summary.csv`` and the report ``elastic-moe eval`` prints.

- **score**: the value under the suite task's metric key, ×100 for rates (``percent: true``),
  as is otherwise (perplexity); its stderr is scaled the same way.
- **average**: the unweighted mean of the scores of the suite tasks with ``in_average: true``
  that ran. A skipped task (MBPP without ``--allow-code-execution``) turns ``Avg(9)`` into
  ``Avg(8 of 9)`` and the notes say which task is missing and why.
- Groups (MMLU, BBH) are aggregated by the harness; the shots and document counts of a group are
  read from its leaf tasks (``group_subtasks``, ``n-shot``, ``n-samples``).
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import io
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastic_moe_plugin.tools.eval.errors import EvaluationError
from elastic_moe_plugin.tools.eval.suite import Suite, SuiteTask

SUMMARY_SCHEMA = "elastic-moe-eval-summary/1"
#: The output folder: the summary, one raw result file per harness call, and per-document samples.
SUMMARY_JSON = "summary.json"
SUMMARY_CSV = "summary.csv"
RAW_DIR = "raw"
SAMPLES_DIR = "samples"


def _leaves(run: Mapping[str, Any], name: str) -> list[str]:
    """The leaf tasks under a harness task or group, from the results' ``group_subtasks``."""
    groups = run.get("group_subtasks") or {}
    children = groups.get(name)
    if not children:
        return [name]
    return [leaf for child in children for leaf in _leaves(run, child)]


def _scored_docs(run: Mapping[str, Any], name: str) -> int | None:
    counts = run.get("n-samples") or {}
    found = [counts[leaf].get("effective") for leaf in _leaves(run, name) if isinstance(counts.get(leaf), Mapping)]
    return sum(found) if found and all(isinstance(n, int) for n in found) else None


def _shots(run: Mapping[str, Any], name: str) -> int | list[int] | None:
    table = run.get("n-shot") or {}
    shots = sorted({int(table[leaf]) for leaf in _leaves(run, name) if isinstance(table.get(leaf), (int, float))})
    if not shots:
        return None
    return shots[0] if len(shots) == 1 else shots


def _metric_value(task: SuiteTask, run: Mapping[str, Any]) -> tuple[float, Any]:
    """``(value, stderr or None)`` under the task's metric key, as lm-eval reported them."""
    values = (run.get("results") or {}).get(task.task)
    if values is None or task.metric_key not in values:
        available = sorted(k for k in (values or {}) if "," in k and "_stderr" not in k)
        raise EvaluationError(
            f"lm-eval results for {task.task!r} have no {task.metric_key!r} (suite task {task.name!r}); "
            f"it reported: {', '.join(available) or 'nothing'}. Fix metric/filter in the suite."
        )
    value = values[task.metric_key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise EvaluationError(f"lm-eval reported {task.metric_key}={value!r} for {task.task!r}: not a finite number.")
    return value, values.get(task.metric_key.replace(",", "_stderr,", 1))


def _task_record(
    task: SuiteTask,
    run_results: Mapping[tuple[str, int], Mapping[str, Any]],
    *,
    skipped: Mapping[str, str],
    limit: float | None,
) -> tuple[dict[str, Any], list[str]]:
    """The summary record of one suite task, and notes on shots or documents that differ from the suite's."""
    record: dict[str, Any] = {
        "name": task.name,
        "task": task.task,
        "metric_key": task.metric_key,
        "num_fewshot": task.num_fewshot,
        "in_average": task.in_average,
        "percent": task.percent,
        "higher_is_better": task.higher_is_better,
        "paper_metric": task.paper_metric,
    }
    if task.name in skipped:
        record.update(status="skipped", reason=skipped[task.name], score=None)
        return record, []
    run = run_results.get(task.run_key)
    if run is None:
        raise EvaluationError(f"no harness results for task {task.name!r} ({task.task}, {task.num_fewshot}-shot).")
    value, stderr = _metric_value(task, run)
    record.update(
        status="ok",
        score=100.0 * value if task.percent else float(value),
        stderr=(100.0 * stderr if task.percent else stderr) if isinstance(stderr, (int, float)) else None,
        n_shot=_shots(run, task.task),
        n_docs=_scored_docs(run, task.task),
    )
    notes = []
    if record["n_shot"] is not None and record["n_shot"] != task.num_fewshot:
        notes.append(
            f"{task.name}: asked for {task.num_fewshot}-shot, the harness ran {record['n_shot']}-shot "
            "(its task config pins the shots)."
        )
    if task.n_docs is not None and record["n_docs"] is not None and record["n_docs"] != task.n_docs:
        why = "--limit" if limit is not None else "a different task version or dataset revision?"
        notes.append(f"{task.name}: scored {record['n_docs']} documents, the suite expects {task.n_docs} ({why}).")
    return record, notes


def summarize(
    suite: Suite,
    run_results: Mapping[tuple[str, int], Mapping[str, Any]],
    *,
    skipped: Mapping[str, str] | None = None,
    limit: float | None = None,
) -> dict[str, Any]:
    """Turn harness results into per-task scores and the suite average.

    Args:
        suite: the suite that was run.
        run_results: ``(harness task, shots) -> lm-eval's result dict`` (the dict
            ``simple_evaluate`` returns; ``results``, ``n-shot``, ``n-samples`` and ``group_subtasks``
            are read).
        skipped: ``suite task name -> reason`` for tasks that did not run.
        limit: the ``--limit`` used, if any (only recorded).

    Returns:
        ``tasks`` (one record per suite task, in suite order), ``scores`` (name -> score of the
        tasks that ran), ``average`` (unweighted mean over the averaged tasks that ran),
        ``average_label`` (the suite's label, or ``"Avg(8 of 9)"`` when tasks were skipped),
        ``average_over``, ``average_complete``, ``skipped`` and ``notes``.

    Raises:
        EvaluationError: a task that ran has no value under its metric key.
    """
    skipped = dict(skipped or {})
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    for task in suite.tasks:
        record, task_notes = _task_record(task, run_results, skipped=skipped, limit=limit)
        records.append(record)
        notes += task_notes

    averaged = [r for r in records if r["in_average"]]
    scored = [r for r in averaged if r["status"] == "ok"]
    complete = len(scored) == len(averaged)
    average = sum(r["score"] for r in scored) / len(scored) if scored else None
    label = suite.average_label if complete else f"Avg({len(scored)} of {len(averaged)})"
    if not complete:
        missing = [r["name"] for r in averaged if r["status"] != "ok"]
        notes.insert(
            0,
            f"{label}: the average is over {len(scored)} of {len(averaged)} tasks; not run: "
            + "; ".join(f"{name} ({skipped.get(name, 'skipped')})" for name in missing)
            + ".",
        )
    if limit is not None:
        notes.append(f"--limit {limit:g}: scores cover a subset of each task and are not comparable to the paper.")
    return {
        "tasks": records,
        "scores": {r["name"]: r["score"] for r in records if r["status"] == "ok"},
        "average": average,
        "average_label": label,
        "average_over": [r["name"] for r in scored],
        "average_of": len(averaged),
        "average_complete": complete,
        "skipped": {r["name"]: r["reason"] for r in records if r["status"] == "skipped"},
        "notes": notes,
    }


def build_summary(
    suite: Suite,
    run_results: Mapping[tuple[str, int], Mapping[str, Any]],
    *,
    run: str,
    checkpoint: str,
    backend: str = "hf",
    topk: int | None = None,
    topk_native: int | list[int] | None = None,
    topk_config_key: str | None = None,
    routers: int | None = None,
    limit: float | None = None,
    apply_chat_template: bool = False,
    allow_code_execution: bool = False,
    skipped: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ``summary.json`` document: run facts plus :func:`summarize`'s scores and average."""
    return {
        "schema": SUMMARY_SCHEMA,
        "run": run,
        "suite": suite.name,
        "suite_title": suite.title,
        "suite_file": str(suite.source),
        "decimals": suite.decimals,
        "suite_average_label": suite.average_label,
        "checkpoint": checkpoint,
        "backend": backend,
        "topk": topk,
        "topk_native": topk_native,
        "topk_config_key": topk_config_key,
        "routers": routers,
        "limit": limit,
        "apply_chat_template": apply_chat_template,
        "allow_code_execution": allow_code_execution,
        **summarize(suite, run_results, skipped=skipped, limit=limit),
        "versions": _versions(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from elastic_moe_plugin import __version__

    found = {"elastic_moe_plugin": __version__}
    for package in ("lm_eval", "transformers", "torch", "vllm"):
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found


def summary_csv_row(summary: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    """Header and the one row of ``summary.csv``: run facts, one column per suite task, average."""
    header = ["run", "suite", "checkpoint", "backend", "topk", "topk_native", "limit"]
    row: list[Any] = [
        summary["run"],
        summary["suite"],
        summary["checkpoint"],
        summary["backend"],
        summary["topk"] if summary["topk"] is not None else "",
        summary["topk_native"],
        summary["limit"] if summary["limit"] is not None else "",
    ]
    for record in summary["tasks"]:
        header.append(record["name"])
        row.append("" if record["score"] is None else record["score"])
    header += ["average", "average_label", "average_over", "skipped"]
    row += [
        "" if summary["average"] is None else summary["average"],
        summary["average_label"],
        f"{len(summary['average_over'])}/{summary['average_of']}",
        "; ".join(f"{name}: {reason}" for name, reason in summary["skipped"].items()),
    ]
    return header, row


def write_summary(summary: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / SUMMARY_JSON, out_dir / SUMMARY_CSV
    json_path.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows(summary_csv_row(summary))
    csv_path.write_text(buffer.getvalue())
    return json_path, csv_path


def format_score(value: float | None, decimals: int) -> str:
    if value is None:
        return "–"
    if abs(value) >= 10**5:
        return f"{value:.4g}"
    return f"{value:.{decimals}f}"


def _report_rows(summary: Mapping[str, Any], decimals: int) -> list[tuple[str, ...]]:
    """Header, one row per suite task, and the average: task, lm-eval task, metric, shots, docs, score."""
    rows: list[tuple[str, ...]] = [("task", "lm-eval task", "metric", "shots", "docs", "score")]
    for record in summary["tasks"]:
        if record["status"] == "skipped":
            rows.append(
                (record["name"], record["task"], record["metric_key"], str(record["num_fewshot"]), "-", "skipped")
            )
            continue
        score = format_score(record["score"], decimals) + ("" if record["in_average"] else "  (not averaged)")
        rows.append(
            (
                record["name"],
                record["task"],
                record["metric_key"],
                str(record.get("n_shot", "")),
                str(record.get("n_docs") if record.get("n_docs") is not None else "?"),
                score,
            )
        )
    rows.append((summary["average_label"], "", "", "", "", format_score(summary["average"], decimals)))
    return rows


def format_summary(summary: Mapping[str, Any], out_dir: str | os.PathLike[str] | None = None) -> str:
    """The human-readable report ``elastic-moe eval`` prints."""
    decimals = summary.get("decimals", 2)
    topk = summary["topk"]
    routing = (
        f"top-k {topk} (override; native {summary['topk_native']})"
        if topk is not None
        else f"top-k {summary['topk_native']} (native)"
    )
    lines = [
        f"suite {summary['suite']} ({summary['suite_title']}) on {summary['checkpoint']}",
        f"run {summary['run']}: backend {summary['backend']}, {routing}, "
        f"chat template {'on' if summary['apply_chat_template'] else 'off'}"
        + (f", limit {summary['limit']:g}" if summary["limit"] is not None else ""),
    ]
    rows = _report_rows(summary, decimals)
    # the score goes last and unpadded: its "(not averaged)" suffix would push the numbers out of line
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        lines.append(
            "  "
            + "  ".join(cell.ljust(widths[i]) if i < 3 else cell.rjust(widths[i]) for i, cell in enumerate(row[:5]))
            + "  "
            + row[5]
        )
    lines += [f"note: {note}" for note in summary["notes"]]
    if out_dir is not None:
        out = Path(out_dir)
        lines.append(f"wrote {out / SUMMARY_JSON}, {out / SUMMARY_CSV} and {out / RAW_DIR}/")
    return "\n".join(lines)
