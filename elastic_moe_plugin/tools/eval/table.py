"""``elastic-moe eval-table``: merge ``elastic-moe eval`` summaries into one comparison table.

One row per run, one column per suite task (in suite order), then the suite average and its Δ
against a baseline run, as in the paper's Table 3; a second table gives every per-task Δ. Output
is markdown (printed, and written with ``--out``) and CSV.

Deltas are differences of the **printed** values: scores are rounded to the suite's decimals
(Table 1: 2, Table 2: 1) first and subtracted afterwards, so each Δ equals the difference of the
two numbers in the table. This is how the paper's gains are computed: Qwen3 6–10 vs top-8 is
58.44 − 56.42 = +2.02, while the unrounded means differ by 2.014.

An average over fewer tasks than the suite has (MBPP skipped) is marked ``†`` and its Δ is not
computed against an average over a different set of tasks (``n/c``).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_moe_plugin.tools.eval.errors import EvaluationError
from elastic_moe_plugin.tools.eval.summary import SUMMARY_JSON, SUMMARY_SCHEMA, format_score


class TableError(EvaluationError, ValueError):
    """Summaries cannot be merged: missing, from different suites, or an unknown baseline."""


@dataclass(frozen=True)
class Column:
    name: str
    higher_is_better: bool
    in_average: bool


@dataclass(frozen=True)
class Table:
    """Merged runs. ``rows[i]`` is the summary dict of run ``i``; ``baseline`` indexes ``rows``."""

    suite: str
    decimals: int
    average_label: str
    columns: tuple[Column, ...]
    rows: tuple[Mapping[str, Any], ...]
    baseline: int

    def score(self, row: int, column: str) -> float | None:
        return self.rows[row]["scores"].get(column)

    def rounded(self, value: float | None) -> float | None:
        return None if value is None else round(value, self.decimals)

    def delta(self, row: int, column: str) -> float | None:
        """Printed value minus the baseline's printed value; None if either did not run."""
        value, base = self.rounded(self.score(row, column)), self.rounded(self.score(self.baseline, column))
        return None if value is None or base is None else round(value - base, self.decimals)

    def average_delta(self, row: int) -> float | None:
        """Δ of the averages, only when both are over the same tasks."""
        mine, base = self.rows[row], self.rows[self.baseline]
        value, base_value = self.rounded(mine["average"]), self.rounded(base["average"])
        if value is None or base_value is None or set(mine["average_over"]) != set(base["average_over"]):
            return None
        return round(value - base_value, self.decimals)


def load_summary(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an eval run's ``summary.json`` (given the run folder or the file itself)."""
    path = Path(path)
    file = path / SUMMARY_JSON if path.is_dir() else path
    if not file.is_file():
        raise TableError(f"{path} has no {SUMMARY_JSON}: expected an `elastic-moe eval` output folder.")
    try:
        summary = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise TableError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(summary, dict) or summary.get("schema") != SUMMARY_SCHEMA:
        raise TableError(f"{file} is not an elastic-moe eval summary (schema {SUMMARY_SCHEMA!r}).")
    return summary


def merge(summaries: Sequence[Mapping[str, Any]], baseline: str | None = None) -> Table:
    """Merge summaries of one suite; ``baseline`` is a run name (default: the first run).

    Raises:
        TableError: no summaries, runs of different suites, repeated run names, unknown baseline.
    """
    if not summaries:
        raise TableError("no summaries to merge: pass one or more eval output folders.")
    suites = sorted({summary["suite"] for summary in summaries})
    if len(suites) > 1:
        raise TableError(
            f"cannot merge runs of different suites ({', '.join(suites)}) into one table; "
            "run eval-table once per suite."
        )
    names = [summary["run"] for summary in summaries]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise TableError(
            f"run names must be unique, repeated: {', '.join(repeated)}. Rename with `elastic-moe eval --name`."
        )
    if baseline is None:
        base = 0
    elif baseline in names:
        base = names.index(baseline)
    else:
        raise TableError(f"--baseline {baseline!r} is not one of the runs: {', '.join(names)}.")
    columns: dict[str, Column] = {}
    for summary in summaries:
        for record in summary["tasks"]:
            columns.setdefault(record["name"], Column(record["name"], record["higher_is_better"], record["in_average"]))
    first = summaries[base]
    return Table(
        suite=first["suite"],
        decimals=int(first.get("decimals", 2)),
        average_label=str(first.get("suite_average_label", "Average")),
        columns=tuple(columns.values()),
        rows=tuple(summaries),
        baseline=base,
    )


def _header(column: Column) -> str:
    return column.name + ("" if column.higher_is_better else " ↓")


def _signed(value: float | None, decimals: int) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.4g}" if abs(value) >= 10**5 else f"{value:+.{decimals}f}"


