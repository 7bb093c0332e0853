"""``elastic-moe eval``: the paper's evaluation suites through lm-evaluation-harness, with an
inference-time routing top-k (docs/evaluation.md).

- :mod:`~elastic_moe_plugin.tools.eval.suite`: suite YAMLs (built-in ``avg9``, ``pretrain11``) -> :class:`Suite`;
- :mod:`~elastic_moe_plugin.tools.eval.harness`: lm-eval's import, task-registry checks, model wrappers;
- :mod:`~elastic_moe_plugin.tools.eval.plan`: :func:`plan_evaluation`, every check that needs neither
  lm-eval nor the weights (``--dry-run``, ``--list-tasks``);
- :mod:`~elastic_moe_plugin.tools.eval.checkpoint`: :func:`evaluate_checkpoint`, one run in six steps;
- :mod:`~elastic_moe_plugin.tools.eval.summary`: scores, the suite average, ``summary.json`` / ``.csv``
  and the printed report;
- :mod:`~elastic_moe_plugin.tools.eval.table`: ``eval-table``, the merge of several runs' summaries;
- :mod:`~elastic_moe_plugin.tools.eval.errors`.

The top-k override itself is :func:`elastic_moe_plugin.tools.inference_topk.transformers`. Nothing
here imports torch, transformers or lm-eval at module import: lm-eval is optional.
"""

from elastic_moe_plugin.tools.eval.checkpoint import CODE_EXECUTION_WARNING, check_moe, evaluate_checkpoint
from elastic_moe_plugin.tools.eval.errors import EvaluationError, MissingExtraError, SuiteError, UnknownTaskError
from elastic_moe_plugin.tools.eval.harness import (
    EVAL_EXTRA_INSTALL,
    TASK_REQUIREMENTS,
    check_suite_tasks,
    check_task_requirements,
    declared_metric_keys,
    lm_eval_version,
    make_task_manager,
    require_lm_eval,
)
from elastic_moe_plugin.tools.eval.plan import EvaluationPlan, format_plan, format_suite_tasks, plan_evaluation
from elastic_moe_plugin.tools.eval.suite import (
    BUILTIN_SUITE_DIR,
    Suite,
    SuiteTask,
    builtin_suites,
    load_suite,
    resolve_suite_path,
)
from elastic_moe_plugin.tools.eval.summary import (
    SUMMARY_CSV,
    SUMMARY_JSON,
    SUMMARY_SCHEMA,
    build_summary,
    format_score,
    format_summary,
    summarize,
    summary_csv_row,
    write_summary,
)

__all__ = [
    "BUILTIN_SUITE_DIR",
    "CODE_EXECUTION_WARNING",
    "EVAL_EXTRA_INSTALL",
    "SUMMARY_CSV",
    "SUMMARY_JSON",
    "SUMMARY_SCHEMA",
    "TASK_REQUIREMENTS",
    "EvaluationError",
    "EvaluationPlan",
    "MissingExtraError",
    "Suite",
    "SuiteError",
    "SuiteTask",
    "UnknownTaskError",
    "build_summary",
    "builtin_suites",
    "check_moe",
    "check_suite_tasks",
    "check_task_requirements",
    "declared_metric_keys",
    "evaluate_checkpoint",
    "format_plan",
    "format_score",
    "format_suite_tasks",
    "format_summary",
    "lm_eval_version",
    "load_suite",
    "make_task_manager",
    "plan_evaluation",
    "require_lm_eval",
    "resolve_suite_path",
    "summarize",
    "summary_csv_row",
    "write_summary",
]
