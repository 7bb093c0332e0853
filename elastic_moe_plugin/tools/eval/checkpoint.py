"""Evaluate one MoE checkpoint on one suite, optionally routed to another top-k at inference.

:func:`evaluate_checkpoint` runs six steps; every check comes before any weights load, and the
cheap ones before lm-eval is imported:

1. :func:`~elastic_moe_plugin.tools.eval.plan.plan_evaluation`, without lm-eval: validate the suite,
   the arguments and the output folder, read the checkpoint's config, refuse a dense model and a
   top-k above the expert count, plan the harness calls, check the tasks' own imports (what
   ``elastic-moe eval --dry-run`` prints);
2. import lm-eval and check every harness task name and metric key against its task registry
   (:func:`_registered_task_manager`);
3. (nothing more to read: the plan holds the checkpoint's top-k);
4. build the lm-eval model and its top-k override (:func:`_build_lm`);
5. run the harness calls inside the override (:func:`_run_harness`), writing each call's raw
   results as it finishes;
6. write ``summary.json`` and ``summary.csv``.

Harness calls: ``simple_evaluate`` takes one ``num_fewshot`` for all its tasks, so there is one call
per number of shots, each harness task once; the output folder gets ``raw/<shots>shot.json`` per
call. The top-k override is :func:`elastic_moe_plugin.tools.inference_topk.transformers` on the
``hf`` backend and ``hf_overrides={<top-k config key>: k}`` on ``vllm``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from elastic_moe_plugin.tools import inference_topk
from elastic_moe_plugin.tools.eval.errors import EvaluationError
from elastic_moe_plugin.tools.eval.harness import (
    build_hf_lm,
    build_vllm_lm,
    check_suite_tasks,
    check_task_requirements,
    make_task_manager,
)

# re-exported (``as``): check_moe and CODE_EXECUTION_SKIPPED moved to .plan (the checks without lm-eval)
from elastic_moe_plugin.tools.eval.plan import CODE_EXECUTION_SKIPPED as CODE_EXECUTION_SKIPPED
from elastic_moe_plugin.tools.eval.plan import check_moe as check_moe
from elastic_moe_plugin.tools.eval.plan import plan_evaluation
from elastic_moe_plugin.tools.eval.suite import Suite
from elastic_moe_plugin.tools.eval.summary import RAW_DIR, SAMPLES_DIR, build_summary, write_summary

logger = logging.getLogger(__name__)

CODE_EXECUTION_WARNING = (
    "WARNING: --allow-code-execution: tasks marked code_execution (MBPP) run model-generated "
    "Python on this machine through lm-eval's code_eval, without a sandbox. Run them in a "
    "container or VM you can throw away."
)


def _registered_task_manager(suite: Suite):
    """lm-eval's task manager for the suite, once every harness task and metric key is known to it."""
    task_manager = make_task_manager(suite)
    check_suite_tasks(suite, task_manager)
    return task_manager


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


def _build_lm(
    backend: str,
    checkpoint: str,
    *,
    topk: int | None,
    topk_key: str,
    device: str | None,
    dtype: str,
    batch_size: int | str,
    trust_remote_code: bool,
) -> tuple[Any, contextlib.AbstractContextManager, int | None]:
    """``(lm-eval model, top-k override to enter around the run, routers found)``; vLLM applies the
    top-k when it builds the model and reports no routers."""
    if backend == "hf":
        lm, model = build_hf_lm(
            checkpoint, device=device, dtype=dtype, batch_size=batch_size, trust_remote_code=trust_remote_code
        )
        override: contextlib.AbstractContextManager[Any] = (
            inference_topk.transformers(model, topk) if topk is not None else contextlib.nullcontext([])
        )
        return lm, override, len(inference_topk.find_routers(model))
    lm = build_vllm_lm(
        checkpoint,
        topk=topk,
        topk_key=topk_key,
        dtype=dtype,
        batch_size=batch_size,
        trust_remote_code=trust_remote_code,
    )
    return lm, contextlib.nullcontext([]), None


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


def _write_raw_results(out_dir: Path, shots: int, result: Mapping[str, Any]) -> None:
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


def _run_harness(
    lm: Any,
    calls: Mapping[int, list[str]],
    out_dir: Path,
    *,
    task_manager: Any,
    limit: float | None,
    log_samples: bool,
    bootstrap_iters: int,
    chat: bool,
    allow_code_execution: bool,
) -> dict[tuple[str, int], dict[str, Any]]:
    """Run every planned call and write its raw results; ``(harness task, shots) -> its call's result``."""
    from lm_eval import simple_evaluate

    run_results: dict[tuple[str, int], dict[str, Any]] = {}
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
        _write_raw_results(out_dir, shots, result)
        run_results.update({(name, shots): result for name in names})
    return run_results


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
    batch_size = _parse_batch_size(batch_size)
    plan = plan_evaluation(
        checkpoint,
        suite,
        out_dir=out_dir,
        topk=topk,
        limit=limit,
        backend=backend,
        allow_code_execution=allow_code_execution,
        apply_chat_template=apply_chat_template,
        overwrite=overwrite,
        trust_remote_code=trust_remote_code,
    )
    suite, checkpoint, out_dir, chat = plan.suite, plan.checkpoint, plan.out_dir, plan.chat
    topk_key, topk_native, calls, skipped = plan.topk_key, plan.topk_native, plan.calls, plan.skipped
    if plan.skipped:
        logger.warning("skipping %s: code execution is not allowed (--allow-code-execution)", ", ".join(plan.skipped))
    task_manager = _registered_task_manager(suite)
    check_task_requirements([harness_task for names in calls.values() for harness_task in names])

    lm, override, routers = _build_lm(
        backend,
        checkpoint,
        topk=topk,
        topk_key=topk_key,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        trust_remote_code=trust_remote_code,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    with _env("HF_ALLOW_CODE_EVAL", "1" if allow_code_execution else None), override:
        run_results = _run_harness(
            lm,
            calls,
            out_dir,
            task_manager=task_manager,
            limit=limit,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,
            chat=chat,
            allow_code_execution=allow_code_execution,
        )

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
