"""lm-evaluation-harness, the optional ``eval`` extra: import it, check a suite against its task
registry, and build its model wrappers.

Every check here runs before any weights load, so a typo in a task name, a metric key the task
does not declare, or a missing task dependency fails in seconds. lm-eval, torch and transformers
are imported inside the functions only: this module imports without them.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from elastic_moe_plugin.tools.eval.errors import MissingExtraError, UnknownTaskError
from elastic_moe_plugin.tools.eval.suite import Suite

logger = logging.getLogger(__name__)

#: What to run when lm-eval is missing.
EVAL_EXTRA_INSTALL = "pip install 'elastic-moe-plugin[eval]'"
#: Modules that lm-eval tasks import when they load, and the lm-eval extra that provides them
#: (lm-eval 0.4.13). Checked before the model loads, so a missing one fails in seconds.
TASK_REQUIREMENTS: dict[str, tuple[tuple[str, ...], str]] = {
    "ifeval": (("langdetect", "immutabledict", "nltk"), "ifeval"),
    "minerva_math": (("sympy", "math_verify", "antlr4"), "math"),
}


def require_lm_eval():
    """Import lm-eval or raise :class:`MissingExtraError` naming the install command."""
    try:
        import lm_eval
        from lm_eval import simple_evaluate  # noqa: F401  (imported to fail here if its entry point does not import)
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
    except Exception as error:
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


def build_hf_lm(checkpoint: str, *, device: str | None, dtype: str, batch_size: int | str, trust_remote_code: bool):
    """``(HFLM, the transformers model it wraps)``; the model is returned for the top-k override."""
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


def build_vllm_lm(
    checkpoint: str, *, topk: int | None, topk_key: str, dtype: str, batch_size: int | str, trust_remote_code: bool
):
    """lm-eval's ``VLLM``; vLLM reads the config once at build time, so ``topk`` goes in as
    ``hf_overrides={topk_key: topk}``."""
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
