"""``elastic-moe eval``: the paper's evaluation suites through lm-evaluation-harness, with an
inference-time top-k override.

Vocabulary, used the same way in the suite YAMLs, the summary files and the code:

- **suite**: a YAML file (``configs/eval/avg9.yaml``, ``configs/eval/pretrain11.yaml`` or any
  path) listing **suite tasks**. A suite task is one column of the summary: a name (``GSM8K``),
  the **harness task** it reads (an lm-eval task or group name, ``gsm8k``), the metric and filter,
  the shots and ``why`` each choice was made. Two suite tasks may read the same harness task at
  the same shots (LAMBADA accuracy and perplexity); it then runs once.
- **metric key**: ``"<metric>,<filter>"``, the key lm-eval writes into ``results[harness task]``.
- **score**: the metric in the summary's units: ×100 for rates (``percent: true``), as is
  otherwise (perplexity).
- **average**: the unweighted mean of the scores of the suite tasks with ``in_average: true``
  that ran. A skipped task (MBPP without ``--allow-code-execution``) turns ``Avg(9)`` into
  ``Avg(8 of 9)`` and the summary says which task is missing and why.

:func:`evaluate_checkpoint` runs in six steps:

1. load and validate the suite (unknown keys, missing ``why``, duplicate names are errors);
2. import lm-eval (the optional ``eval`` extra) and check every harness task name and metric key
   against its task registry, before any weights are loaded;
3. read the checkpoint's config and refuse a model that is not a mixture of experts;
4. build the lm-eval model: ``hf`` loads the model with transformers and wraps it in
   ``lm_eval.models.huggingface.HFLM``; ``vllm`` builds ``VLLM`` with ``hf_overrides``;
5. run the harness tasks through ``lm_eval.simple_evaluate``, one call per number of shots
   (each harness task once), inside :func:`topk_override` when ``topk`` is set;
6. write the harness's raw results (``raw/<shots>shot.json``) and the summary (``summary.json``,
   one-row ``summary.csv``).

Top-k override (``hf`` backend). In transformers 5.x every MoE router reads ``self.top_k`` in
``forward`` (``OlmoeTopKRouter`` and ``Qwen3MoeTopKRouter`` call ``torch.topk(router_probs,
self.top_k)``; about sixty other families set ``self.top_k = config.num_experts_per_tok`` the same
way). :func:`topk_override` sets ``top_k`` on every such module, plus ``config.num_experts_per_tok``
and the ``num_experts_per_tok`` attribute of ``*ForCausalLM`` (read by the auxiliary loss only),
and restores every one of them in ``finally``. Gate weights keep the model's own convention
(OLMoE: softmax over all experts, not renormalised; Qwen3-MoE: renormalised over the chosen k),
so top-k k' evaluates exactly what the model computes when built with ``num_experts_per_tok=k'``.
The ``vllm`` backend gets the same effect from ``hf_overrides={"num_experts_per_tok": k'}``.

Nothing here imports torch, transformers or lm-eval at module import: the CLI imports this module
to build its parser, and lm-eval is optional.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import difflib
import importlib.util
import io
import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from elastic_moe_plugin.compat.inference_topk import (
    TOPK_CONFIG_KEYS,
    NotAMoEError,
    config_num_experts,
    config_topk,
    find_routers,
)
from elastic_moe_plugin.compat.inference_topk import transformers as topk_override
from elastic_moe_plugin.tools import PACKAGE_CONFIGS_DIR

logger = logging.getLogger(__name__)

#: Built-in suites, by name (``--suite avg9``): package data, next to the recipes.
BUILTIN_SUITE_DIR = PACKAGE_CONFIGS_DIR / "eval"
#: What to run when lm-eval is missing.
EVAL_EXTRA_INSTALL = "pip install 'elastic-moe-plugin[eval]'"
SUMMARY_SCHEMA = "elastic-moe-eval-summary/1"
SUMMARY_JSON = "summary.json"
SUMMARY_CSV = "summary.csv"
RAW_DIR = "raw"
SAMPLES_DIR = "samples"
CODE_EXECUTION_WARNING = (
    "WARNING: --allow-code-execution: tasks marked code_execution (MBPP) run model-generated "
    "Python on this machine through lm-eval's code_eval, without a sandbox. Run them in a "
    "container or VM you can throw away."
)
#: Modules that lm-eval tasks import when they load, and the lm-eval extra that provides them
#: (lm-eval 0.4.13). Checked before the model loads, so a missing one fails in seconds.
TASK_REQUIREMENTS: dict[str, tuple[tuple[str, ...], str]] = {
    "ifeval": (("langdetect", "immutabledict", "nltk"), "ifeval"),
    "minerva_math": (("sympy", "math_verify", "antlr4"), "math"),
}


class EvaluationError(Exception):
    """``elastic-moe eval`` cannot run as asked. The message names what failed and the fix."""


class SuiteError(EvaluationError, ValueError):
    """A suite YAML is malformed: unknown key, missing ``why``, bad value."""


class UnknownTaskError(SuiteError):
    """A suite names a harness task, or a metric key, that the installed lm-eval does not have."""


class MissingExtraError(EvaluationError, ImportError):
    """An optional dependency (lm-eval, vllm) is not installed."""


# --------------------------------------------------------------------------------------- suites


@dataclass(frozen=True)
class SuiteTask:
    """One column of the summary: where its score comes from and why.

    Attributes:
        name: column label (``"GSM8K"``, ``"LAMBADA PPL"``); unique within a suite.
        task: lm-eval task or group name (``"gsm8k"``, ``"mmlu"``).
        metric: lm-eval metric name (``"exact_match"``).
        num_fewshot: shots passed to ``simple_evaluate`` (a harness config that pins 0 wins;
            the summary records the shots that ran).
        why: the reason for the task variant, metric, filter and shots.
        filter: lm-eval filter name; the metric key is ``f"{metric},{filter}"``.
        in_average: whether the score enters the suite average (perplexity does not).
        percent: report ``100 × value`` (rates) rather than the value (perplexity).
        higher_is_better: direction, for the table's arrows.
        code_execution: the task executes model-written code; it runs only when allowed.
        n_docs: test-set size the chosen variant implies; a run that scores a different number
            of documents is flagged in the summary.
        paper_metric: the metric as the paper prints it (``"EM"``, ``"Pass@1"``).
    """

    name: str
    task: str
    metric: str
    num_fewshot: int
    why: str
    filter: str = "none"
    in_average: bool = True
    percent: bool = True
    higher_is_better: bool = True
    code_execution: bool = False
    n_docs: int | None = None
    paper_metric: str | None = None

    @property
    def metric_key(self) -> str:
        return f"{self.metric},{self.filter}"

    @property
    def run_key(self) -> tuple[str, int]:
        """Suite tasks with the same run key share one harness run."""
        return (self.task, self.num_fewshot)


@dataclass(frozen=True)
class Suite:
    """A validated suite file. Build it with :func:`load_suite`."""

    name: str
    title: str
    tasks: tuple[SuiteTask, ...]
    average_label: str = "Average"
    decimals: int = 2
    apply_chat_template: bool = False
    include_path: tuple[Path, ...] = ()
    include_defaults: bool = True
    source: Path | None = None

    @property
    def averaged(self) -> tuple[SuiteTask, ...]:
        return tuple(task for task in self.tasks if task.in_average)

    def runs(self) -> dict[tuple[str, int], list[SuiteTask]]:
        """Harness runs in suite order: ``(task, shots) -> the suite tasks that read it``."""
        runs: dict[tuple[str, int], list[SuiteTask]] = {}
        for task in self.tasks:
            runs.setdefault(task.run_key, []).append(task)
        return runs


_SUITE_KEYS = {
    "name",
    "title",
    "average_label",
    "decimals",
    "apply_chat_template",
    "include_path",
    "include_defaults",
    "tasks",
}
_TASK_FIELDS = {f.name: f for f in dataclasses.fields(SuiteTask)}


def builtin_suites() -> list[str]:
    """Names accepted by ``--suite`` besides a path."""
    return sorted(path.stem for path in BUILTIN_SUITE_DIR.glob("*.yaml"))


def resolve_suite_path(spec: str | os.PathLike[str]) -> Path:
    """``"avg9"`` -> ``configs/eval/avg9.yaml``; an existing path is returned as is."""
    path = Path(spec)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise SuiteError(f"suite file {str(path)!r} does not exist.")
        return path
    candidate = BUILTIN_SUITE_DIR / f"{spec}.yaml"
    if candidate.is_file():
        return candidate
    known = builtin_suites()
    hint = difflib.get_close_matches(str(spec), known, n=1)
    raise SuiteError(
        f"--suite {str(spec)!r} is neither a built-in suite nor a YAML file"
        + (f"; did you mean {hint[0]!r}?" if hint else ".")
        + f" Built-in suites ({BUILTIN_SUITE_DIR}): {', '.join(known) or 'none found'}; "
        "or pass a path to a suite YAML."
    )


def _unknown_key(where: str, key: str, allowed: set[str]) -> SuiteError:
    hint = difflib.get_close_matches(key, sorted(allowed), n=1)
    return SuiteError(
        f"{where}: unknown key {key!r}"
        + (f"; did you mean {hint[0]!r}?" if hint else ".")
        + f" Allowed keys: {', '.join(sorted(allowed))}."
    )


def _check_type(where: str, key: str, value: Any, kind: type, expected: str) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SuiteError(f"{where}: {key}={value!r} is invalid: expected {expected}.")


def _parse_task(raw: Any, index: int, source: str) -> SuiteTask:
    where = f"{source}: tasks[{index}]"
    if not isinstance(raw, Mapping):
        raise SuiteError(
            f"{where} is {type(raw).__name__}: expected a mapping with name, task, metric, num_fewshot, why."
        )
    if isinstance(raw.get("name"), str):
        where = f"{where} ({raw['name']})"
    for key in raw:
        if key not in _TASK_FIELDS:
            raise _unknown_key(where, str(key), set(_TASK_FIELDS))
    for key in ("name", "task", "metric", "num_fewshot", "why"):
        if key not in raw:
            raise SuiteError(
                f"{where}: missing required key {key!r} "
                "(each suite task needs name, task, metric, num_fewshot and why)."
            )
    for key in ("name", "task", "metric", "why", "filter"):
        if key in raw:
            _check_type(where, key, raw[key], str, "a non-empty string")
            if not raw[key].strip():
                raise SuiteError(f"{where}: {key} is empty: expected a non-empty string.")
    _check_type(where, "num_fewshot", raw["num_fewshot"], int, "an integer >= 0")
    if raw["num_fewshot"] < 0:
        raise SuiteError(f"{where}: num_fewshot={raw['num_fewshot']} is invalid: expected an integer >= 0.")
    for key in ("in_average", "percent", "higher_is_better", "code_execution"):
        if key in raw:
            _check_type(where, key, raw[key], bool, "true or false")
    if raw.get("n_docs") is not None:
        _check_type(where, "n_docs", raw["n_docs"], int, "a positive integer")
        if raw["n_docs"] < 1:
            raise SuiteError(f"{where}: n_docs={raw['n_docs']} is invalid: expected a positive integer.")
    if raw.get("paper_metric") is not None:
        _check_type(where, "paper_metric", raw["paper_metric"], str, "a string")
    return SuiteTask(**{key: raw[key] for key in raw})


def load_suite(spec: str | os.PathLike[str] | Suite) -> Suite:
    """Load and validate a suite: a built-in name (``"avg9"``, ``"pretrain11"``) or a YAML path.

    ``include_path`` entries (folders of extra lm-eval task YAMLs) are relative to the suite file.

    Raises:
        SuiteError: on a missing file, unknown keys, missing ``why``, duplicate task names, or a
            suite with nothing to average.
    """
    if isinstance(spec, Suite):
        return spec
    path = resolve_suite_path(spec)
    source = str(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise SuiteError(f"{source} is not valid YAML: {error}") from error
    if not isinstance(raw, Mapping):
        raise SuiteError(f"{source}: expected a mapping with name, title and tasks, got {type(raw).__name__}.")
    for key in raw:
        if key not in _SUITE_KEYS:
            raise _unknown_key(source, str(key), _SUITE_KEYS)
    for key in ("name", "tasks"):
        if key not in raw:
            raise SuiteError(f"{source}: missing required key {key!r}.")
    if not isinstance(raw["tasks"], list) or not raw["tasks"]:
        raise SuiteError(f"{source}: tasks must be a non-empty list of suite tasks.")
    tasks = tuple(_parse_task(item, i, source) for i, item in enumerate(raw["tasks"]))
    names = [task.name for task in tasks]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise SuiteError(
            f"{source}: task names must be unique (they are the summary's columns); repeated: {', '.join(duplicates)}."
        )
    if not any(task.in_average for task in tasks):
        raise SuiteError(f"{source}: no task has in_average: true, so there is nothing to average.")
    decimals = raw.get("decimals", 2)
    _check_type(source, "decimals", decimals, int, "an integer between 0 and 6")
    if not 0 <= decimals <= 6:
        raise SuiteError(f"{source}: decimals={decimals} is invalid: expected an integer between 0 and 6.")
    for key in ("apply_chat_template", "include_defaults"):
        if key in raw:
            _check_type(source, key, raw[key], bool, "true or false")
    include = raw.get("include_path") or []
    include = [include] if isinstance(include, str) else include
    if not isinstance(include, list) or not all(isinstance(item, str) for item in include):
        raise SuiteError(f"{source}: include_path must be a folder or a list of folders (relative to the suite file).")
    include_paths = tuple((path.parent / item).resolve() for item in include)
    for folder in include_paths:
        if not folder.is_dir():
            raise SuiteError(f"{source}: include_path folder {str(folder)!r} does not exist.")
    return Suite(
        name=str(raw["name"]),
        title=str(raw.get("title", raw["name"])),
        tasks=tasks,
        average_label=str(raw.get("average_label", "Average")),
        decimals=decimals,
        apply_chat_template=raw.get("apply_chat_template", False),
        include_path=include_paths,
        include_defaults=raw.get("include_defaults", True),
        source=path.resolve(),
    )


# ----------------------------------------------------------------------------------- lm-eval


def require_lm_eval():
    """Import lm-eval or raise :class:`MissingExtraError` naming the install command."""
    try:
        import lm_eval
        from lm_eval import simple_evaluate  # noqa: F401
    except ImportError as error:
        raise MissingExtraError(
            "elastic-moe eval needs lm-evaluation-harness (lm_eval >= 0.4.9), which is not "
            f"installed or failed to import ({error}). Install the eval extra: {EVAL_EXTRA_INSTALL}"
        ) from error
    return lm_eval


def lm_eval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:  # pragma: no cover - an lm_eval importable but not installed
        return "unknown"


def make_task_manager(suite: Suite):
    """lm-eval's ``TaskManager`` over its built-in tasks (unless the suite opts out) and the
    suite's ``include_path`` folders. Indexing reads YAML only; nothing is downloaded."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(
        include_path=[str(path) for path in suite.include_path] or None,
        include_defaults=suite.include_defaults,
    )


