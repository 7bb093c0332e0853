"""The paired differences of a study's results, as a table and as the results file's ``comparisons``.

For each elastic arm against ``static``, over the seeds both finished, one :class:`~.stats.PairedDifference`
per quantity: the held-out loss at k, at each k' of the inference sweep, per task, the
tokens-per-expert imbalance and the final training loss. Negative differences favour elastic for
every quantity here (losses, and max/mean load). A row whose two intervals both exclude 0 says
which arm is better; any other says plainly that this study cannot tell the arms apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic_moe_plugin.tools.compare import stats
from elastic_moe_plugin.tools.compare.study import STATIC, arm_values, complete_seeds

Reader = Callable[[dict[str, Any]], float | None]


def quantities(data: dict[str, Any]) -> dict[str, Reader]:
    """{name: how to read it from a run} for every quantity the runs of ``data`` hold."""
    runs = list(data["runs"].values())
    if not runs:
        return {}
    first = runs[0]
    topk = first["topk"]
    readers: dict[str, Reader] = {f"heldout_loss@k={topk}": lambda run: run["heldout_loss"]}
    for k in sorted(first["topk_sweep"], key=int):
        if int(k) != topk:
            readers[f"heldout_loss@k'={k}"] = _reading("topk_sweep", k)
    for task in first.get("task_losses", {}):
        readers[f"task_loss[{task}]"] = _reading("task_losses", task)
    readers["imbalance(max/mean)"] = lambda run: run.get("imbalance")
    readers["final_train_loss"] = lambda run: run["final_train_loss"]
    return readers


def _reading(section: str, key: str) -> Reader:
    def read(run: dict[str, Any]) -> float | None:
        return run.get(section, {}).get(key)

    return read


def comparisons(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every elastic arm's paired differences against static, as JSON-able rows."""
    rows = []
    arms = data["plan"]["arms"]
    for arm in arms[1:]:
        seeds = set(complete_seeds(data, [STATIC, arm]))
        for name, read in quantities(data).items():
            static = {s: v for s, v in arm_values(data, STATIC, read).items() if s in seeds}
            elastic = {s: v for s, v in arm_values(data, arm, read).items() if s in seeds}
            if not static:
                continue
            result = stats.compare(name, static, elastic)
            rows.append(_row(arm, result))
    return rows


def _row(arm: str, result: stats.PairedDifference) -> dict[str, Any]:
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
        "verdict": verdict(result),
    }


def verdict(result: stats.PairedDifference) -> str:
    """One phrase: which arm is better where both intervals exclude 0, else that none is detectable."""
    if result.t_interval is None:
        return "one seed: no interval"
    if not result.detectable:
        return "no difference detectable (an interval contains 0)"
    return "elastic lower" if result.mean < 0 else "static lower"


def format_table(data: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The printed table: per arm and quantity, mean difference, both 95% intervals and the verdict."""
    plan = data["plan"]
    settings = plan["settings"]
    lines = [
        f"elastic-moe compare: {len(plan['seeds'])} seeds x {len(plan['arms'])} arms ({', '.join(plan['arms'])}); "
        f"demo GPT {settings['num_layers']} layers, H={settings['hidden_size']}, {settings['num_experts']} experts, "
        f"top-{settings['topk']}; {settings['steps']} steps x {settings['batch_size']} x {settings['seq_len']} tokens",
        "difference = elastic - static, per seed (same seed: init, data order); 95% intervals of the mean",
        f"{'arm':<8} {'quantity':<26} {'n':>3} {'mean diff':>10} {'paired t 95%':>22} {'bootstrap 95%':>22}  verdict",
    ]
    for row in rows:
        lines.append(
            f"{row['arm']:<8} {row['quantity']:<26} {len(row['seeds']):>3} {row['mean_difference']:>+10.4f} "
            f"{_interval(row['t_interval']):>22} {_interval(row['bootstrap_interval']):>22}  {row['verdict']}"
        )
    return "\n".join(lines)


def _interval(value: list[float] | None) -> str:
    return "-" if value is None else f"[{value[0]:+.4f}, {value[1]:+.4f}]"


__all__ = ["comparisons", "format_table", "quantities", "verdict"]
