"""The paired differences of a study's results, as a table and as the results file's ``comparisons``.

For each arm against the baseline (the plan's first arm: ``static`` in a demo study), over the
seeds where both have the quantity, one :class:`~.stats.PairedDifference` per quantity:

- a demo study: the held-out loss at k, at each k' of the inference sweep, per task, the
  tokens-per-expert imbalance and the final training loss (lower is better for all);
- a study read from evaluations (:mod:`.evals`): the suite average at the native top-k and at each
  k', and every task's score (higher is better, except where the suite says otherwise).

Then, where the results hold them (:mod:`.routers`), each elastic arm's router measures against
static (D1, Dk, D1 − Dk, the top-1 reorder share), one estimate of the mean over seeds each.

A difference is called only where both 95% intervals exclude 0 (``elastic lower``/``elastic
higher``, and whether that is the better side); any other row says plainly that this study cannot
tell the arms apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from elastic_moe_plugin.tools.compare import stats
from elastic_moe_plugin.tools.compare.routers import MEASURES
from elastic_moe_plugin.tools.compare.study import arm_values

Reader = Callable[[dict[str, Any]], float | None]
UNDETECTED = "no difference detectable (an interval contains 0)"


@dataclasses.dataclass(frozen=True)
class Quantity:
    """How to read one quantity from a run, and which way is better."""

    read: Reader
    higher_is_better: bool = False


def quantities(data: dict[str, Any]) -> dict[str, Quantity]:
    """{name: quantity} for every quantity the runs of ``data`` hold."""
    runs = list(data["runs"].values())
    if not runs:
        return {}
    return _evaluation_quantities(runs[0]) if data.get("source") == "eval" else _demo_quantities(runs[0])


def _demo_quantities(first: dict[str, Any]) -> dict[str, Quantity]:
    topk = first["topk"]
    found: dict[str, Quantity] = {f"heldout_loss@k={topk}": Quantity(lambda run: run["heldout_loss"])}
    for k in sorted(first["topk_sweep"], key=int):
        if int(k) != topk:
            found[f"heldout_loss@k'={k}"] = Quantity(_reading("topk_sweep", k))
    for task in first.get("task_losses", {}):
        found[f"task_loss[{task}]"] = Quantity(_reading("task_losses", task))
    found["imbalance(max/mean)"] = Quantity(lambda run: run.get("imbalance"))
    found["final_train_loss"] = Quantity(lambda run: run["final_train_loss"])
    return found


def _evaluation_quantities(first: dict[str, Any]) -> dict[str, Quantity]:
    topk, native = first["topk"], first["evals"][str(first["topk"])]
    label = native["average_label"]
    found = {f"{label}@k={topk}": Quantity(_evaluation_reading(topk, "average"), True)}
    for k in sorted(first["evals"], key=int):
        if int(k) != topk:
            found[f"{label}@k'={k}"] = Quantity(_evaluation_reading(int(k), "average"), True)
    for task, higher in native["higher_is_better"].items():
        found[f"{task}@k={topk}"] = Quantity(_evaluation_reading(topk, "scores", task), higher)
    return found


def _reading(section: str, key: str) -> Reader:
    def read(run: dict[str, Any]) -> float | None:
        return run.get(section, {}).get(key)

    return read


def _evaluation_reading(topk: int, field: str, task: str | None = None) -> Reader:
    def read(run: dict[str, Any]) -> float | None:
        evaluation = run["evals"].get(str(topk))
        if evaluation is None:
            return None
        return evaluation[field] if task is None else evaluation[field].get(task)

    return read


def comparisons(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every arm's paired differences against the baseline, then the router measures, as JSON-able rows."""
    rows = []
    baseline, *arms = data["plan"]["arms"]
    for arm in arms:
        for name, quantity in quantities(data).items():
            base = arm_values(data, baseline, quantity.read)
            other = arm_values(data, arm, quantity.read)
            seeds = set(base) & set(other)
            if not seeds:
                continue
            result = stats.compare(name, {s: base[s] for s in seeds}, {s: other[s] for s in seeds})
            rows.append(_row(arm, result, difference_verdict(result, quantity.higher_is_better)))
        rows += router_rows(data, arm)
    return rows