def declared_metric_keys(task_manager, name: str) -> set[str] | None:
    """The ``"metric,filter"`` keys a registered task or group declares, or ``None`` if they
    cannot be read from its YAML (Python tasks, tags, metrics computed in code only).

    Leaf tasks: ``metric_list`` × (``filter_list`` names, or ``none``); groups: their
    ``aggregate_metric_list``. This reads lm-eval's task index (``TaskManager.task_index``) and
    YAML loader (``lm_eval.tasks._yaml_loader.load_yaml``), which are not public API; any failure
    there returns ``None`` and the check is skipped rather than blocking the run.
    """
    try:
        from lm_eval.tasks._yaml_loader import load_yaml

        entry = task_manager.task_index.get(name)
        if entry is None or entry.yaml_path is None:
            return None
        cfg = load_yaml(entry.yaml_path, resolve_func=False)
    except Exception as error:  # noqa: BLE001 - introspection of a private API; degrade to no check
        logger.debug("cannot read the metric keys of %s: %s", name, error)
        return None
    if "group" in cfg and not isinstance(cfg.get("task"), str):  # a group lists its tasks
        keys = {
            f"{item['metric']},{item.get('filter_list', 'none')}"
            for item in cfg.get("aggregate_metric_list") or []
            if isinstance(item, Mapping) and "metric" in item
        }
        return keys or None
    metrics = []
    for item in cfg.get("metric_list") or []:
        metric = item.get("metric") if isinstance(item, Mapping) else None
        if isinstance(metric, str):
            # an unresolved `!function utils.pass_at_1` reads as ".../utils.pass_at_1"
            metrics.append(metric.rsplit(".", 1)[-1] if "/" in metric else metric)
    filters = [item["name"] for item in cfg.get("filter_list") or [] if isinstance(item, Mapping) and "name" in item]
    keys = {f"{metric},{flt}" for metric in metrics for flt in (filters or ["none"])}
    return keys or None


