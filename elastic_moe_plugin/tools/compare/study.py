"""A paired static-vs-elastic study on the demo's tiny Megatron-core GPT: the plan, the runs, the results file.

Every arm (``static`` and one or more elastic schedules) trains once per seed, each run exactly as
``elastic-moe demo`` trains (:func:`elastic_moe_plugin.tools.demo.train.train_run`): the seed
sets the initialisation, the batch order and κ's stream, the corpus is the same for every seed
(its own fixed seed), so the runs of one seed differ only by their routing schedule.

The results file (``results.json``, format :data:`FORMAT`) holds the plan and one entry per
finished run (each run's checkpoint lies in ``seed<s>/<arm>.pt`` beside a demo ``model_config.json``,
for ``elastic-moe diagnose``), written after every run (atomically: a temporary file renamed over it). A study
started again with the same plan on the same file skips the runs already there (an interrupted
study resumes where it stopped); another plan on that file is an error naming what differs.

What a run keeps (:func:`measurements`): the held-out loss at k, the held-out loss at each k' of
the inference sweep (k−2..k+2), the held-out loss per task of the synthetic mixture, the
tokens-per-expert imbalance (max/mean over the last quarter of training), the final training loss
and the training curve (loss per step, held-out loss at the evaluation points).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.tools.demo.settings import DemoSettings

FORMAT = "elastic-moe-compare/1"
STATIC = "static"


@dataclasses.dataclass(frozen=True)
class StudyPlan:
    """What a study trains: ``arms`` (``static`` first, then elastic schedules around the model's
    top-k), ``seeds``, and the demo settings of every run (``schedule`` and ``seed`` are set per run)."""

    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    settings: DemoSettings

    def __post_init__(self) -> None:
        if not self.arms or self.arms[0] != STATIC or len(set(self.arms)) != len(self.arms):
            raise ConfigError(
                f"arms={','.join(self.arms)!r}: a study pairs every elastic schedule with the static arm; "
                f"expected 'static' first, then distinct schedules, e.g. --arms static,2-6,3-5."
            )
        if len(self.arms) < 2:
            raise ConfigError("arms='static': nothing to compare; add an elastic schedule, e.g. --arms static,2-6.")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds={list(self.seeds)}: expected distinct seeds, e.g. --seeds 8.")

    def to_dict(self) -> dict[str, Any]:
        settings = {k: v for k, v in dataclasses.asdict(self.settings).items() if k not in ("schedule", "seed")}
        return {"arms": list(self.arms), "seeds": list(self.seeds), "settings": settings}

    def runs(self) -> list[tuple[int, str]]:
        """Every (seed, arm), seed by seed, so a study stopped early holds complete pairs."""
        return [(seed, arm) for seed in self.seeds for arm in self.arms]


def measurements(result: dict[str, Any], settings: DemoSettings) -> dict[str, Any]:
    """What the study keeps of one demo run's result (module docstring)."""
    per_layer = list((result.get("imbalance") or {}).get("train", {}).values())
    return {
        "heldout_loss": result["heldout_loss"],
        "topk_sweep": result["topk_sweep"],
        "task_losses": result.get("task_losses", {}),
        "imbalance": sum(per_layer) / len(per_layer) if per_layer else None,
        "final_train_loss": result["final_train_loss"],
        "history": result["history"],
        "topk": settings.topk,
        "train_time_s": result.get("train_time_s"),
    }


def load_results(path: Path, plan: StudyPlan) -> dict[str, Any]:
    """The results file at ``path`` for ``plan`` (a new one if absent).

    Raises:
        ConfigError: the file holds another plan, or is not a study's results.
    """
    planned = plan.to_dict()
    fresh: dict[str, Any] = {"format": FORMAT, "source": "demo", "plan": planned, "runs": {}}
    if not path.exists():
        return fresh
    data = read_results(path)
    if data.get("source") == "eval":
        raise ConfigError(f"{path} holds a study read with --from-eval; write this one elsewhere with --out.")
    if data["plan"] != planned:
        differing = sorted(key for key in planned if data["plan"].get(key) != planned[key])
        raise ConfigError(
            f"{path} holds another study (its {', '.join(differing)} differ): resume it with the same flags, "
            f"or write this one elsewhere with --out."
        )
    return data


