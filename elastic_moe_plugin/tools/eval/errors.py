"""The errors of ``elastic-moe eval`` and ``eval-table``: each message names what failed and the fix.

``EvaluationError`` is the root; the CLI prints any of them as ``elastic-moe eval: error: ...``
and exits 2. ``SuiteError`` and ``MissingExtraError`` also derive from ``ValueError`` and
``ImportError``, so callers that catch those keep working. A dense checkpoint raises
:class:`elastic_moe_plugin.tools.inference_topk.NotAMoEError`, which the top-k override raises too.
"""

from __future__ import annotations


class EvaluationError(Exception):
    """``elastic-moe eval`` cannot run as asked. The message names what failed and the fix."""


class SuiteError(EvaluationError, ValueError):
    """A suite YAML is malformed: unknown key, missing ``why``, bad value."""


class UnknownTaskError(SuiteError):
    """A suite names a harness task, or a metric key, that the installed lm-eval does not have."""


class MissingExtraError(EvaluationError, ImportError):
    """An optional dependency (lm-eval, vllm) is not installed."""
