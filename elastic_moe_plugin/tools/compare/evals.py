"""A study read from the recipes' own evaluations: ``elastic-moe eval`` summaries laid out by arm and seed.

On a cluster the runs are the recipes' (``elastic-moe launch pretrain/top8`` and
``pretrain/6-10``, each with its seed), evaluated by ``elastic-moe eval``. ``elastic-moe compare
--from-eval ROOT`` reads every ``summary.json`` under ROOT whose folder path is::

    ROOT/<arm>/seed<N>/.../summary.json      e.g. ROOT/pretrain/6-10/seed3/topk8/summary.json

- the arm is the path between ROOT and the ``seed<N>`` folder (``pretrain/6-10``);
- one folder below ``seed<N>`` per evaluation of that checkpoint: the native top-k (``eval`` without
  ``--topk``) and any inference k' of a sweep (``eval --topk K``), told apart by the summary's own
  ``topk``/``topk_native`` fields, never by the folder's name.

The baseline arm is the first of ``--arms`` when given, else the one arm whose last part is
``static`` or ``top<k>`` with k the native top-k (``pretrain/top8``). The runs become the same
``runs`` table as a demo study's (``arm``, ``seed``, ``topk`` and, per inference top-k, the suite
average and every task's score), so one report and one set of plots serve both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.tools.compare.study import FORMAT, run_key

SEED_FOLDER = re.compile(r"seed(\d+)$")
LAYOUT = "ROOT/<arm>/seed<N>/.../summary.json (e.g. ROOT/pretrain/6-10/seed0/topk8/summary.json)"


def _arm_and_seed(root: Path, file: Path) -> tuple[str, int]:
    parts = file.relative_to(root).parts[:-1]
    seeds = [index for index, part in enumerate(parts) if SEED_FOLDER.fullmatch(part)]
    if len(seeds) != 1 or seeds[0] == 0:
        raise ConfigError(f"--from-eval {root}: {file} is not laid out as {LAYOUT}.")
    match = SEED_FOLDER.fullmatch(parts[seeds[0]])
    assert match is not None  # found by the same pattern above
    return "/".join(parts[: seeds[0]]), int(match.group(1))


def _evaluation(summary: dict[str, Any]) -> dict[str, Any]:
    """What a study keeps of one summary: the average (None unless over the whole suite) and the scores."""
    return {
        "average": summary["average"] if summary["average_complete"] else None,
        "average_label": summary["suite_average_label"],
        "scores": dict(summary["scores"]),
        "higher_is_better": {record["name"]: record["higher_is_better"] for record in summary["tasks"]},
    }


def read_evaluations(root: Path) -> dict[str, dict[str, Any]]:
    """{``arm/seed<N>``: run} of every summary under ``root`` (module docstring).

    Raises:
        ConfigError: no summary, a summary outside the layout, summaries of different suites, two
            evaluations of one checkpoint at one top-k, or a seed without its native top-k.
    """
    from elastic_moe_plugin.tools.eval.table import load_summary

    files = sorted(root.rglob("summary.json"))
    if not files:
        raise ConfigError(f"--from-eval {root}: no elastic-moe eval summary.json under it; expected {LAYOUT}.")
    runs: dict[str, dict[str, Any]] = {}
    suites = set()
    for file in files:
        summary = load_summary(file)
        suites.add(summary["suite"])
        arm, seed = _arm_and_seed(root, file)
        native = summary["topk_native"]
        topk = native if summary["topk"] is None else summary["topk"]
        run = runs.setdefault(run_key(seed, arm), {"arm": arm, "seed": seed, "topk": native, "evals": {}})
        if str(topk) in run["evals"]:
            raise ConfigError(f"--from-eval {root}: two evaluations of {arm} seed {seed} at top-{topk}; keep one.")
        run["evals"][str(topk)] = _evaluation(summary)
    if len(suites) > 1:
        raise ConfigError(f"--from-eval {root}: summaries of different suites ({', '.join(sorted(suites))}).")
    for key, run in runs.items():
        if str(run["topk"]) not in run["evals"]:
            raise ConfigError(f"--from-eval {root}: {key} has no evaluation at its native top-{run['topk']}.")
    return runs


def baseline_first(arms: list[str], chosen: list[str] | None, topk: int) -> list[str]:
    """The arms, the baseline first (``chosen[0]`` if given, else the one ``static`` / ``top<k>`` arm).

    Raises:
        ConfigError: a chosen arm that was not found, or no single default baseline.
    """
    if chosen:
        missing = [arm for arm in chosen if arm not in arms]
        if missing:
            raise ConfigError(
                f"--arms {','.join(chosen)}: no evaluations of {', '.join(missing)} (found: {', '.join(arms)})."
            )
        return list(chosen)
    baselines = [arm for arm in arms if arm.rsplit("/", 1)[-1] in ("static", f"top{topk}")]
    if len(baselines) != 1:
        raise ConfigError(
            f"--from-eval: cannot tell the static arm among {', '.join(arms)}; name it first, "
            f"e.g. --arms {arms[0]},{','.join(arms[1:]) or '...'}."
        )
    return baselines + sorted(arm for arm in arms if arm != baselines[0])


def study_from_evaluations(root: Path, chosen_arms: list[str] | None) -> dict[str, Any]:
    """A study's results (the demo study's format, ``source: eval``) from the summaries under ``root``."""
    runs = read_evaluations(root)
    topk = next(iter(runs.values()))["topk"]
    arms = baseline_first(sorted({run["arm"] for run in runs.values()}), chosen_arms, topk)
    runs = {key: run for key, run in runs.items() if run["arm"] in arms}
    seeds = sorted({run["seed"] for run in runs.values()})
    return {"format": FORMAT, "source": "eval", "plan": {"arms": arms, "seeds": seeds, "root": str(root)}, "runs": runs}


__all__ = ["LAYOUT", "baseline_first", "read_evaluations", "study_from_evaluations"]