def check_suite_tasks(suite: Suite, task_manager) -> None:
    """Every harness task must be registered and declare the metric key the suite reads.

    Raises:
        UnknownTaskError: naming the suite task, the unknown name and the closest registered ones.
    """
    registered = task_manager.task_index
    for task in suite.tasks:
        if task.task not in registered:
            hint = difflib.get_close_matches(task.task, list(registered), n=3, cutoff=0.6)
            raise UnknownTaskError(
                f"{suite.source}: task {task.name!r} names lm-eval task {task.task!r}, which lm-eval "
                f"{lm_eval_version()} does not have"
                + (f"; close matches: {', '.join(hint)}." if hint else ".")
                + " Check the name with `lm-eval ls tasks`, or add the folder that defines it to the "
                "suite's include_path."
            )
        declared = declared_metric_keys(task_manager, task.task)
        if declared is not None and task.metric_key not in declared:
            raise UnknownTaskError(
                f"{suite.source}: task {task.name!r} reads metric key {task.metric_key!r} from lm-eval "
                f"task {task.task!r}, which declares only {', '.join(sorted(declared))}. Fix metric/filter "
                "in the suite."
            )


def check_task_requirements(harness_tasks: Sequence[str]) -> None:
    """Raise :class:`MissingExtraError` if a task's own imports (:data:`TASK_REQUIREMENTS`) are missing."""
    missing: dict[str, list[str]] = {}
    for name in harness_tasks:
        modules, extra = TASK_REQUIREMENTS.get(name, ((), ""))
        absent = [module for module in modules if importlib.util.find_spec(module) is None]
        if absent:
            missing.setdefault(extra, []).extend(f"{module} ({name})" for module in absent)
    if missing:
        extras = ",".join(sorted(missing))
        raise MissingExtraError(
            f"lm-eval tasks in this suite need modules that are not installed: "
            f"{', '.join(m for mods in missing.values() for m in mods)}. "
            f"Install them with: pip install 'lm_eval[{extras}]>=0.4.9'"
        )


