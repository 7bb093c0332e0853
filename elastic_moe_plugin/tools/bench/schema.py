"""The one result format of ``elastic-moe bench --json``, whatever the modes that ran.

A report is a :class:`BenchReport`: what ran (``modes``, ``quick``), where (``environment``), and one
flat list of :class:`BenchRow` objects, one per measured variant of one configuration::

    {"schema": "elastic-moe-bench", "schema_version": 1, "quick": false,
     "modes": ["router", "kappa"], "ok": true,
     "environment": {"torch": "2.13.0+cpu", "megatron_core": "0.19.2", "device": "cpu", "threads": 1, ...},
     "rows": [{"mode": "router", "scenario": "router", "shape": "E=64 k=8 6-10 T=8192 H=2048",
               "variant": "iid", "baseline": "stock",
               "params": {"experts": 64, "topk": 8, "schedule": "6-10", "tokens": 8192, "hidden": 2048},
               "metrics": {"median_ms": 111.8, "min_ms": 110.2, "max_ms": 114.2, "peak_bytes": 137363456, ...},
               "ratios": {"time_ratio": 0.952, "memory_ratio": 1.005, "syncs_added": 0}}, ...]}

- ``mode``: the ``--only`` name that measured the row; ``scenario``: its group within the mode (a
  section of the text table); ``variant``: what was measured (``stock``, ``iid``, ``balanced``;
  ``static``, ``6-10``; ``before``, ``megatron``; ...); ``shape``: the configuration in words.
- ``params``: the configuration's settings as values (scalars), ``metrics``: what was measured
  (scalars, or lists of them: per round, per run); names carry their unit (``_ms``, ``_us``,
  ``_bytes``, ``_s``) where they have one.
- One configuration is one (``mode``, ``scenario``, ``shape``); its rows differ in ``variant``.
  ``baseline``: the variant of the same configuration that ``ratios`` compare with (None for a
  baseline itself or a row that stands alone); ``ratios``: this row against it, quotients
  (``time_ratio``, ``memory_ratio``, ``steps_per_second_ratio``, ...) and differences
  (``syncs_added``, ``added_us``, ...).
- A check (``mcore-cuda``) has the boolean metric ``passed``; ``ok`` is False when any row's
  ``passed`` is False (``elastic-moe bench`` then exits 1).

:func:`validate` checks a report (a parsed ``--json`` output) against this; :data:`JSON_SCHEMA`
is the same as a JSON Schema (draft 2020-12) for other tools. :data:`SCHEMA_VERSION` changes
whenever a field's meaning does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

SCHEMA = "elastic-moe-bench"
SCHEMA_VERSION = 1

Scalar = int | float | str | bool | None
Metric = Scalar | list[Scalar]


class BenchRow(TypedDict):
    """One measured variant of one configuration (the module docstring)."""

    mode: str
    scenario: str
    shape: str
    variant: str
    baseline: str | None
    params: dict[str, Scalar]
    metrics: dict[str, Metric]
    ratios: dict[str, float | int]


class BenchReport(TypedDict):
    """One ``elastic-moe bench --json`` output (the module docstring)."""

    schema: str
    schema_version: int
    quick: bool
    modes: list[str]
    ok: bool
    environment: dict[str, Scalar]
    rows: list[BenchRow]


class SchemaError(ValueError):
    """A report that does not follow the schema; the message names the first offending field."""


def row(
    mode: str,
    scenario: str,
    shape: str,
    variant: str,
    *,
    metrics: Mapping[str, Metric],
    params: Mapping[str, Scalar] | None = None,
    baseline: str | None = None,
    ratios: Mapping[str, float | int] | None = None,
) -> BenchRow:
    """A :class:`BenchRow` (keyword arguments for the optional fields).

    A measurement that came out NaN or infinite (a failed check's error, a ratio over a zero) is
    written as null in ``metrics`` and left out of ``ratios``: the report stays valid JSON, and the
    row still says what ran."""
    return BenchRow(
        mode=mode,
        scenario=scenario,
        shape=shape,
        variant=variant,
        baseline=baseline,
        params=dict(params or {}),
        metrics={name: _finite_or_none(value) for name, value in metrics.items()},
        ratios={name: value for name, value in (ratios or {}).items() if _number(value)},
    )


def _finite_or_none(value: Metric) -> Metric:
    if isinstance(value, list):
        return [None if isinstance(item, float) and not math.isfinite(item) else item for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def report(quick: bool, modes: Iterable[str], environment: Mapping[str, Scalar], rows: list[BenchRow]) -> BenchReport:
    """The report of ``rows`` (``ok`` from their ``passed`` metrics), validated."""
    result = BenchReport(
        schema=SCHEMA,
        schema_version=SCHEMA_VERSION,
        quick=quick,
        modes=list(modes),
        ok=all(r["metrics"].get("passed", True) is not False for r in rows),
        environment=dict(environment),
        rows=rows,
    )
    validate(result)
    return result


# ---------------------------------------------------------------------------------- validation
def _scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)  # NaN and infinities are no JSON values (Python's json writes them anyway)
    return value is None or isinstance(value, int | str | bool)


def _check_mapping(value: Any, where: str, allowed: Any) -> None:
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: expected an object, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise SchemaError(f"{where}: keys are non-empty strings, got {key!r}")
        if not allowed(item):
            raise SchemaError(f"{where}.{key}: {item!r} is not an allowed value")


def _metric(value: Any) -> bool:
    return _scalar(value) or (isinstance(value, list) and all(_scalar(item) for item in value))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


ROW_FIELDS = tuple(BenchRow.__annotations__)
REPORT_FIELDS = tuple(BenchReport.__annotations__)


def validate(value: Any) -> None:
    """Check ``value`` (a parsed ``--json`` output, or :func:`report`'s) against the schema.

    Raises:
        SchemaError: naming the first field that does not follow it.
    """
    if not isinstance(value, dict):
        raise SchemaError(f"report: expected an object, got {type(value).__name__}")
    if sorted(value) != sorted(REPORT_FIELDS):
        raise SchemaError(f"report: fields {sorted(value)}, expected {sorted(REPORT_FIELDS)}")
    if value["schema"] != SCHEMA or value["schema_version"] != SCHEMA_VERSION:
        raise SchemaError(
            f"report: schema {value['schema']!r} version {value['schema_version']!r}, "
            f"expected {SCHEMA!r} version {SCHEMA_VERSION}"
        )
    if not isinstance(value["quick"], bool) or not isinstance(value["ok"], bool):
        raise SchemaError("report: quick and ok are booleans")
    modes = value["modes"]
    if not isinstance(modes, list) or not all(isinstance(mode, str) and mode for mode in modes):
        raise SchemaError(f"report.modes: expected a list of names, got {modes!r}")
    _check_mapping(value["environment"], "report.environment", _scalar)
    if not isinstance(value["rows"], list):
        raise SchemaError("report.rows: expected a list")
    for index, item in enumerate(value["rows"]):
        where = f"report.rows[{index}]"
        if not isinstance(item, dict) or sorted(item) != sorted(ROW_FIELDS):
            found = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise SchemaError(f"{where}: fields {found}, expected {sorted(ROW_FIELDS)}")
        for name in ("mode", "scenario", "shape", "variant"):
            if not isinstance(item[name], str) or (name != "shape" and not item[name]):
                raise SchemaError(f"{where}.{name}: expected a non-empty string, got {item[name]!r}")
        if item["mode"] not in modes:
            raise SchemaError(f"{where}.mode: {item['mode']!r} is not among the report's modes {modes}")
        if item["baseline"] is not None and not isinstance(item["baseline"], str):
            raise SchemaError(f"{where}.baseline: expected a variant name or null, got {item['baseline']!r}")
        _check_mapping(item["params"], f"{where}.params", _scalar)
        _check_mapping(item["metrics"], f"{where}.metrics", _metric)
        _check_mapping(item["ratios"], f"{where}.ratios", _number)
        if item["ratios"] and item["baseline"] is None:
            raise SchemaError(f"{where}.ratios: ratios need the baseline they compare with")
        if "passed" in item["metrics"] and not isinstance(item["metrics"]["passed"], bool):
            raise SchemaError(f"{where}.metrics.passed: a check's outcome is a boolean")
    seen = set()
    for index, item in enumerate(value["rows"]):
        key = (item["mode"], item["scenario"], item["shape"], item["variant"])
        if key in seen:
            raise SchemaError(f"report.rows[{index}]: a second row of mode, scenario, shape and variant {key}")
        seen.add(key)
    for index, item in enumerate(value["rows"]):
        baseline = (item["mode"], item["scenario"], item["shape"], item["baseline"])
        if item["baseline"] is not None and baseline not in seen:
            raise SchemaError(
                f"report.rows[{index}].baseline: no row of variant {item['baseline']!r} "
                "with its mode, scenario and shape"
            )
    failed = any(item["metrics"].get("passed", True) is False for item in value["rows"])
    if value["ok"] == failed:
        raise SchemaError(f"report.ok: {value['ok']} but a row's passed says {not failed}")


_SCALAR_SCHEMA = {"type": ["integer", "number", "string", "boolean", "null"]}
_ROW_SCHEMA = {
    "type": "object",
    "required": list(ROW_FIELDS),
    "additionalProperties": False,
    "properties": {
        "mode": {"type": "string", "minLength": 1},
        "scenario": {"type": "string", "minLength": 1},
        "shape": {"type": "string"},
        "variant": {"type": "string", "minLength": 1},
        "baseline": {"type": ["string", "null"]},
        "params": {"type": "object", "additionalProperties": _SCALAR_SCHEMA},
        "metrics": {
            "type": "object",
            "additionalProperties": {"anyOf": [_SCALAR_SCHEMA, {"type": "array", "items": _SCALAR_SCHEMA}]},
        },
        "ratios": {"type": "object", "additionalProperties": {"type": "number"}},
    },
}
#: the schema as a JSON Schema (draft 2020-12); :func:`validate` checks the cross-field rules too
JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "elastic-moe bench report",
    "type": "object",
    "required": list(REPORT_FIELDS),
    "additionalProperties": False,
    "properties": {
        "schema": {"const": SCHEMA},
        "schema_version": {"const": SCHEMA_VERSION},
        "quick": {"type": "boolean"},
        "modes": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "ok": {"type": "boolean"},
        "environment": {"type": "object", "additionalProperties": _SCALAR_SCHEMA},
        "rows": {"type": "array", "items": _ROW_SCHEMA},
    },
}

__all__ = [
    "JSON_SCHEMA",
    "SCHEMA",
    "SCHEMA_VERSION",
    "BenchReport",
    "BenchRow",
    "Metric",
    "Scalar",
    "SchemaError",
    "report",
    "row",
    "validate",
]