def router_rows(data: dict[str, Any], arm: str) -> list[dict[str, Any]]:
    """The arm's router measures against static (:mod:`.routers`), one estimate over seeds each."""
    prefix = f"{arm}/seed"
    measured = {
        int(key[len(prefix) :]): entry for key, entry in data.get("routers", {}).items() if key.startswith(prefix)
    }
    rows = []
    for measure in MEASURES:
        values = {seed: entry[measure] for seed, entry in measured.items() if entry.get(measure) is not None}
        if values:
            result = stats.estimate(f"router {measure}", values)
            rows.append(_row(arm, result, _router_verdict(measure, result)))
    return rows


def _row(arm: str, result: stats.PairedDifference, verdict: str) -> dict[str, Any]:
    def interval(value: stats.Interval | None) -> list[float] | None:
        return None if value is None else [value.low, value.high]

    return {
        "arm": arm,
        "quantity": result.name,
        "seeds": list(result.seeds),
        "differences": list(result.differences),
        "mean_difference": result.mean,
        "t_interval": interval(result.t_interval),
        "bootstrap_interval": interval(result.bootstrap_interval),
        "detectable": result.detectable,
        "verdict": verdict,
    }


def difference_verdict(result: stats.PairedDifference, higher_is_better: bool = False) -> str:
    """One phrase: which side the arm lies on, and whether that is better, where both intervals
    exclude 0; else that this study cannot tell."""
    if result.t_interval is None:
        return "one seed: no interval"
    if not result.detectable:
        return UNDETECTED
    higher = result.mean > 0
    return f"elastic {'higher' if higher else 'lower'} ({'better' if higher == higher_is_better else 'worse'})"


def _router_verdict(measure: str, result: stats.PairedDifference) -> str:
    if measure != "D1-Dk":
        return "level (static vs elastic routers)"
    if result.t_interval is None:
        return "one seed: no interval"
    if not result.detectable:
        return "D1 vs Dk: " + UNDETECTED
    return "D1 > Dk: reorders inside the top-k set" if result.mean > 0 else "D1 < Dk: swaps the set more than its top-1"


def format_table(data: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The printed table: per arm and quantity, mean difference, both 95% intervals and the verdict."""
    lines = [
        _headline(data),
        f"difference = arm - {data['plan']['arms'][0]}, per seed (same seed: init, data order); "
        "95% intervals of the mean; router rows: the measure itself",
        f"{'arm':<8} {'quantity':<26} {'n':>3} {'mean diff':>10} {'paired t 95%':>22} {'bootstrap 95%':>22}  verdict",
    ]
    for row in rows:
        lines.append(
            f"{row['arm']:<8} {row['quantity']:<26} {len(row['seeds']):>3} {row['mean_difference']:>+10.4f} "
            f"{_interval(row['t_interval']):>22} {_interval(row['bootstrap_interval']):>22}  {row['verdict']}"
        )
    return "\n".join(lines)


def _headline(data: dict[str, Any]) -> str:
    plan = data["plan"]
    if data.get("source") == "eval":
        return (
            f"elastic-moe compare: {len(plan['seeds'])} seeds x {len(plan['arms'])} arms ({', '.join(plan['arms'])}); "
            f"elastic-moe eval summaries under {plan['root']}"
        )
    settings = plan["settings"]
    return (
        f"elastic-moe compare: {len(plan['seeds'])} seeds x {len(plan['arms'])} arms ({', '.join(plan['arms'])}); "
        f"demo GPT {settings['num_layers']} layers, H={settings['hidden_size']}, {settings['num_experts']} experts, "
        f"top-{settings['topk']}; {settings['steps']} steps x {settings['batch_size']} x {settings['seq_len']} tokens"
    )


def _interval(value: list[float] | None) -> str:
    return "-" if value is None else f"[{value[0]:+.4f}, {value[1]:+.4f}]"


__all__ = ["Quantity", "comparisons", "difference_verdict", "format_table", "quantities", "router_rows"]
