"""``elastic-moe bench --only swift-profile``: where a ``swift sft`` step's host time goes, static
against elastic, op by op.

The ``swift sft`` row of ``--only e2e`` (:mod:`.e2e_swift`: the tiny OLMoE-shaped model, real
``swift sft`` with the plugin file, ``ELASTIC_MOE_SCHEDULE=static`` against ``6-10``), one run per
schedule, each under torch.profiler (host activities) over steps ``first + 1`` to ``first + count``
(``--profile FIRST:COUNT``, default ``4:3``, of ``--steps``, default 8). Reported: the self CPU time
of all ops over those steps per schedule, and the ops whose self CPU time differs most between the
two (summed over the steps), with their call counts. One run per schedule on a shared machine: the
totals drift with its load, the differences of single ops that follow the routing (``index``,
``cat``, ``mul``, ...) are what to read.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from elastic_moe_plugin.tools.bench import e2e_swift
from elastic_moe_plugin.tools.bench.schema import BenchRow, Metric, Scalar, row

DEFAULT_WINDOW, QUICK_WINDOW = "4:3", "2:1"
DEFAULT_STEPS, QUICK_STEPS = 8, 4
TOP = 15


@dataclass
class ProfileResult:
    """Self CPU µs and calls per op over the profiled steps, per schedule (``static``, ``6-10``)."""

    window: str
    steps: int
    model: str
    tables: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # schedule -> op -> [µs, calls]

    def totals_ms(self) -> dict[str, float]:
        return {schedule: sum(us for us, _ in table.values()) / 1e3 for schedule, table in self.tables.items()}

    def top(self, count: int = TOP) -> list[str]:
        """The ``count`` ops whose self CPU time differs most between the schedules."""
        static, elastic = (self.tables[schedule] for schedule in e2e_swift.SCHEDULES)
        ops = set(static) | set(elastic)
        return sorted(ops, key=lambda op: -abs(elastic.get(op, [0, 0])[0] - static.get(op, [0, 0])[0]))[:count]


def _window(profile: str, steps: int) -> str:
    first, _, count = profile.partition(":")
    if not (first.isdigit() and count.isdigit() and int(count) >= 1 and int(first) + int(count) <= steps):
        raise ValueError(
            f"--profile {profile} --steps {steps}: FIRST:COUNT with FIRST + COUNT <= --steps, "
            f"e.g. --profile {DEFAULT_WINDOW} --steps {DEFAULT_STEPS}."
        )
    return profile


def check(quick: bool, steps: int | None, profile: str | None, work: Path | None) -> None:
    """Raise ValueError, naming the flag and a fix, for a window that does not fit the run or a
    ``--work`` folder that holds an earlier profile's runs (before anything runs)."""
    _window(profile or (QUICK_WINDOW if quick else DEFAULT_WINDOW), steps or (QUICK_STEPS if quick else DEFAULT_STEPS))
    earlier = work / "swift_profile" if work is not None else None
    if earlier is not None and any(earlier.glob("profile_*")):
        raise ValueError(f"--work {work}: {earlier} holds an earlier profile's runs; pass an empty or new folder.")


def run(
    quick: bool,
    steps: int | None = None,
    profile: str | None = None,
    hidden: int | None = None,
    experts_impl: str | None = None,
    work: Path | None = None,
) -> ProfileResult:
    """One profiled ``swift sft`` run per schedule. Raises ValueError on a window that does not fit."""
    steps = steps or (QUICK_STEPS if quick else DEFAULT_STEPS)
    window = _window(profile or (QUICK_WINDOW if quick else DEFAULT_WINDOW), steps)
    work = work or Path(tempfile.mkdtemp(prefix="elastic_moe_bench_swift_profile_"))
    launcher = e2e_swift.SwiftSft(hidden=hidden, experts_impl=experts_impl)
    model_dir, dataset = e2e_swift.build(work / "assets", launcher.model)
    result = ProfileResult(window, steps, launcher.describe())
    for schedule in e2e_swift.SCHEDULES:
        out = work / f"profile_{schedule}"
        out.mkdir(parents=True)
        command = e2e_swift.command(model_dir, dataset, schedule, steps, out, experts_impl, profile=window)
        log = out / "output.log"
        with log.open("wb") as sink:
            code = subprocess.call(
                command.argv, cwd=command.cwd, env=command.env, stdout=sink, stderr=subprocess.STDOUT
            )
        if code != 0:
            raise RuntimeError(f"swift sft ({schedule}) exited {code}; its log: {log}")
        result.tables[schedule] = json.loads((out / "profile.json").read_text())
    return result


def rows(result: ProfileResult) -> list[BenchRow]:
    """The schema rows: ``all ops`` per schedule, then each of the top ops per schedule; 6-10 against static."""
    static, elastic = e2e_swift.SCHEDULES
    params: dict[str, Scalar] = dict(window=result.window, steps=result.steps, model=result.model)
    totals = result.totals_ms()
    # (op or "all ops") -> schedule -> (self CPU ms, calls or None)
    measured: dict[str, dict[str, tuple[float, int | None]]] = {"all ops": {s: (totals[s], None) for s in totals}}
    for op in result.top():
        measured[op] = {
            s: (table.get(op, [0, 0])[0] / 1e3, int(table.get(op, [0, 0])[1])) for s, table in result.tables.items()
        }
    out = []
    for op, cells in measured.items():
        for schedule in (static, elastic):
            ms, calls = cells[schedule]
            metrics: dict[str, Metric] = {"self_cpu_ms": ms} if calls is None else {"self_cpu_ms": ms, "calls": calls}
            compared = schedule == elastic
            out.append(
                row(
                    "swift-profile",
                    "all ops" if op == "all ops" else "op",
                    f"{op}: self CPU over steps {result.window} of swift sft, {result.model}",
                    schedule,
                    params={**params, "op": op},
                    metrics=metrics,
                    baseline=static if compared else None,
                    ratios={"self_cpu_ms_added": ms - cells[static][0]} if compared else None,
                )
            )
    return out


def format_table(result: ProfileResult) -> str:
    static, elastic = e2e_swift.SCHEDULES
    totals = result.totals_ms()
    lines = [
        f"swift sft under torch.profiler, {result.model}: self CPU over steps {result.window}: "
        f"{static} {totals[static]:.0f} ms, {elastic} {totals[elastic]:.0f} ms "
        f"({totals[elastic] - totals[static]:+.0f} ms)",
        f"{'op':42s} {static + ' ms':>10s} {elastic + ' ms':>10s} {'diff ms':>9s} {'calls':>13s}",
    ]
    for op in result.top():
        (s_us, s_calls), (e_us, e_calls) = (result.tables[s].get(op, [0, 0]) for s in (static, elastic))
        lines.append(
            f"{op:42s} {s_us / 1e3:10.1f} {e_us / 1e3:10.1f} {(e_us - s_us) / 1e3:+9.1f} "
            f"{int(s_calls):6d}/{int(e_calls):<6d}"
        )
    return "\n".join(lines)


__all__ = ["DEFAULT_STEPS", "DEFAULT_WINDOW", "ProfileResult", "check", "format_table", "rows", "run"]
