"""Evaluation suites: YAML files of suite tasks, loaded and validated before anything runs.

A **suite** (``configs/eval/avg9.yaml``, ``configs/eval/pretrain11.yaml`` or any path) lists
**suite tasks**. A suite task is one column of the summary: a name (``GSM8K``), the **harness
task** it reads (an lm-eval task or group, ``gsm8k``), the metric and filter (the **metric key**
``"<metric>,<filter>"`` is the key lm-eval writes into ``results[harness task]``), the shots, and
``why`` each choice was made. Suite tasks with the same ``(harness task, shots)`` share one
harness run (LAMBADA accuracy and perplexity).

Built-in suites are package data (``elastic_moe_plugin/configs/eval/``), found by name. Loading
reads YAML only: no lm-eval, torch or transformers, so the CLI can use it while building its parser.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from elastic_moe_plugin.tools import PACKAGE_CONFIGS_DIR
from elastic_moe_plugin.tools.eval.errors import SuiteError

#: Built-in suites, by name (``--suite avg9``): package data, next to the recipes.
BUILTIN_SUITE_DIR = PACKAGE_CONFIGS_DIR / "eval"


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


def _read_suite_mapping(path: Path, source: str) -> Mapping[str, Any]:
    """The suite file's top-level mapping, with known keys only and a non-empty ``tasks`` list."""
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
    return raw


def _parse_tasks(items: list[Any], source: str) -> tuple[SuiteTask, ...]:
    """Every suite task, with unique names and at least one that enters the average."""
    tasks = tuple(_parse_task(item, i, source) for i, item in enumerate(items))
    names = [task.name for task in tasks]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise SuiteError(
            f"{source}: task names must be unique (they are the summary's columns); repeated: {', '.join(duplicates)}."
        )
    if not any(task.in_average for task in tasks):
        raise SuiteError(f"{source}: no task has in_average: true, so there is nothing to average.")
    return tasks


def _check_options(raw: Mapping[str, Any], source: str) -> None:
    decimals = raw.get("decimals", 2)
    _check_type(source, "decimals", decimals, int, "an integer between 0 and 6")
    if not 0 <= decimals <= 6:
        raise SuiteError(f"{source}: decimals={decimals} is invalid: expected an integer between 0 and 6.")
    for key in ("apply_chat_template", "include_defaults"):
        if key in raw:
            _check_type(source, key, raw[key], bool, "true or false")


def _include_paths(raw: Mapping[str, Any], path: Path, source: str) -> tuple[Path, ...]:
    """``include_path`` (one folder or a list), resolved against the suite file's folder."""
    include = raw.get("include_path") or []
    include = [include] if isinstance(include, str) else include
    if not isinstance(include, list) or not all(isinstance(item, str) for item in include):
        raise SuiteError(f"{source}: include_path must be a folder or a list of folders (relative to the suite file).")
    include_paths = tuple((path.parent / item).resolve() for item in include)
    for folder in include_paths:
        if not folder.is_dir():
            raise SuiteError(f"{source}: include_path folder {str(folder)!r} does not exist.")
    return include_paths


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
    raw = _read_suite_mapping(path, source)
    tasks = _parse_tasks(raw["tasks"], source)
    _check_options(raw, source)
    return Suite(
        name=str(raw["name"]),
        title=str(raw.get("title", raw["name"])),
        tasks=tasks,
        average_label=str(raw.get("average_label", "Average")),
        decimals=raw.get("decimals", 2),
        apply_chat_template=raw.get("apply_chat_template", False),
        include_path=_include_paths(raw, path, source),
        include_defaults=raw.get("include_defaults", True),
        source=path.resolve(),
    )
