"""How far elastic training moved the router from static training, seed by seed (paper §6.2, Eq. 11-12).

The two runs of one seed start from the same initialisation and see the same batches, so their
experts stay comparable: each elastic arm's router is compared with the static arm's on the demo's
held-out sequences, one probe task per task of the synthetic mixture, through ``elastic-moe
diagnose``'s own pass (:func:`elastic_moe_plugin.tools.diagnose.compare`, static top-k, no sweep):

- ``D1``: the share of (layer, token) whose top-1 expert differs (Eq. 11);
- ``Dk``: the mean of 1 − |S^static ∩ S^elastic| / k over (layer, token), S the top-k sets (Eq. 12);
- ``D1-Dk``: the paper's "expert prioritisation" reads D1 > Dk (elastic reorders experts inside a
  largely shared top-k set); per seed this difference is already a within-pair contrast, so its
  interval over seeds says whether the study sees it;
- ``top1_reorder_share``: of the top-1 changes, the share where each model's top-1 lies in the
  other's top-k set.

Per-task values are averaged over tasks (each task weighs the same), then over layers, as
``diagnose`` does. The measures are kept in the results file under ``routers`` (``arm/seed<s>``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from elastic_moe_plugin.tools.compare.study import STATIC, run_key
from elastic_moe_plugin.tools.demo.settings import DemoSettings

#: the measures read from a diagnose pair summary, in the table's order
MEASURES = ("D1", "Dk", "D1-Dk", "top1_reorder_share")


def probe_tasks(settings: DemoSettings) -> list[Any]:
    """The demo's held-out sequences [M, seq_len + 1] as one diagnose probe task per task of the
    synthetic mixture (a sequence's task is its tag, the first token)."""
    from elastic_moe_plugin.tools.demo.corpus import TASKS, synthetic_corpus
    from elastic_moe_plugin.tools.diagnose import ProbeTask

    heldout = synthetic_corpus(settings).heldout
    tags = heldout[:, 0]
    return [
        ProbeTask(name, f"demo held-out split, task {name}", list(heldout[tags == 1 + index]))
        for index, name in enumerate(TASKS)
        if bool((tags == 1 + index).any())
    ]


def pair_measures(pair: dict[str, Any]) -> dict[str, float | None]:
    """The :data:`MEASURES` of one diagnose pair summary (``results["pairs"][...]``)."""
    d1, dk = pair["D1"], pair["Dk"]
    return {
        "D1": d1,
        "Dk": dk,
        "D1-Dk": None if d1 is None or dk is None else d1 - dk,
        "top1_reorder_share": pair["prioritisation"]["top1_reorder_share"],
    }


def seed_measures(folder: Path, arms: list[str], settings: DemoSettings) -> dict[str, dict[str, float | None]]:
    """{elastic arm: :data:`MEASURES` against the static arm} of the checkpoints in one seed's folder."""
    from elastic_moe_plugin.tools.diagnose import CompareSettings, compare, load_models, parse_checkpoint

    specs = [spec for arm in arms for spec in parse_checkpoint(f"{arm}={folder}:{arm}")]
    with contextlib.ExitStack() as stack:
        models = load_models(specs, stack)
        results = compare(models, probe_tasks(settings), CompareSettings(sweep=()))
    return {arm: pair_measures(results["pairs"][f"{STATIC} vs {arm}"]) for arm in arms[1:]}


def measure_routers(data: dict[str, Any], out: Path, log=print) -> bool:
    """Fill ``data["routers"]`` for every seed whose runs are all finished and not yet measured;
    returns whether anything was added. Runs on the CPU (diagnose's demo models)."""
    import dataclasses

    from elastic_moe_plugin.tools.compare.study import complete_seeds

    plan = data["plan"]
    arms = plan["arms"]
    routers = data.setdefault("routers", {})
    settings = dataclasses.replace(DemoSettings(), **plan["settings"])
    pending = [
        seed for seed in complete_seeds(data, arms) if any(run_key(seed, arm) not in routers for arm in arms[1:])
    ]
    for seed in pending:
        log(f"elastic-moe compare: router measures of seed {seed} (static vs {', '.join(arms[1:])})")
        for arm, measures in seed_measures(out / f"seed{seed}", arms, settings).items():
            routers[run_key(seed, arm)] = measures
    return bool(pending)


__all__ = ["MEASURES", "measure_routers", "pair_measures", "probe_tasks", "seed_measures"]