def _topk(row: Mapping[str, Any]) -> str:
    return str(row["topk"] if row["topk"] is not None else row["topk_native"])


def _cell(table: Table, row: int, column: str) -> str:
    record = next((r for r in table.rows[row]["tasks"] if r["name"] == column), None)
    if record is None:
        return "n/a"
    if record["status"] == "skipped":
        return "skipped"
    return format_score(record["score"], table.decimals)


def _average_cell(table: Table, row: int) -> str:
    summary = table.rows[row]
    text = format_score(summary["average"], table.decimals)
    return text if summary["average_complete"] else text + "†"


def to_markdown(table: Table) -> str:
    """Scores with the average and its Δ, then the per-task Δ table, then footnotes."""
    d = table.decimals
    base_name = table.rows[table.baseline]["run"]
    head = ["Run", "top-k", *(_header(c) for c in table.columns), table.average_label, "Δ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(table.rows):
        delta = "–" if i == table.baseline else _signed(table.average_delta(i), d).replace("n/a", "n/c")
        cells = [
            row["run"],
            _topk(row),
            *(_cell(table, i, c.name) for c in table.columns),
            _average_cell(table, i),
            delta,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Δ vs {base_name} (printed values subtracted):", ""]
    head = ["Run", *(_header(c) for c in table.columns), table.average_label]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(table.rows):
        if i == table.baseline:
            continue
        cells = [
            row["run"],
            *(_signed(table.delta(i, c.name), d) for c in table.columns),
            _signed(table.average_delta(i), d).replace("n/a", "n/c"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for row in table.rows:
        if not row["average_complete"]:
            notes.append(f"† {row['run']}: {row['average_label']}, skipped: {', '.join(row['skipped'])}.")
    if any(table.average_delta(i) is None for i in range(len(table.rows))):
        notes.append("n/c: averages over different task sets are not compared.")
    if any(not c.in_average for c in table.columns):
        notes.append(
            "Not in the average: "
            + ", ".join(c.name for c in table.columns if not c.in_average)
            + ". ↓: lower is better."
        )
    limited = [row["run"] for row in table.rows if row.get("limit") is not None]
    if limited:
        notes.append(f"Run with --limit (not comparable to the paper): {', '.join(limited)}.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def to_csv(table: Table) -> str:
    """One row per run: facts, printed scores, average, Δ average, then ``delta <task>`` columns."""
    d = table.decimals
    header = [
        "run",
        "suite",
        "checkpoint",
        "topk",
        *(c.name for c in table.columns),
        "average",
        "average_over",
        "delta average",
        *(f"delta {c.name}" for c in table.columns),
    ]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)

    def number(value: float | None) -> str:
        return "" if value is None else f"{value:.{d}f}"

    for i, row in enumerate(table.rows):
        writer.writerow(
            [
                row["run"],
                row["suite"],
                row["checkpoint"],
                _topk(row),
                *(number(table.rounded(table.score(i, c.name))) for c in table.columns),
                number(table.rounded(row["average"])),
                f"{len(row['average_over'])}/{row['average_of']}",
                number(table.average_delta(i)),
                *(number(table.delta(i, c.name)) for c in table.columns),
            ]
        )
    return buffer.getvalue()


def write_table(table: Table, out: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``OUT.md`` and ``OUT.csv`` (a ``.md``/``.csv`` suffix on ``out`` is replaced)."""
    out = Path(out)
    stem = out.with_suffix("") if out.suffix in {".md", ".csv"} else out
    md, csv_path = stem.parent / f"{stem.name}.md", stem.parent / f"{stem.name}.csv"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(to_markdown(table))
    csv_path.write_text(to_csv(table))
    return md, csv_path