# ------------------------------------------------------------------------------ aggregation


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
            records.append(record)
            continue
        run = run_results.get(task.run_key)
        if run is None:
            raise EvaluationError(f"no harness results for task {task.name!r} ({task.task}, {task.num_fewshot}-shot).")
        values = (run.get("results") or {}).get(task.task)
        if values is None or task.metric_key not in values:
            available = sorted(k for k in (values or {}) if "," in k and "_stderr" not in k)
            raise EvaluationError(
                f"lm-eval results for {task.task!r} have no {task.metric_key!r} (suite task {task.name!r}); "
                f"it reported: {', '.join(available) or 'nothing'}. Fix metric/filter in the suite."
            )
        value = values[task.metric_key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise EvaluationError(
                f"lm-eval reported {task.metric_key}={value!r} for {task.task!r}: not a finite number."
            )
        score = 100.0 * value if task.percent else float(value)
        stderr = values.get(task.metric_key.replace(",", "_stderr,", 1))
        record.update(
            status="ok",
            score=score,
            stderr=(100.0 * stderr if task.percent else stderr) if isinstance(stderr, (int, float)) else None,
            n_shot=_shots(run, task.task),
            n_docs=_scored_docs(run, task.task),
        )
        if record["n_shot"] is not None and record["n_shot"] != task.num_fewshot:
            notes.append(
                f"{task.name}: asked for {task.num_fewshot}-shot, the harness ran {record['n_shot']}-shot "
                "(its task config pins the shots)."
            )
        if task.n_docs is not None and record["n_docs"] is not None and record["n_docs"] != task.n_docs:
            why = "--limit" if limit is not None else "a different task version or dataset revision?"
            notes.append(f"{task.name}: scored {record['n_docs']} documents, the suite expects {task.n_docs} ({why}).")
        records.append(record)

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


# ------------------------------------------------------------------------- top-k override


# ----------------------------------------------------------------------------------- running


def _read_config(checkpoint: str, trust_remote_code: bool):
    from transformers import AutoConfig

    path = Path(checkpoint)
    if path.exists() and not (path / "config.json").is_file():
        raise EvaluationError(
            f"{checkpoint} has no config.json: expected a transformers checkpoint folder "
            "(for a Megatron checkpoint, export it to HF format first: `swift export --to_hf true ...`)."
        )
    try:
        return AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise EvaluationError(f"cannot read the model config of {checkpoint!r}: {error}") from error


def check_moe(checkpoint: str, config: Any) -> tuple[str, int]:
    """``(top-k attribute, native top-k)`` of a MoE config.

    Raises:
        NotAMoEError: the config declares no top-k (a dense model).
    """
    found = config_topk(config)
    if found is None:
        raise NotAMoEError(
            f"{checkpoint} is not a mixture-of-experts model: its config "
            f"(model_type={getattr(config, 'model_type', '?')!r}) has none of {', '.join(TOPK_CONFIG_KEYS)}. "
            "elastic-moe eval reports and overrides the routing top-k, so it takes MoE checkpoints only; "
            "evaluate a dense model with lm-eval directly (lm-eval run --model hf ...)."
        )
    return found


def _parse_batch_size(value: str | int) -> int | str:
    if isinstance(value, int):
        return value
    if value.startswith("auto"):
        return value
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"--batch-size {value!r} is invalid: expected a positive integer, 'auto' or 'auto:N'.")
    return size