def read_results(path: Path) -> dict[str, Any]:
    """A study's results file as it is (any plan); a plan written before a demo setting existed
    reads as that setting's default (the runs were trained with it).

    Raises:
        ConfigError: the file is missing or not a study's results.
    """
    if not path.is_file():
        raise ConfigError(f"{path}: no results of elastic-moe compare there; run the study first (without --report).")
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ConfigError(f"{path}: not the results of elastic-moe compare (format {data.get('format')!r}).")
    if data.get("source", "demo") == "demo":
        defaults = {k: v for k, v in dataclasses.asdict(DemoSettings()).items() if k not in ("schedule", "seed")}
        data["plan"]["settings"] = {**defaults, **data["plan"]["settings"]}
    return data


def save_results(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a run interrupted mid-write leaves the previous file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(data, indent=1))
    os.replace(partial, path)


def run_key(seed: int, arm: str) -> str:
    return f"{arm}/seed{seed}"


def run_study(
    plan: StudyPlan, out: Path, log: Callable[[str], None] = print, train: Callable[..., dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Train every (seed, arm) of ``plan`` not yet in ``out/results.json``, saving after each run;
    returns the results. ``train(settings, folder)`` trains one run (default: :func:`train_one`) and
    keeps its checkpoint in ``folder`` (``out/seed<s>``)."""
    path = out / "results.json"
    data = load_results(path, plan)
    pending = [(seed, arm) for seed, arm in plan.runs() if run_key(seed, arm) not in data["runs"]]
    if len(pending) < len(plan.runs()):
        log(f"elastic-moe compare: resuming {path}: {len(plan.runs()) - len(pending)} of {len(plan.runs())} runs done")
    train = train or train_one
    for index, (seed, arm) in enumerate(pending, 1):
        settings = dataclasses.replace(plan.settings, seed=seed, schedule=arm)
        log(f"elastic-moe compare: run {index}/{len(pending)}: {arm}, seed {seed}")
        data["runs"][run_key(seed, arm)] = {"arm": arm, "seed": seed, **train(settings, out / f"seed{seed}")}
        save_results(path, data)
    return data


def train_one(settings: DemoSettings, folder: Path) -> dict[str, Any]:
    """One demo run of ``settings`` (its schedule and seed) in a fresh model-parallel state; its
    checkpoint goes to ``folder/<arm>.pt`` beside a demo ``model_config.json`` naming every arm
    trained there so far, so that ``elastic-moe diagnose`` reads a seed's folder as a demo's."""
    import torch

    from elastic_moe_plugin.core.config import ElasticConfig
    from elastic_moe_plugin.tools.demo.corpus import synthetic_corpus
    from elastic_moe_plugin.tools.demo.model import model_config
    from elastic_moe_plugin.tools.demo.report import model_config_file
    from elastic_moe_plugin.tools.demo.train import train_runs

    corpus = synthetic_corpus(settings)
    config = model_config(settings, corpus.vocab_size)
    elastic = ElasticConfig(schedule=settings.schedule, sigma=settings.sigma, layers=settings.layers)
    results, states, version = train_runs({settings.schedule: elastic}, settings, corpus, config)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(states[settings.schedule], folder / f"{settings.schedule}.pt")
    config_path = folder / "model_config.json"
    trained = json.loads(config_path.read_text())["runs"] if config_path.exists() else {}
    described = model_config_file(config, settings, corpus, results, version)
    described["runs"] = {**trained, **described["runs"]}
    config_path.write_text(json.dumps(described, indent=1))
    return measurements(results[settings.schedule], settings)


def arm_values(data: dict[str, Any], arm: str, read: Callable[[dict[str, Any]], float | None]) -> dict[int, float]:
    """{seed: read(run)} of one arm's finished runs (runs where ``read`` gives None left out)."""
    values: dict[int, float] = {}
    for run in data["runs"].values():
        if run["arm"] == arm:
            value = read(run)
            if value is not None:
                values[int(run["seed"])] = float(value)
    return values


def complete_seeds(data: dict[str, Any], arms: Iterable[str]) -> list[int]:
    """The seeds whose runs of every one of ``arms`` are finished."""
    seeds = [{int(run["seed"]) for run in data["runs"].values() if run["arm"] == arm} for arm in arms]
    return sorted(set.intersection(*seeds)) if seeds else []


__all__ = [
    "FORMAT",
    "STATIC",
    "StudyPlan",
    "arm_values",
    "complete_seeds",
    "load_results",
    "measurements",
    "read_results",
    "run_key",
    "run_study",
    "save_results",
    "train_one",
]
