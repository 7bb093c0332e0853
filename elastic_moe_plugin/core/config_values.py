"""The values an :class:`~elastic_moe_plugin.core.config.ElasticConfig` field accepts, written once for
the checks (:mod:`.config_checks`) and the text readers (:mod:`.config_sources`): the choices, the
words that stand for a value, and the grammar of a ``layers`` spec (``"3-7"``, ``"0,2,5-7"``).
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.spelling import PYTHON, Spelling

GateConvention = Literal["auto", "full_softmax", "renormalized"]
GATE_CHOICES: tuple[str, ...] = ("auto", "full_softmax", "renormalized")
ROUTER_MODES: tuple[str, ...] = ("elastic", "top_p")

#: the schedule resolved from the model: k-2..k+2 around its top-k, kept symmetric, budgets in 1..E
AUTO_SCHEDULE = "auto"
#: half-width of :data:`AUTO_SCHEDULE`: the paper's best range, 6-10, is ±2 around top-8
AUTO_HALF_WIDTH = 2
#: the ``layers`` word for every MoE layer (as leaving it unset)
ALL_LAYERS = "all"
BOOLEAN_FIELDS = ("enabled", "allow_off_center", "allow_uncovered_routers")

LogMetrics = Literal["layers", "means", "off"]
#: what a logging step writes of the routing metrics: every layer's values and the layer means
#: (where the framework logs per layer), the layer means only, or nothing (no hook installed)
LOG_METRICS_CHOICES: tuple[str, ...] = ("layers", "means", "off")
DEFAULT_LOG_METRICS: LogMetrics = "layers"
#: ``log_metrics`` written as a boolean, the Megatron-LM entry point's old ``--elastic-moe-log-metrics
#: true|false``: true is the per-layer layout it always logged, false nothing
LOG_METRICS_BOOLEANS: dict[bool, LogMetrics] = {True: "layers", False: "off"}

_LAYER_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


class LayerProblem(NamedTuple):
    """Why a ``layers`` spec does not parse: ``kind`` is ``"empty"``, ``"malformed"`` or ``"reversed"``;
    ``repaired`` the spec with a reversed item turned round (``"reversed"`` only)."""

    kind: str
    item: str = ""
    repaired: str | None = None


def parse_layer_items(spec: str) -> frozenset[int] | LayerProblem:
    """The selected 0-based layers, or why the spec does not parse."""
    if not isinstance(spec, str) or not spec.strip():
        return LayerProblem("empty")
    layers: set[int] = set()
    items = spec.replace(" ", "").split(",")
    for position, item in enumerate(items):
        match = _LAYER_ITEM.match(item)
        if not match:
            return LayerProblem("malformed", item)
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            repaired = ",".join(f"{last}-{first}" if i == position else other for i, other in enumerate(items))
            return LayerProblem("reversed", item, repaired)
        layers.update(range(first, last + 1))
    return frozenset(layers)


def layer_problem_text(setting: str, problem: LayerProblem) -> str:
    """What is wrong with the spec of ``setting`` (as the user wrote it), without a fix."""
    if problem.kind == "empty":
        return (
            f"{setting} is empty: expected 0-based decoder-layer indices such as 3-7 or 0,2,5-7, or "
            f"{ALL_LAYERS!r} for every MoE layer"
        )
    if problem.kind == "malformed":
        return (
            f"{setting} is malformed at {problem.item!r}: expected comma-separated 0-based decoder-layer "
            f"indices or ranges such as 3-7 or 0,2,5-7"
        )
    return f"{setting} has a reversed range {problem.item!r}"


def layers_text(indices: list[int]) -> str:
    """0-based indices as a ``layers`` spec: ``[3, 4, 5, 7]`` -> ``"3-5,7"``."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_layers(spec: str, spelling: Spelling = PYTHON, name: str = "layers") -> frozenset[int]:
    """Parse a 0-based decoder-layer selection: ``"3-7"``, ``"0,2,5-7"`` or ``"4"``.

    Indices are 0-based as in the paper's L0-L15 (Megatron's ``layer_number`` is 1-based).
    ``spelling`` and ``name``: how the message writes the setting (default ``layers='...'``).

    Raises:
        ConfigError: on an empty item, a reversed range or anything but digits, ',' and '-'.
    """
    parsed = parse_layer_items(spec)
    if not isinstance(parsed, LayerProblem):
        return parsed
    setting = spelling.current(name, spec)
    if parsed.kind == "reversed":
        raise ConfigError(
            f"{layer_problem_text(setting, parsed)}: write it as {spelling.setting(name, parsed.repaired)}.",
            fixes=({name: parsed.repaired},),
        )
    raise ConfigError(layer_problem_text(setting, parsed) + ".")


def log_layout(log_metrics: LogMetrics | None, framework_per_layer: bool = True) -> LogMetrics:
    """What a logging step writes: ``"layers"`` (every layer's values and the layer means), ``"means"``
    or ``"off"``, for ``ElasticConfig.log_metrics`` (None: :data:`DEFAULT_LOG_METRICS`) and the
    framework's own per-layer switch (Megatron's ``moe_per_layer_logging``; transformers has none, so
    True): ``layers`` logs per layer only where that switch is on, ``means`` never does."""
    chosen = DEFAULT_LOG_METRICS if log_metrics is None else log_metrics
    return "means" if chosen == "layers" and not framework_per_layer else chosen
