"""What an ``elastic-moe eval`` run would do, resolved without lm-eval: ``--dry-run`` and ``--list-tasks``.

:func:`plan_evaluation` runs every check that needs neither lm-evaluation-harness nor the
weights: the suite, the arguments, the output folder, the checkpoint's config (a dense model and a
``--topk`` above the expert count are refused here), the harness calls, one per number of shots,
and the tasks' own imports. :func:`~elastic_moe_plugin.tools.eval.checkpoint.evaluate_checkpoint`
runs it first, so these checks fail in a second, before lm-eval is imported; ``--dry-run`` prints
the plan and stops. Where lm-eval is installed the dry run also checks every harness task and
metric key against its registry (indexing YAML only, nothing is downloaded); where it is not, the
plan says so.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import types
from pathlib import Path
from typing import Any

from elastic_moe_plugin.tools.eval.errors import EvaluationError
from elastic_moe_plugin.tools.eval.harness import EVAL_EXTRA_INSTALL, TASK_REQUIREMENTS
from elastic_moe_plugin.tools.eval.suite import Suite, load_suite
from elastic_moe_plugin.tools.eval.summary import SUMMARY_JSON
from elastic_moe_plugin.tools.inference_topk import TOPK_CONFIG_KEYS, NotAMoEError, config_num_experts, config_topk

logger = logging.getLogger(__name__)

#: Why a code-executing task did not run (``summary.json``'s ``skipped``).
CODE_EXECUTION_SKIPPED = "executes model-written code; pass --allow-code-execution to run it"


@dataclasses.dataclass(frozen=True)
class EvaluationPlan:
    """One evaluation run, resolved: what :func:`~elastic_moe_plugin.tools.eval.checkpoint.evaluate_checkpoint`
    will run, without having imported lm-eval or loaded any weights.

    Attributes:
        calls: shots -> the harness tasks of that ``simple_evaluate`` call, in suite order.
        skipped: suite task -> why it does not run.
        topk_key / topk_native: the checkpoint's top-k config attribute and its value.
        num_experts: routed experts per layer, where the config says.
        missing_modules: modules the planned tasks import that are not installed (task -> modules).
    """

    suite: Suite
    checkpoint: str
    out_dir: Path
    topk: int | None
    topk_key: str
    topk_native: int
    num_experts: int | None
    model_type: str | None
    calls: dict[int, list[str]]
    skipped: dict[str, str]
    chat: bool
    missing_modules: dict[str, list[str]]


def read_checkpoint_config(checkpoint: str, trust_remote_code: bool = False) -> Any:
    """The checkpoint's model config: transformers' ``AutoConfig`` where transformers imports (its class
    defaults included), else the local ``config.json`` as attributes (a dry run without transformers).

    Raises:
        EvaluationError: no config.json in a local folder, or a config that cannot be read.
    """
    path = Path(checkpoint)
    if path.exists() and not (path / "config.json").is_file():
        raise EvaluationError(
            f"{checkpoint} has no config.json: expected a transformers checkpoint folder "
            "(for a Megatron checkpoint, export it to HF format first: `swift export --to_hf true ...`)."
        )
    if not _importable("transformers"):
        if not path.is_dir():
            raise EvaluationError(
                f"cannot read the model config of {checkpoint!r}: it is no local folder, and "
                "transformers (which reads hub ids) is not installed."
            )
        try:
            return json.loads((path / "config.json").read_text(), object_hook=lambda d: types.SimpleNamespace(**d))
        except ValueError as error:
            raise EvaluationError(f"cannot read the model config of {checkpoint!r}: {error}") from error
    from transformers import AutoConfig

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


def check_arguments(*, backend: str, topk: int | None, limit: float | None) -> None:
    if backend not in ("hf", "vllm"):
        raise ValueError(f"--backend {backend!r} is invalid: expected 'hf' or 'vllm'.")
    if topk is not None and (not isinstance(topk, int) or isinstance(topk, bool) or topk < 1):
        raise ValueError(f"--topk {topk!r} is invalid: expected an integer >= 1.")
    if limit is not None and not limit > 0:
        raise ValueError(f"--limit {limit!r} is invalid: expected a number of documents >= 1 or a fraction in (0, 1).")


def plan_harness_calls(suite: Suite, allow_code_execution: bool) -> tuple[dict[int, list[str]], dict[str, str]]:
    """``(shots -> harness tasks of that call, skipped suite task -> reason)``, in suite order.

    One call per number of shots rather than per task: lm-eval collects environment info (pip,
    GPUs) once per call, so fewer calls are cheaper.
    """
    skipped: dict[str, str] = {}
    calls: dict[int, list[str]] = {}
    for (harness_task, shots), tasks in suite.runs().items():
        if any(task.code_execution for task in tasks) and not allow_code_execution:
            for task in tasks:
                skipped[task.name] = CODE_EXECUTION_SKIPPED
        else:
            calls.setdefault(shots, []).append(harness_task)
    return calls, skipped


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder that refuses it; a module left as None in sys.modules
        return False


def missing_task_modules(harness_tasks: list[str]) -> dict[str, list[str]]:
    """Harness task -> the modules it imports (:data:`TASK_REQUIREMENTS`) that are not installed."""
    missing = {}
    for name in harness_tasks:
        modules, _ = TASK_REQUIREMENTS.get(name, ((), ""))
        absent = [module for module in modules if not _importable(module)]
        if absent:
            missing[name] = absent
    return missing


def plan_evaluation(
    checkpoint: str | os.PathLike[str],
    suite: str | os.PathLike[str] | Suite,
    *,
    out_dir: str | os.PathLike[str],
    topk: int | None = None,
    limit: float | None = None,
    backend: str = "hf",
    allow_code_execution: bool = False,
    apply_chat_template: bool | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> EvaluationPlan:
    """Every check of an evaluation run that needs neither lm-eval nor the weights (module docstring).

    Raises:
        SuiteError, NotAMoEError, EvaluationError, ValueError: with the reason and the fix.
    """
    suite = load_suite(suite)
    checkpoint = str(checkpoint)
    out_dir = Path(out_dir)
    check_arguments(backend=backend, topk=topk, limit=limit)
    if (out_dir / SUMMARY_JSON).exists() and not overwrite:
        raise EvaluationError(f"{out_dir / SUMMARY_JSON} exists; pass --overwrite or choose another --out.")
    config = read_checkpoint_config(checkpoint, trust_remote_code)
    topk_key, topk_native = check_moe(checkpoint, config)
    experts = config_num_experts(config)
    if topk is not None and experts is not None and topk > experts:
        raise ValueError(
            f"--topk {topk} is invalid: {checkpoint} has {experts} experts per layer (expected 1 <= k <= {experts})."
        )
    calls, skipped = plan_harness_calls(suite, allow_code_execution)
    missing = missing_task_modules([name for names in calls.values() for name in names])
    return EvaluationPlan(
        suite=suite,
        checkpoint=checkpoint,
        out_dir=out_dir,
        topk=topk,
        topk_key=topk_key,
        topk_native=topk_native,
        num_experts=experts,
        model_type=getattr(config, "model_type", None),
        calls=calls,
        skipped=skipped,
        chat=suite.apply_chat_template if apply_chat_template is None else apply_chat_template,
        missing_modules=missing,
    )


def registry_check(plan: EvaluationPlan) -> str:
    """Check the plan's harness tasks and metric keys against lm-eval's registry where lm-eval is
    installed; a line saying what was checked.

    Raises:
        UnknownTaskError: a task or metric key the installed lm-eval does not have.
    """
    from elastic_moe_plugin.tools.eval.harness import check_suite_tasks, lm_eval_version, make_task_manager

    if not _importable("lm_eval"):
        return (
            f"lm-eval is not installed: task names and metric keys are not checked against its registry "
            f"(install it to run: {EVAL_EXTRA_INSTALL})"
        )
    check_suite_tasks(plan.suite, make_task_manager(plan.suite))
    return f"every harness task and metric key is registered in lm-eval {lm_eval_version()}"


def format_suite_tasks(suite: Suite) -> str:
    """The suite's tasks: column, harness task, shots, metric key, whether averaged, notes."""
    rows = [("column", "harness task", "shots", "metric key", "average", "notes")]
    for task in suite.tasks:
        notes = ", ".join(
            note
            for note in (
                "runs model-written code (--allow-code-execution)" if task.code_execution else "",
                f"{task.n_docs} docs" if task.n_docs else "",
                f"paper: {task.paper_metric}" if task.paper_metric else "",
            )
            if note
        )
        rows.append(
            (task.name, task.task, str(task.num_fewshot), task.metric_key, "yes" if task.in_average else "no", notes)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [
        f"suite {suite.name}: {suite.title} ({len(suite.tasks)} tasks, {suite.average_label} over "
        f"{len(suite.averaged)}; {suite.source})"
    ]
    lines += [
        "  "
        + "  ".join(cell.ljust(width) for cell, width in zip(row[:5], widths, strict=True))
        + f"  {row[5]}".rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def format_plan(plan: EvaluationPlan, registry: str) -> str:
    """What the run would do, for ``--dry-run``."""
    topk = (
        f"--topk {plan.topk} (the checkpoint routes to top-{plan.topk_native})"
        if plan.topk is not None
        else f"the checkpoint's own top-{plan.topk_native}"
    )
    experts = f" of {plan.num_experts} experts" if plan.num_experts is not None else ""
    lines = [
        "dry run: nothing is evaluated and no weights are loaded",
        f"checkpoint {plan.checkpoint} (model_type={plan.model_type!r}, {plan.topk_key}={plan.topk_native}{experts}); "
        f"routing at inference: {topk}",
        f"chat template: {'on' if plan.chat else 'off'}; output folder: {plan.out_dir}",
        format_suite_tasks(plan.suite),
        f"harness calls ({len(plan.calls)}):",
    ]
    lines += [f"  {shots}-shot: {', '.join(names)}" for shots, names in plan.calls.items()]
    lines += [f"  skipped {name}: {reason}" for name, reason in plan.skipped.items()]
    for task, modules in plan.missing_modules.items():
        extra = TASK_REQUIREMENTS[task][1]
        lines.append(f"  missing for {task}: {', '.join(modules)} (pip install 'lm_eval[{extra}]>=0.4.9')")
    lines.append(registry)
    return "\n".join(lines)


__all__ = [
    "CODE_EXECUTION_SKIPPED",
    "EvaluationPlan",
    "check_arguments",
    "check_moe",
    "format_plan",
    "format_suite_tasks",
    "missing_task_modules",
    "plan_evaluation",
    "plan_harness_calls",
    "read_checkpoint_config",
    "registry_check",
]