def _build_hf(checkpoint: str, *, device: str | None, dtype: str, batch_size: int | str, trust_remote_code: bool):
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype: Any = dtype if dtype == "auto" else getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    # Load straight onto the device ("auto": shard over all visible GPUs), never via CPU RAM first.
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        dtype=torch_dtype,
        device_map="auto" if device == "auto" else {"": device},
        trust_remote_code=trust_remote_code,
    ).eval()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return lm, model


def _build_vllm(
    checkpoint: str, *, topk: int | None, topk_key: str, dtype: str, batch_size: int | str, trust_remote_code: bool
):
    if importlib.util.find_spec("vllm") is None:
        raise MissingExtraError(
            "--backend vllm needs vLLM, which is not installed: install it on a CUDA machine "
            "(pip install vllm) or use --backend hf."
        )
    from lm_eval.models.vllm_causallms import VLLM

    extra: dict[str, Any] = {}
    if topk is not None:
        extra["hf_overrides"] = {topk_key: topk}
    return VLLM(pretrained=checkpoint, dtype=dtype, batch_size=batch_size, trust_remote_code=trust_remote_code, **extra)


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _write_call(out_dir: Path, shots: int, result: Mapping[str, Any]) -> None:
    """``raw/<shots>shot.json``: lm-eval's result dict minus samples; ``samples/<leaf>_<shots>shot.jsonl``."""
    from lm_eval.utils import handle_non_serializable

    raw = {key: value for key, value in result.items() if key != "samples"}
    (out_dir / RAW_DIR).mkdir(parents=True, exist_ok=True)
    (out_dir / RAW_DIR / f"{shots}shot.json").write_text(
        json.dumps(raw, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
    )
    for leaf, docs in (result.get("samples") or {}).items():
        (out_dir / SAMPLES_DIR).mkdir(parents=True, exist_ok=True)
        with open(out_dir / SAMPLES_DIR / f"{_slug(leaf)}_{shots}shot.jsonl", "w") as handle:
            handle.writelines(
                json.dumps(doc, default=handle_non_serializable, ensure_ascii=False) + "\n" for doc in docs
            )


def evaluate_checkpoint(
    checkpoint: str | os.PathLike[str],
    suite: str | os.PathLike[str] | Suite,
    *,
    out_dir: str | os.PathLike[str],
    topk: int | None = None,
    limit: float | None = None,
    backend: str = "hf",
    allow_code_execution: bool = False,
    apply_chat_template: bool | None = None,
    batch_size: int | str = 1,
    device: str | None = None,
    dtype: str = "auto",
    name: str | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Evaluate one checkpoint on one suite and write ``summary.json``, ``summary.csv`` and
    ``raw/`` (plus ``samples/`` with ``log_samples``) into ``out_dir``.

    Args:
        checkpoint: a transformers checkpoint folder (or hub id) of a MoE causal LM.
        suite: built-in suite name, suite YAML path, or a :class:`Suite`.
        out_dir: output folder; refused if it already holds a summary, unless ``overwrite``.
        topk: inference-time routing top-k; ``None`` keeps the checkpoint's own.
        limit: lm-eval's ``limit`` (documents per task, or a fraction if < 1); testing only.
        backend: ``"hf"`` (transformers + HFLM) or ``"vllm"``.
        allow_code_execution: run tasks marked ``code_execution`` (MBPP); skipped otherwise.
        apply_chat_template: override the suite's ``apply_chat_template``.
        batch_size, device, dtype, trust_remote_code: passed to the model.
        name: the run's name in tables (default: ``out_dir``'s name).
        log_samples: also write per-document inputs and outputs to ``samples/``.
        bootstrap_iters: lm-eval's stderr bootstrap iterations (0: no stderr).

    Returns:
        The summary dict written to ``summary.json``.

    Raises:
        MissingExtraError, SuiteError, UnknownTaskError, NotAMoEError, EvaluationError,
        ValueError: with the reason and the fix, before any weights load where possible.
    """
    suite = load_suite(suite)
    checkpoint = str(checkpoint)
    out_dir = Path(out_dir)
    if backend not in ("hf", "vllm"):
        raise ValueError(f"--backend {backend!r} is invalid: expected 'hf' or 'vllm'.")
    if topk is not None and (not isinstance(topk, int) or isinstance(topk, bool) or topk < 1):
        raise ValueError(f"--topk {topk!r} is invalid: expected an integer >= 1.")
    if limit is not None and not limit > 0:
        raise ValueError(f"--limit {limit!r} is invalid: expected a number of documents >= 1 or a fraction in (0, 1).")
    batch_size = _parse_batch_size(batch_size)
    if (out_dir / SUMMARY_JSON).exists() and not overwrite:
        raise EvaluationError(f"{out_dir / SUMMARY_JSON} exists; pass --overwrite or choose another --out.")
    chat = suite.apply_chat_template if apply_chat_template is None else apply_chat_template

    require_lm_eval()
    from lm_eval import simple_evaluate

    task_manager = make_task_manager(suite)
    check_suite_tasks(suite, task_manager)

    config = _read_config(checkpoint, trust_remote_code)
    topk_key, topk_native = check_moe(checkpoint, config)
    experts = config_num_experts(config)
    if topk is not None and experts is not None and topk > experts:
        raise ValueError(
            f"--topk {topk} is invalid: {checkpoint} has {experts} experts per layer (expected 1 <= k <= {experts})."
        )

    # One simple_evaluate call per number of shots (it takes one num_fewshot for all its tasks);
    # lm-eval collects environment info (pip, GPUs) once per call, so fewer calls are cheaper.
    skipped: dict[str, str] = {}
    calls: dict[int, list[str]] = {}
    for (harness_task, shots), tasks in suite.runs().items():
        if any(task.code_execution for task in tasks) and not allow_code_execution:
            for task in tasks:
                skipped[task.name] = "executes model-written code; pass --allow-code-execution to run it"
        else:
            calls.setdefault(shots, []).append(harness_task)
    if skipped:
        logger.warning("skipping %s: code execution is not allowed (--allow-code-execution)", ", ".join(skipped))
    check_task_requirements([name for names in calls.values() for name in names])

    if backend == "hf":
        lm, model = _build_hf(
            checkpoint, device=device, dtype=dtype, batch_size=batch_size, trust_remote_code=trust_remote_code
        )
        if topk is not None:
            override = topk_override(model, topk)
        else:
            override = contextlib.nullcontext([])
        routers = len(find_routers(model))
    else:
        lm = _build_vllm(
            checkpoint,
            topk=topk,
            topk_key=topk_key,
            dtype=dtype,
            batch_size=batch_size,
            trust_remote_code=trust_remote_code,
        )
        override = contextlib.nullcontext([])
        routers = None

    out_dir.mkdir(parents=True, exist_ok=True)
    run_results: dict[tuple[str, int], dict[str, Any]] = {}
    with _env("HF_ALLOW_CODE_EVAL", "1" if allow_code_execution else None), override:
        for shots, names in calls.items():
            logger.info("running %s (%d-shot)", ", ".join(names), shots)
            result = simple_evaluate(
                model=lm,
                tasks=names,
                num_fewshot=shots,
                limit=limit,
                task_manager=task_manager,
                log_samples=log_samples,
                bootstrap_iters=bootstrap_iters,
                apply_chat_template=chat,
                fewshot_as_multiturn=chat,
                confirm_run_unsafe_code=allow_code_execution,
            )
            if result is None:
                raise EvaluationError(
                    "lm-eval returned no results (it does so on non-zero ranks); run eval single-process."
                )
            _write_call(out_dir, shots, result)
            run_results.update({(name, shots): result for name in names})

    summary = build_summary(
        suite,
        run_results,
        run=name or out_dir.resolve().name,
        checkpoint=checkpoint,
        backend=backend,
        topk=topk,
        topk_native=topk_native,
        topk_config_key=topk_key,
        routers=routers,
        limit=limit,
        apply_chat_template=chat,
        allow_code_execution=allow_code_execution,
        skipped=skipped,
    )
    write_summary(summary, out_dir)
    return summary


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
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


# ----------------------------------------------------------------------------------- outputs


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
    rows = [("task", "lm-eval task", "metric", "shots", "docs", "score")]
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


# ------------------------------------------------------------------------------------- CLI


def _topk_arg(value: str) -> int:
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is invalid: expected an integer >= 1")
    return k


def _limit_arg(value: str) -> float:
    try:
        limit = float(value)
    except ValueError:
        limit = 0.0
    if not limit > 0:
        raise argparse.ArgumentTypeError(
            f"{value!r} is invalid: expected documents per task (>= 1) or a fraction in (0, 1)"
        )
    return int(limit) if limit >= 1 and limit.is_integer() else limit


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="transformers checkpoint folder (or hub id) of a MoE causal LM")
    parser.add_argument(
        "--suite",
        required=True,
        metavar="avg9|pretrain11|PATH.yaml",
        help="suite to run: a built-in name (configs/eval/) or a suite YAML",
    )
    parser.add_argument(
        "--topk",
        type=_topk_arg,
        default=None,
        metavar="K",
        help="route to the top K experts at inference (default: the checkpoint's own)",
    )
    parser.add_argument(
        "--limit",
        type=_limit_arg,
        default=None,
        metavar="N",
        help="documents per task (or a fraction < 1); for smoke tests only",
    )
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="hf (default) or vllm")
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output folder (default: eval-results/<checkpoint>_<suite>_topk<K|native>)",
    )
    parser.add_argument("--name", default=None, help="run name in eval-table (default: the --out folder's name)")
    parser.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="run tasks that execute model-written code (MBPP); off by default",
    )
    parser.add_argument(
        "--apply-chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="format prompts with the tokenizer's chat template (default: the suite's setting, off)",
    )
    parser.add_argument("--batch-size", default="1", help="per-device batch size, or 'auto' (default: 1)")
    parser.add_argument(
        "--device",
        default=None,
        help="hf backend device: cuda, cuda:1, cpu, or auto to shard over all GPUs "
        "(default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="weights dtype (default: auto, the checkpoint's)",
    )
    parser.add_argument(
        "--log-samples", action="store_true", help="also write every document's prompt and output to samples/"
    )
    parser.add_argument(
        "--bootstrap-iters",
        type=int,
        default=100_000,
        help="lm-eval stderr bootstrap iterations (default: 100000; 0 for none)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing summary in --out")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the checkpoint")


def default_out_dir(checkpoint: str, suite: str, topk: int | None) -> Path:
    ckpt = Path(checkpoint.rstrip("/")).name or "model"
    return Path("eval-results") / f"{ckpt}_{Path(suite).stem}_topk{topk if topk is not None else 'native'}"


def run(args: argparse.Namespace) -> int:
    if args.allow_code_execution:
        print(CODE_EXECUTION_WARNING, file=sys.stderr)
    out_dir = Path(args.out) if args.out else default_out_dir(args.checkpoint, args.suite, args.topk)
    try:
        summary = evaluate_checkpoint(
            args.checkpoint,
            args.suite,
            out_dir=out_dir,
            topk=args.topk,
            limit=args.limit,
            backend=args.backend,
            allow_code_execution=args.allow_code_execution,
            apply_chat_template=args.apply_chat_template,
            batch_size=args.batch_size,
            device=args.device,
            dtype=args.dtype,
            name=args.name,
            log_samples=args.log_samples,
            bootstrap_iters=args.bootstrap_iters,
            overwrite=args.overwrite,
            trust_remote_code=args.trust_remote_code,
        )
    except (EvaluationError, NotAMoEError) as error:
        print(f"elastic-moe {args.command}: error: {error}", file=sys.stderr)
        return 2
    print(format_summary(summary, out_dir))
    return 0
