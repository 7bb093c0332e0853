"""``ElasticConfig``: the one validated source of truth for the plugin's settings.

Every entry point maps onto this dataclass and validates the same way:

- Python: ``ElasticConfig(schedule="6-10", layers="3-7")``, or ``ElasticConfig.from_dict(values, model=...)``;
- YAML: ``ElasticConfig.from_yaml(path)`` (safe loading; unknown keys are errors);
- environment: ``ElasticConfig.from_env()`` reads ``ELASTIC_MOE_*`` (see ``ENV_VARS``), with
  ``ELASTIC_MOE_CONFIG`` naming a YAML file whose values the other variables override;
- CLI flags: ``--elastic-moe-<field>`` (see :func:`add_cli_arguments`).

Text (environment, flags, YAML strings) is read by one rule, :func:`parse_text`: the same words
mean the same everywhere (``auto``, ``all``, ``1``/``0``/``true``/``false``/...). A refused setting
raises :class:`ConfigError` naming the setting as it was written (:mod:`.spelling`), what is
accepted, and the fixes in the same form; every fix is validated before it is printed: against
the model when the entry point knows it (``model=ModelShape(...)`` on the loaders, or
:meth:`ElasticConfig.resolve`), else against what can be checked without it.

Nothing here imports a training framework; model-dependent checks (top-k, expert and layer
counts) happen in :meth:`ElasticConfig.resolve` when an adapter meets a model, or at construction
when a loader is given the model's :class:`ModelShape`.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, NamedTuple

from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.schedule import SAMPLING_MODES, BudgetSchedule, parse_range, symmetric_range
from elastic_moe_plugin.core.spelling import CLI_PREFIX, ENV_PREFIX, NONE_WORDS, PYTHON, Spelling

GateConvention = Literal["auto", "full_softmax", "renormalized"]
GATE_CHOICES: tuple[str, ...] = ("auto", "full_softmax", "renormalized")
ROUTER_MODES: tuple[str, ...] = ("elastic", "top_p")

#: the schedule resolved from the model: k-2..k+2 around its top-k, kept symmetric, budgets in 1..E
AUTO_SCHEDULE = "auto"
#: half-width of :data:`AUTO_SCHEDULE`: the paper's best range, 6-10, is ±2 around top-8
AUTO_HALF_WIDTH = 2
#: the ``layers`` word for every MoE layer (as leaving it unset)
ALL_LAYERS = "all"

ENV_CONFIG_FILE = "ELASTIC_MOE_CONFIG"
#: ``ELASTIC_MOE_*`` variables that steer the adapters, not the routing; not ElasticConfig fields
OPERATIONAL_ENV_VARS: frozenset[str] = frozenset({
    "ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE",         # try an untested megatron-core
    "ELASTIC_MOE_ALLOW_UNSUPPORTED_TRANSFORMERS",  # try an untested transformers
    "ELASTIC_MOE_DEBUG",                           # assert dispatcher invariants (syncs)
    "ELASTIC_MOE_SWIFT_HOOK",                      # 0: the ms-swift --plugin start-up hook stands aside
})

_LAYER_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
_BOOLEAN_FIELDS = ("enabled", "allow_off_center")


class ModelShape(NamedTuple):
    """What a config is checked against: a router's top-k, its routed experts and the model's
    decoder layers (``None``: not known)."""

    topk: int
    num_experts: int | None = None
    num_layers: int | None = None

    def describe(self) -> str:
        experts = f" of {self.num_experts} experts" if self.num_experts is not None else ""
        return f"top-{self.topk}{experts}"


class _Build(NamedTuple):
    """The config being built: how each field was written, which fields the user set, the model
    when the entry point knows it, and whether suggested fixes are validated (not while validating one)."""

    spellings: Mapping[str, Spelling]
    explicit: frozenset[str]
    model: ModelShape | None = None
    check_fixes: bool = True


_BUILD: contextvars.ContextVar[_Build | None] = contextvars.ContextVar("elastic_moe_config_build", default=None)


@contextlib.contextmanager
def _building(build: _Build) -> Iterator[None]:
    token = _BUILD.set(build)
    try:
        yield
    finally:
        _BUILD.reset(token)


# ---------------------------------------------------------------------------------- layers
class _LayerProblem(NamedTuple):
    """Why a ``layers`` spec does not parse: ``kind`` is ``"empty"``, ``"malformed"`` or ``"reversed"``;
    ``repaired`` the spec with a reversed item turned round (``"reversed"`` only)."""

    kind: str
    item: str = ""
    repaired: str | None = None


def _parse_layer_items(spec: str) -> tuple[frozenset[int] | None, _LayerProblem | None]:
    if not isinstance(spec, str) or not spec.strip():
        return None, _LayerProblem("empty")
    layers: set[int] = set()
    items = spec.replace(" ", "").split(",")
    for position, item in enumerate(items):
        match = _LAYER_ITEM.match(item)
        if not match:
            return None, _LayerProblem("malformed", item)
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            repaired = ",".join(f"{last}-{first}" if i == position else other for i, other in enumerate(items))
            return None, _LayerProblem("reversed", item, repaired)
        layers.update(range(first, last + 1))
    return frozenset(layers), None


def _layer_problem_text(setting: str, problem: _LayerProblem) -> str:
    if problem.kind == "empty":
        return (f"{setting} is empty: expected 0-based decoder-layer indices such as 3-7 or 0,2,5-7, or "
                f"{ALL_LAYERS!r} for every MoE layer")
    if problem.kind == "malformed":
        return (f"{setting} is malformed at {problem.item!r}: expected comma-separated 0-based decoder-layer "
                f"indices or ranges such as 3-7 or 0,2,5-7")
    return f"{setting} has a reversed range {problem.item!r}"


def parse_layers(spec: str, spelling: Spelling = PYTHON, name: str = "layers") -> frozenset[int]:
    """Parse a 0-based decoder-layer selection: ``"3-7"``, ``"0,2,5-7"`` or ``"4"``.

    Indices are 0-based as in the paper's L0-L15 (Megatron's ``layer_number`` is 1-based).
    ``spelling`` and ``name``: how the message writes the setting (default ``layers='...'``).

    Raises:
        ConfigError: on an empty item, a reversed range or anything but digits, ',' and '-'.
    """
    layers, problem = _parse_layer_items(spec)
    if problem is None:
        return layers
    setting = spelling.current(name, spec)
    if problem.kind == "reversed":
        raise ConfigError(f"{_layer_problem_text(setting, problem)}: write it as "
                          f"{spelling.setting(name, problem.repaired)}.", fixes=({name: problem.repaired},))
    raise ConfigError(_layer_problem_text(setting, problem) + ".")


# ---------------------------------------------------------------------------------- text
def parse_text(name: str, text: str, spelling: Spelling) -> Any:
    """The value of field ``name`` written as ``text`` (environment, flag or YAML string): the one
    rule every text entry point reads with. Words: ``auto`` (``center``), ``all`` / empty
    (``layers``), ``none`` / ``all`` (``top_p_max_experts``), 1/0, true/false, yes/no, on/off
    (booleans), numbers for ``sigma`` and ``top_p``; other fields keep the text.

    Raises:
        ConfigError: text that is none of those, naming the setting as typed and the fixes.
    """
    value = text.strip()
    word = value.lower()
    spelled = spelling.typed_as(text)
    if name in _BOOLEAN_FIELDS:
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        raise _TextError(name, spelled, lambda fixes: (
            f"{spelled.current(name, text)} is invalid: expected {'/'.join(TRUE_WORDS[:2])} or "
            f"{'/'.join(FALSE_WORDS[:2])} (also yes/no, on/off): " + _boolean_hint(name, spelled, fixes) + "."),
            ({name: True}, {name: False}))
    if name == "center":
        if word in ("", "none", "auto"):
            return None
        if not value.isdigit():
            raise _TextError(name, spelled, lambda fixes: (
                f"{spelled.current(name, text)} is invalid: expected a positive integer (the model's top-k) or "
                f"'auto'. Use {_either(spelled, name, fixes)} to centre on the model's own top-k."), ({name: None},))
        return int(value)
    if name == "top_p_max_experts":
        if word in ("", "none", "all"):
            return None
        if not value.isdigit():
            raise _TextError(name, spelled, lambda fixes: (
                f"{spelled.current(name, text)} is invalid: expected a positive integer or 'none'. Use "
                f"{_either(spelled, name, fixes)} for no cap."), ({name: None},))
        return int(value)
    if name in ("sigma", "top_p"):
        try:
            return float(value)
        except ValueError:
            default = {"sigma": 1.5, "top_p": 0.4}[name]
            what = "a finite number > 0" if name == "sigma" else "a number in (0, 1]"
            raise _TextError(name, spelled, lambda fixes: (
                f"{spelled.current(name, text)} is invalid: expected {what}, e.g. {_either(spelled, name, fixes)} "
                f"(the paper's value)."), ({name: default},)) from None
    if name == "layers" and word in ("", ALL_LAYERS):
        return None
    return value


def _boolean_hint(name: str, spelling: Spelling, fixes: tuple[dict, ...]) -> str:
    meaning = {("enabled", True): "to route elastically", ("enabled", False): "to leave every router stock",
               ("allow_off_center", True): "to accept a schedule whose mean is not the model's top-k",
               ("allow_off_center", False): "to refuse one"}
    return ", ".join(f"{spelling.setting(name, fix[name])} {meaning[(name, fix[name])]}" for fix in fixes)


def _either(spelling: Spelling, name: str, fixes: tuple[dict, ...]) -> str:
    return " or ".join(spelling.setting(name, fix[name]) for fix in fixes)


class _TextError(Exception):
    """A text value :func:`parse_text` cannot read; the loader turns it into a :class:`ConfigError`
    once its fixes are validated against the other settings (and the model, when known)."""

    def __init__(self, name: str, spelling: Spelling, message: Callable[[tuple[dict, ...]], str],
                 fixes: tuple[dict, ...]) -> None:
        super().__init__(name)
        self.name, self.spelling, self.message, self.fixes = name, spelling, message, fixes

    def as_config_error(self, accepted: tuple[dict, ...]) -> ConfigError:
        return ConfigError(self.message(accepted), field=self.name, fixes=accepted)


# ---------------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class ElasticConfig:
    """Settings of Elastic Expert Routing. Validated on construction; never mutated.

    Attributes:
        schedule: the budget support: ``"auto"`` (the default: resolved from the model, k−2..k+2
            around its top-k, kept symmetric and within 1..E, which is the paper's 6-10 at top-8),
            ``"LOW-HIGH"`` (e.g. ``"6-10"``), ``"static"`` or the integer center.
        center: k0, the schedule's center. ``None`` means the model's own top-k (recommended);
            if set it must equal the model's top-k.
        sigma: σ of the discretised Gaussian (paper default 1.5).
        layers: 0-based decoder-layer indices that route elastically (``"3-7"``,
            ``"0,2,5-7"``); ``None`` or ``"all"`` means every MoE layer. Other layers stay static
            top-k. ``"none"`` is refused (it is ambiguous): to route no layer elastically, set
            ``enabled=False`` or leave the plugin out.
        gate: weight convention for the kept experts. ``"auto"`` keeps the model's own;
            ``"full_softmax"`` keeps unnormalised full-softmax probabilities (OLMoE, Switch,
            Megatron pre-softmax); ``"renormalized"`` divides them by their retained sum
            (Qwen3 ``norm_topk_prob=True``, Megatron's default post-softmax).
        sampling: ``"iid"`` (independent per-token draws, the paper) or ``"balanced"``
            (per-micro-batch exact compute match, no host sync; see ``BudgetSchedule.sample``).
        enabled: master switch; ``False`` leaves every router stock.
        allow_off_center: accept a schedule whose mean is not the center.
        mode: ``"elastic"`` (budget schedule, compute-matched with static top-k) or ``"top_p"``
            (the paper's nucleus-routing control: each token keeps its smallest top-ranked set
            whose full-softmax probability reaches ``top_p``; this *changes* the expected
            compute, ~13 experts per token on OLMoE at p = 0.4). Training only; inference stays
            static top-k.
        top_p: the cumulative-probability threshold of ``mode="top_p"``, in (0, 1].
        top_p_max_experts: cap on experts per token in ``mode="top_p"`` (None: every expert).
    """

    schedule: str = AUTO_SCHEDULE
    center: int | None = None
    sigma: float = 1.5
    layers: str | None = None
    gate: GateConvention = "auto"
    sampling: Literal["iid", "balanced"] = "iid"
    enabled: bool = True
    allow_off_center: bool = False
    mode: Literal["elastic", "top_p"] = "elastic"
    top_p: float = 0.4
    top_p_max_experts: int | None = None
    _layer_set: frozenset[int] | None = field(init=False, repr=False, compare=False)

    _spellings: Mapping[str, Spelling] = field(init=False, repr=False, compare=False)
    _explicit: frozenset[str] = field(init=False, repr=False, compare=False)
    # resolve()'s schedules by (num_experts, topk, num_layers): the config never changes, and the
    # metrics of every logging step resolve it again (the checks cost more than the log's reads)
    _resolved: dict[tuple[int | None, int, int | None], BudgetSchedule] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        build = _BUILD.get()
        if build is None:  # built in Python: the fields that differ from their defaults were set
            defaults = {f.name: f.default for f in dataclasses.fields(self) if f.init}
            build = _Build({}, frozenset(name for name, default in defaults.items() if getattr(self, name) != default))
        object.__setattr__(self, "_spellings", dict(build.spellings))
        object.__setattr__(self, "_explicit", build.explicit)
        object.__setattr__(self, "_resolved", {})
        model = build.model
        self._check_types(model)
        try_layers, problem = (None, None) if self._layers_mean_all() else _parse_layer_items(self.layers)
        if self.layers is not None and isinstance(self.layers, str) and self.layers.strip().lower() == "none":
            self._refuse_layers_none(model)
        if problem is not None:
            self._refuse_layers(problem, model)
        object.__setattr__(self, "_layer_set", try_layers)
        # What can be checked without the model, so that a bad spec fails at start-up on every
        # rank; the model's own checks (centre, width, layers) run in resolve(), and here too when
        # the loader was given the model.
        self._check_schedule_shape(model)
        if model is not None:
            self._check_against(model)
        elif self.center is not None:
            self._check_schedule_around(self.center, None, None)

    # ------------------------------------------------------------------ spelling
    def _spelling(self, name: str) -> Spelling:
        return self._spellings.get(name, PYTHON)

    def spell(self, name: str, *value: Any) -> str:
        """The setting ``name`` as the user's entry point writes it: its current value as typed, or
        set to ``value`` (``ELASTIC_MOE_ENABLED=0``, ``--elastic-moe-enabled false``, ``enabled=False``)."""
        return self._spell(name, *value)

    def _spell(self, name: str, *value: Any) -> str:
        """``name`` with its current value as the user wrote it, or set to ``value``."""
        spelling = self._spelling(name)
        if value:
            return spelling.setting(name, value[0])
        return spelling.current(name, getattr(self, name))

    def _spell_fix(self, fix: Mapping[str, Any]) -> str:
        return " and ".join(self._spell(name, value) for name, value in fix.items())

    def _spell_fixes(self, fixes: tuple[dict, ...], joiner: str = " or ") -> str:
        return joiner.join(self._spell_fix(fix) for fix in fixes)

    def _verb(self, fix: Mapping[str, Any]) -> str:
        return self._spelling(next(iter(fix))).verb

    def _schedule_label(self) -> str:
        """The schedule as written; for the default, which the user never typed, the variable unset."""
        if "schedule" in self._explicit:
            return self._spell("schedule")
        return (f"{self._spelling('schedule').unset('schedule')} (the default, {AUTO_SCHEDULE!r}: "
                f"k-{AUTO_HALF_WIDTH}..k+{AUTO_HALF_WIDTH} around the model's top-k)")

    # ------------------------------------------------------------------ fixes
    def _values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def _accepts(self, fix: Mapping[str, Any], model: ModelShape | None) -> bool:
        """Whether these settings with ``fix`` applied are accepted (by the model, when known)."""
        values = {**self._values(), **fix}
        build = _Build(self._spellings, self._explicit | frozenset(fix), None, check_fixes=False)
        with _building(build):
            try:
                candidate = ElasticConfig(**values)
                if model is not None:
                    candidate.resolve(**model._asdict())
            except ConfigError:
                return False
        return True

    def _accepted(self, candidates: list[dict], model: ModelShape | None, limit: int = 2) -> tuple[dict, ...]:
        """The first ``limit`` distinct candidates that are accepted (all, unvalidated, while a fix is
        itself being validated)."""
        build = _BUILD.get()
        distinct: list[dict] = []
        for candidate in candidates:
            if candidate and candidate not in distinct:
                distinct.append(candidate)
        if build is not None and not build.check_fixes:
            return tuple(distinct[:limit])
        return tuple([fix for fix in distinct if self._accepts(fix, model)][:limit])

    def _refuse(self, name: str, message: Callable[[tuple[dict, ...]], str], candidates: list[dict],
                model: ModelShape | None, limit: int = 2) -> ConfigError:
        fixes = self._accepted(candidates, model, limit)
        return ConfigError(message(fixes), field=name, fixes=fixes)

    def _use(self, fixes: tuple[dict, ...], what: str = "") -> str:
        """``"Use A (what), or B."``, or a plain sentence when no fix is accepted."""
        if not fixes:
            return "No single change of this setting is accepted; see the other settings."
        first = self._spell_fix(fixes[0]) + (f" ({what})" if what else "")
        rest = "".join(f", or {self._spell_fix(fix)}" for fix in fixes[1:])
        return f"Use {first}{rest}."

    def _around(self, model: ModelShape | None, half_width: int) -> list[dict]:
        """The range of ``half_width`` around the model's top-k (the user's centre when the model is
        not known), within the model's experts."""
        centre = model.topk if model is not None else self.center
        if centre is None:
            return []
        return [{"schedule": symmetric_range(centre, half_width, model.num_experts if model else None)}]

    # ------------------------------------------------------------------ construction checks
    def _check_types(self, model: ModelShape | None) -> None:
        if not isinstance(self.schedule, str) or not self.schedule.strip():
            raise self._refuse("schedule", lambda fixes: (
                f"{self._spell('schedule')} is invalid: expected {AUTO_SCHEDULE!r} (k-{AUTO_HALF_WIDTH}..k+"
                f"{AUTO_HALF_WIDTH} around the model's top-k), 'LOW-HIGH' (e.g. 6-10 around top-8), 'static' or "
                f"the model's top-k. " + self._use(fixes)), [{"schedule": AUTO_SCHEDULE}, {"schedule": "static"}], model)
        if self.center is not None and (isinstance(self.center, bool) or not isinstance(self.center, int) or self.center < 1):
            raise self._refuse("center", lambda fixes: (
                f"{self._spell('center')} is invalid: expected a positive integer (the model's top-k). "
                + self._use(fixes, "the model's own top-k")), [{"center": None}], model)
        if isinstance(self.sigma, bool) or not isinstance(self.sigma, (int, float)) or not math.isfinite(self.sigma) or self.sigma <= 0:
            raise self._refuse("sigma", lambda fixes: (
                f"{self._spell('sigma')} is invalid: expected a finite number > 0. " + self._use(fixes, "the paper's σ")),
                [{"sigma": 1.5}], model)
        if self.gate not in GATE_CHOICES:
            raise self._choice_error("gate", "a gate convention", GATE_CHOICES, model)
        if self.sampling not in SAMPLING_MODES:
            raise self._choice_error("sampling", "a sampling mode", SAMPLING_MODES, model)
        for name in _BOOLEAN_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise self._choice_error(name, "true or false", (True, False), model)
        if self.mode not in ROUTER_MODES:
            raise self._choice_error("mode", "a router mode", ROUTER_MODES, model)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise self._refuse("top_p", lambda fixes: (
                f"{self._spell('top_p')} is invalid: expected a number in (0, 1]. "
                + self._use(fixes, "the paper's control")), [{"top_p": 0.4}], model)
        if self.top_p_max_experts is not None and (
            isinstance(self.top_p_max_experts, bool) or not isinstance(self.top_p_max_experts, int) or self.top_p_max_experts < 1
        ):
            raise self._refuse("top_p_max_experts", lambda fixes: (
                f"{self._spell('top_p_max_experts')} is invalid: expected a positive integer. "
                + self._use(fixes, "no cap")), [{"top_p_max_experts": None}], model)
        if self.layers is not None and not isinstance(self.layers, str):
            raise self._refuse("layers", lambda fixes: (
                f"{self._spell('layers')} is invalid: expected 0-based decoder-layer indices as text, such as "
                f"'3-7' or '0,2,5-7'. " + self._use(fixes, "every MoE layer")), self._layer_text_fixes(), model)

    def _layer_text_fixes(self) -> list[dict]:
        candidates = []
        if isinstance(self.layers, int) and not isinstance(self.layers, bool):
            candidates.append({"layers": str(self.layers)})
        return candidates + [{"layers": None}]

    def _choice_error(self, name: str, what: str, choices: tuple, model: ModelShape | None) -> ConfigError:
        return self._refuse(name, lambda fixes: (
            f"{self._spell(name)} is not {what}: expected one of {self._spell_fixes(fixes, ', ')}."),
            [{name: choice} for choice in choices], model, limit=len(choices))

    def _layers_mean_all(self) -> bool:
        return self.layers is None or (isinstance(self.layers, str) and self.layers.strip().lower() == ALL_LAYERS)

    def _refuse_layers_none(self, model: ModelShape | None) -> None:
        every, off = {"layers": None}, {"layers": None, "enabled": False}

        def message(fixes: tuple[dict, ...]) -> str:
            parts = []
            if every in fixes:
                parts.append(f"For every MoE layer use {self._spell_fix(every)} (or leave it unset)")
            if off in fixes:
                parts.append(f"to route no layer elastically use {self._spell_fix(off)} (every router stock), or "
                             f"train without the plugin")
            return (f"{self._spell('layers')} is ambiguous, so it is refused: it reads as 'no layer', but it used to "
                    f"select every MoE layer. " + "; ".join(parts) + ".")

        raise self._refuse("layers", message, [every, off], model)

    def _refuse_layers(self, problem: _LayerProblem, model: ModelShape | None) -> None:
        candidates = [{"layers": problem.repaired}] if problem.repaired else []
        if problem.repaired and model is not None and model.num_layers is not None:
            repaired, _ = _parse_layer_items(problem.repaired)
            inside = sorted(i for i in repaired or () if i < model.num_layers)
            if inside:
                candidates.append({"layers": _layers_text(inside)})
        candidates.append({"layers": None})

        def message(fixes: tuple[dict, ...]) -> str:
            first = fixes[0]["layers"] if fixes else None
            what = ("every MoE layer" if first is None else "the range turned round" if first == problem.repaired
                    else f"the range turned round, within the model's {model.num_layers} layers")
            return f"{_layer_problem_text(self._spell('layers'), problem)}. " + self._use(fixes, what)

        raise self._refuse("layers", message, candidates, model)

    def _check_schedule_shape(self, model: ModelShape | None) -> None:
        """Refuse a schedule no model accepts: unparsable, reversed, or with budgets below 1. Fixes are
        computed around the model's top-k when it is known."""
        text = self.schedule.strip().lower()
        if text in (AUTO_SCHEDULE, "static"):
            return
        if text.isdigit():
            if int(text) < 1:
                raise self._refuse("schedule", lambda fixes: (
                    f"{self._schedule_label()} is invalid: every token needs at least one expert. "
                    + self._use(fixes, "the model's own top-k")), [{"schedule": "static"}, {"schedule": AUTO_SCHEDULE}],
                    model, limit=1)
            return
        bounds = parse_range(self.schedule)
        if bounds is None:
            raise self._refuse("schedule", lambda fixes: (
                f"{self._schedule_label()} does not parse: expected {AUTO_SCHEDULE!r} (k-{AUTO_HALF_WIDTH}..k+"
                f"{AUTO_HALF_WIDTH} around the model's top-k), 'LOW-HIGH' (e.g. 6-10 around top-8), 'static' or the "
                f"model's top-k. " + self._use(fixes, "stock top-k")), [{"schedule": "static"}, {"schedule": AUTO_SCHEDULE}],
                model, limit=1)
        low, high = bounds
        if low > high:
            reordered = {"schedule": f"{high}-{low}"}

            def reversed_message(fixes: tuple[dict, ...]) -> str:
                head = f"{self._schedule_label()} has low={low} > high={high}: write the range as LOW-HIGH"
                if fixes and fixes[0] == reordered:
                    return f"{head}, e.g. {self._spell_fix(reordered)}."
                what = "" if not fixes or fixes[0]["schedule"] == AUTO_SCHEDULE else "the same width around its top-k"
                return f"{head}; {high}-{low} does not fit the model ({model.describe()}) either. " + self._use(fixes, what)

            raise self._refuse("schedule", reversed_message,
                               [reordered, *self._around(model, (low - high) // 2), {"schedule": AUTO_SCHEDULE}],
                               model, limit=1)
        if low < 1:
            centre = f"the model's top-{model.topk}" if model is not None else (
                f"top-{self.center}" if self.center is not None else "the model's top-k")
            around = self._around(model, (high - low) // 2)

            def low_message(fixes: tuple[dict, ...]) -> str:
                what = "" if not fixes or fixes[0] not in around else (
                    f"no budget below 1 fits around {centre}: stock top-k" if fixes[0]["schedule"] == "static"
                    else f"symmetric around {centre}, low >= 1")
                return (f"{self._schedule_label()} is invalid: low={low}, but every token needs at least one expert, "
                        f"so low must be >= 1. " + self._use(fixes, what))

            raise self._refuse("schedule", low_message, [*around, {"schedule": AUTO_SCHEDULE}, {"schedule": "static"}],
                               model, limit=1 if around else 2)

    # ------------------------------------------------------------------ model checks
    def auto_range(self, topk: int, num_experts: int | None = None) -> str | None:
        """The schedule ``"auto"`` resolves to for a model routing to top-``topk`` of ``num_experts``:
        ``k-d..k+d`` with ``d = min(2, k-1, E-k)`` (symmetric, budgets within 1..E), or ``None`` where no
        elastic range exists (``d = 0``: top-1, or top-E)."""
        spec = symmetric_range(topk, AUTO_HALF_WIDTH, num_experts)
        return None if spec == "static" else spec

    @property
    def schedule_from_model(self) -> bool:
        """Whether the schedule is resolved from the model (``schedule="auto"``)."""
        return self.schedule.strip().lower() == AUTO_SCHEDULE

    def _check_schedule_around(self, topk: int, num_experts: int | None, model: ModelShape | None) -> None:
        """Refuse a schedule that does not fit a model routing to top-``topk`` of ``num_experts``
        (None: unknown yet). Every fix is validated before it is printed."""
        text = self.schedule.strip().lower()
        if text == AUTO_SCHEDULE:
            if self.auto_range(topk, num_experts) is None:
                self._refuse_auto(topk, num_experts, model)
            return
        if text.isdigit() and int(text) != topk:
            raise self._refuse("schedule", lambda fixes: (
                f"{self._schedule_label()} is a point mass at {text}, but the model routes to top-{topk}: a static "
                f"schedule must equal the model's top-k (to train with more experts change the model's top-k "
                f"instead). " + self._use(fixes)), [{"schedule": "static"}, {"schedule": AUTO_SCHEDULE}], model, limit=1)
        bounds = parse_range(self.schedule)
        if bounds is None:
            return
        low, high = bounds
        same_width = {"schedule": symmetric_range(topk, (high - low) // 2, num_experts)}
        if not low <= topk <= high:
            raise self._refuse("schedule", lambda fixes: (
                f"{self._schedule_label()} does not contain the model's top-{topk}: a schedule is centred on the "
                f"model's top-k (low <= k <= high). " + self._use(fixes, f"the same width around top-{topk}, at least "
                f"one expert per token" if fixes and fixes[0] == same_width else "")),
                [same_width, {"schedule": AUTO_SCHEDULE}], model, limit=1)
        if num_experts is not None and high > num_experts:
            raise self._refuse("schedule", lambda fixes: (
                f"{self._schedule_label()} reaches budget {high}, but the model has only {num_experts} experts: "
                f"expected high <= {num_experts}. " + self._use(fixes)), [same_width, {"schedule": AUTO_SCHEDULE}], model,
                limit=1)
        around_topk = BudgetSchedule(low, high, topk, self.sigma, allow_off_center=True)
        if not around_topk.is_symmetric and not self.allow_off_center:
            accept = {"allow_off_center": True}
            raise self._refuse("schedule", lambda fixes: (
                f"{self._schedule_label()} around the model's top-{topk} has mean {around_topk.mean:.4f}, not {topk}: "
                f"training would no longer be compute-matched with static top-{topk}. Use a range symmetric around "
                f"{topk} (low + high == {2 * topk})" + (f", e.g. {self._spell_fix(same_width)}" if same_width in fixes
                                                        else "")
                + (f", or {self._verb(accept)} {self._spell_fix(accept)} to accept it" if accept in fixes else "")
                + "."), [same_width, accept], model)
        if not around_topk.is_symmetric and self.sampling == "balanced":
            iid = {"sampling": "iid"}
            raise self._refuse("sampling", lambda fixes: (
                f"{self._spell('sampling')} needs a schedule symmetric around the model's top-{topk}, got "
                f"{self._spell('schedule')}: use {self._spell_fixes(fixes, ', or ')}."), [iid, same_width], model)

    def _refuse_auto(self, topk: int, num_experts: int | None, model: ModelShape | None) -> None:
        static = {"schedule": "static"}
        off_centre = {"schedule": f"1-{1 + AUTO_HALF_WIDTH}", "allow_off_center": True}
        if topk == 1:
            why = ("the model routes to top-1, and no budget range symmetric around 1 keeps every token at >= 1 "
                   "expert, so no elastic schedule can be resolved from it")
            candidates = [static, off_centre]
        else:
            why = (f"the model routes every token to all {num_experts} of its experts (top-{topk} of {num_experts}), "
                   f"so there is no budget above {topk} and no elastic range around it")
            candidates = [static]

        def message(fixes: tuple[dict, ...]) -> str:
            parts = []
            if static in fixes:
                parts.append(f"{self._spell_fix(static)} to train stock top-{topk} with the plugin's metrics")
            if off_centre in fixes:
                parts.append(f"{self._spell_fix(off_centre)} for an off-centre range (E[κ] > 1: more compute than top-1)")
            if topk > 1:
                parts.append("lower the model's top-k")
            return f"{self._schedule_label()}: {why}. Use " + ", or ".join(parts) + "."

        raise self._refuse("schedule", message, candidates, model)

    def _check_against(self, model: ModelShape) -> None:
        """Every check of :meth:`resolve` against ``model``, in its order (the centre first)."""
        self.resolve(**model._asdict())

    # ------------------------------------------------------------------ model binding
    def budget_schedule(self, model_topk: int, num_experts: int | None = None) -> BudgetSchedule:
        """The :class:`BudgetSchedule` for a model whose deployment top-k is ``model_topk`` (``"auto"``
        resolved within ``num_experts`` when given)."""
        center = self.center if self.center is not None else model_topk
        spec = self.schedule
        if self.schedule_from_model:
            spec = self.auto_range(center, num_experts) or "static"
        return BudgetSchedule.parse(spec, center, self.sigma, allow_off_center=self.allow_off_center)

    def resolve(self, *, num_experts: int | None, topk: int, num_layers: int | None = None) -> BudgetSchedule:
        """Check this config against a model and return its schedule (the point mass at the
        model's top-k in ``mode="top_p"``, whose per-token budgets come from the probabilities).
        The config is immutable, so a shape that passed is not checked again: the schedule is
        kept per ``(num_experts, topk, num_layers)``.

        ``num_experts`` / ``num_layers`` None: not known (``elastic-moe schedule`` without ``--experts``);
        the checks that need them are left out.

        Raises:
            ConfigError: if the center is not the model's top-k, the schedule is not centred on it or
                reaches past ``num_experts``, ``"auto"`` finds no elastic range (top-1, top-E),
                ``top_p_max_experts`` exceeds the experts, or a selected layer index is >= ``num_layers``.
                ``error.fixes`` lists the changes the message suggests, each accepted by this model.
        """
        key = (num_experts, topk, num_layers)
        schedule = self._resolved.get(key)
        if schedule is None:
            schedule = self._resolved[key] = self._checked_schedule(ModelShape(topk, num_experts, num_layers))
        return schedule

    def _checked_schedule(self, model: ModelShape) -> BudgetSchedule:
        """:meth:`resolve` without its memo: every check against ``model``, then the schedule."""
        topk, num_experts, num_layers = model.topk, model.num_experts, model.num_layers
        if self.mode == "top_p":
            # The budget is read off the probabilities, not sampled: the schedule does not apply.
            if num_experts is not None and self.top_p_max_experts is not None and self.top_p_max_experts > num_experts:
                raise self._refuse("top_p_max_experts", lambda fixes: (
                    f"{self._spell('top_p_max_experts')} exceeds the model's {num_experts} experts: expected at most "
                    f"{num_experts}. " + self._use(fixes)),
                    [{"top_p_max_experts": num_experts}, {"top_p_max_experts": None}], model)
            schedule = BudgetSchedule.static(topk)
        else:
            if self.center is not None and self.center != topk:
                # the range moves with the center: keep its width around the model's top-k
                bounds = parse_range(self.schedule)
                moved = {} if bounds is None or bounds[0] > bounds[1] else {
                    "schedule": symmetric_range(topk, (bounds[1] - bounds[0]) // 2, num_experts)}
                if moved.get("schedule") == self.schedule:
                    moved = {}
                candidates = [{"center": None}, {"center": None, **moved}, {"center": topk}, {"center": topk, **moved},
                              {"center": None, "schedule": AUTO_SCHEDULE}, {"center": None, "schedule": "static"}]
                def center_message(fixes: tuple[dict, ...]) -> str:
                    head = (f"{self._spell('center')}, but the model routes to top-{topk}: the schedule's center must "
                            f"be the model's deployment top-k.")
                    if not fixes:
                        return f"{head} {self._use(fixes)}"
                    return (f"{head} Set {self._spell_fix(fixes[0])} (the model's top-k)"
                            + "".join(f" or {self._spell_fix(fix)}" for fix in fixes[1:]) + ".")

                raise self._refuse("center", center_message, candidates, model)
            self._check_schedule_around(topk, num_experts, model)
            try:
                schedule = self.budget_schedule(topk, num_experts)
                if num_experts is not None:
                    schedule.validate_for(num_experts, topk)
            except ValueError as error:  # pragma: no cover - the checks above refuse it first
                raise ConfigError(str(error), field="schedule") from None
        if num_layers is not None and self._layer_set:
            outside = sorted(i for i in self._layer_set if i >= num_layers)
            if outside:
                inside = sorted(i for i in self._layer_set if i < num_layers)
                candidates = ([{"layers": _layers_text(inside)}] if inside else []) + [{"layers": None}]
                raise self._refuse("layers", lambda fixes: (
                    f"{self._spell('layers')} selects layer(s) {outside}, but the model has {num_layers} decoder "
                    f"layers (0-based indices 0..{num_layers - 1}). Narrow the range"
                    + "".join(f", e.g. {self._spell_fix(fix)}" for fix in fixes if fix["layers"] is not None)
                    + "".join(f", or {self._verb(fix)} {self._spell_fix(fix)} for every MoE layer"
                              for fix in fixes if fix["layers"] is None) + "."), candidates, model)
        return schedule

    @property
    def layer_set(self) -> frozenset[int] | None:
        """The selected 0-based layer indices, or None for every MoE layer."""
        return self._layer_set

    def layer_is_elastic(self, layer_index: int) -> bool:
        """Whether the 0-based decoder layer ``layer_index`` routes elastically."""
        return self.enabled and (self._layer_set is None or layer_index in self._layer_set)

    def replace(self, **changes: Any) -> "ElasticConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return self._values()

    # ------------------------------------------------------------------ loaders
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config",
                  spelling: Spelling | Mapping[str, Spelling] = PYTHON,
                  model: ModelShape | None = None) -> "ElasticConfig":
        """Build from a mapping of field names; unknown keys are errors naming ``source``.

        ``source`` prefixes every message (``""``: none). ``spelling``: how the user wrote the values
        (one :class:`Spelling`, or one per field), so
        that messages show the setting and its fix in that form; text values of a text spelling are
        read by :func:`parse_text`. ``model``: the model the config will meet, when the entry point
        knows it: the model's checks then run now, and every fix is validated against it.

        Raises:
            ConfigError: ``error.fixes`` holds the suggested changes; for an unknown key,
                ``error.renames`` maps it to the field it most likely meant.
        """
        prefix = f"{source}: " if source else ""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{prefix}expected a mapping of ElasticConfig fields, got {type(values).__name__}.")
        known = cls.field_names()
        spellings = ({name: spelling for name in known} if isinstance(spelling, Spelling)
                     else {name: spelling.get(name, PYTHON) for name in known})
        unknown = [key for key in values if key not in known]
        if unknown:
            raise cls._unknown_keys(unknown, values, prefix, spellings)
        parsed: dict[str, Any] = {}
        for name, value in values.items():
            if spellings[name].reads_text and isinstance(value, str):
                if spellings[name].kind != "yaml":  # YAML values are typed: echo the parsed value
                    spellings[name] = spellings[name].typed_as(value)
                try:
                    value = parse_text(name, value, spellings[name])
                except _TextError as error:
                    fixes = cls._accepted_text_fixes(error, values, spellings, model)
                    raise ConfigError(f"{prefix}{error.message(fixes)}", field=name, fixes=fixes) from None
            elif spellings[name].kind == "yaml" and isinstance(value, int) and not isinstance(value, bool):
                # YAML typed the number; the user meant what the same text means in every entry point
                if name in ("layers", "schedule"):
                    value = str(value)  # `layers: 4` is the text '4'
                elif name in _BOOLEAN_FIELDS and value in (0, 1):
                    value = bool(value)  # `enabled: 0`, as ELASTIC_MOE_ENABLED=0
            parsed[name] = value
        try:
            with _building(_Build(spellings, frozenset(values), model)):
                return cls(**parsed)
        except ConfigError as error:
            raise ConfigError(f"{prefix}{error}", field=error.field, fixes=error.fixes,
                              renames=error.renames) from None

    @classmethod
    def _accepted_text_fixes(cls, error: _TextError, values: Mapping[str, Any], spellings: Mapping[str, Spelling],
                             model: ModelShape | None) -> tuple[dict, ...]:
        """The fixes of an unreadable text value that give settings the model (when known) accepts."""
        accepted = []
        for fix in error.fixes:
            trial_spellings = {**spellings, error.name: spellings[error.name].typed_as(None)}
            try:
                parsed = {name: parse_text(name, value, trial_spellings[name])
                          if trial_spellings[name].reads_text and isinstance(value, str) else value
                          for name, value in values.items() if name != error.name}
                with _building(_Build(trial_spellings, frozenset(values), None, check_fixes=False)):
                    candidate = cls(**parsed, **fix)
                    if model is not None:
                        candidate.resolve(**model._asdict())
            except (ConfigError, _TextError):
                continue
            accepted.append(fix)
        return tuple(accepted)

    @classmethod
    def _unknown_keys(cls, unknown: list, values: Mapping[str, Any], prefix: str,
                      spellings: Mapping[str, Spelling]) -> ConfigError:
        known = cls.field_names()
        hints, fixes, renames = [], [], {}
        for key in unknown:
            close = difflib.get_close_matches(str(key), known, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            if close and close[0] not in values:
                renames[str(key)] = close[0]
                fixes.append({close[0]: values[key]})
        rename = "".join(f" Rename it: {spellings[name].setting(name, value)}." for fix in fixes
                         for name, value in fix.items())
        return ConfigError(f"{prefix}unknown key(s) {', '.join(hints)}. Accepted keys: {', '.join(known)}.{rename}",
                           fixes=tuple(fixes), renames=renames)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, model: ModelShape | None = None) -> "ElasticConfig":
        """Load from a YAML file (``yaml.safe_load``). The file may nest fields under ``elastic_moe:``."""
        return cls.from_dict(_read_yaml(path), source=str(path), spelling=Spelling("yaml"), model=model)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, model: ModelShape | None = None) -> "ElasticConfig":
        """Load from ``ELASTIC_MOE_*`` variables (``ENV_VARS``), over ``ELASTIC_MOE_CONFIG``'s YAML.

        Unknown ``ELASTIC_MOE_*`` variables are errors: a typo must not silently train stock.
        ``model``: as in :meth:`from_dict`.
        """
        values, spellings, source = _environment_values(os.environ if environ is None else environ)
        return cls.from_dict(values, source=source, spelling=spellings, model=model)


#: field name -> environment variable
ENV_VARS: dict[str, str] = {
    name: ENV_PREFIX + name.upper() for name in ElasticConfig.field_names()
}


def _environment_values(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Spelling], str]:
    """(values, spellings, source) of ``ELASTIC_MOE_*`` over ``ELASTIC_MOE_CONFIG``'s YAML, unparsed.

    Raises:
        ConfigError: an ``ELASTIC_MOE_*`` variable that is no setting (a typo must not silently train stock).
    """
    values: dict[str, Any] = {}
    config_file = environ.get(ENV_CONFIG_FILE)
    if config_file:
        values.update(_read_yaml(config_file))
    # a field the variables set is written as a variable; one from the file as a YAML key;
    # a default as the variable that would change it
    spellings = {name: Spelling("yaml") if name in values else Spelling("env") for name in ENV_VARS}
    stray = [key for key in environ if key.startswith(ENV_PREFIX) and key != ENV_CONFIG_FILE
             and key not in OPERATIONAL_ENV_VARS and key not in ENV_VARS.values()]
    if stray:
        raise _unknown_variable(stray[0], environ)
    for name, var in ENV_VARS.items():
        if var in environ:
            values[name] = environ[var]
            spellings[name] = Spelling("env")
    return values, spellings, "environment" if not config_file else f"environment (+ {config_file})"


def _unknown_variable(key: str, environ: Mapping[str, str]) -> ConfigError:
    close = difflib.get_close_matches(key, list(ENV_VARS.values()) + [ENV_CONFIG_FILE], n=1)
    fixes, renames, rename = (), {}, ""
    if close and close[0] != ENV_CONFIG_FILE and close[0] not in environ:
        name = close[0][len(ENV_PREFIX):].lower()
        fixes, renames = ({name: environ[key]},), {key: close[0]}
        rename = f" Rename it: {Spelling('env').setting(name, environ[key])}."
    return ConfigError(f"environment variable {key} is not an elastic-moe setting"
                       + (f" (did you mean {close[0]}?)" if close else "")
                       + f". Accepted: {', '.join(sorted(ENV_VARS.values()))}, {ENV_CONFIG_FILE}.{rename}",
                       fixes=fixes, renames=renames)


def _layers_text(indices: list[int]) -> str:
    """0-based indices as a ``layers`` spec: ``[3, 4, 5, 7]`` -> ``"3-5,7"``."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist. Check the path (ELASTIC_MOE_CONFIG or --elastic-moe-config).")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if isinstance(data, dict) and "elastic_moe" in data and len(data) == 1:
        data = data["elastic_moe"]
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of ElasticConfig fields, got {type(data).__name__}.")
    return data


def add_cli_arguments(parser: argparse.ArgumentParser, prefix: str = CLI_PREFIX) -> None:
    """Add one ``{prefix}<field>`` flag per ElasticConfig field (default: unset), plus ``{prefix}config``."""
    group = parser.add_argument_group("elastic-moe")
    group.add_argument(prefix + "config", dest="elastic_moe_config", default=None, help="YAML file of ElasticConfig fields")
    for name in ElasticConfig.field_names():
        group.add_argument(prefix + name.replace("_", "-"), dest="elastic_moe_" + name, default=None, metavar="VALUE",
                           help=f"ElasticConfig.{name} (env {ENV_VARS[name]})")


def config_from_cli(args: argparse.Namespace, environ: Mapping[str, str] | None = None, *,
                    model: ModelShape | None = None, prefix: str = CLI_PREFIX) -> ElasticConfig:
    """Merge defaults < YAML (``--elastic-moe-config`` or ``ELASTIC_MOE_CONFIG``) < environment < CLI flags.

    ``prefix``: the flags' prefix (:func:`add_cli_arguments`); ``model``: as in :meth:`ElasticConfig.from_dict`."""
    environ = dict(os.environ if environ is None else environ)
    if getattr(args, "elastic_moe_config", None):
        environ[ENV_CONFIG_FILE] = args.elastic_moe_config
    values, spellings, source = _environment_values(environ)
    cli = Spelling("cli", "" if prefix == CLI_PREFIX else prefix)
    overrides = {name: getattr(args, "elastic_moe_" + name) for name in ElasticConfig.field_names()
                 if getattr(args, "elastic_moe_" + name, None) is not None}
    # what the variables or the file set keeps their spelling; the rest is what a flag would change
    for name in ElasticConfig.field_names():
        if name in overrides or name not in values:
            spellings[name] = cli
    if overrides or not values:
        source = "command line"
    return ElasticConfig.from_dict({**values, **overrides}, source=source, spelling=spellings, model=model)


__all__ = ["ALL_LAYERS", "AUTO_SCHEDULE", "ENV_CONFIG_FILE", "ENV_PREFIX", "ENV_VARS", "GATE_CHOICES",
           "OPERATIONAL_ENV_VARS", "ROUTER_MODES", "ConfigError", "ElasticConfig", "ModelShape", "NONE_WORDS",
           "PYTHON", "Spelling", "add_cli_arguments", "config_from_cli", "parse_layers", "parse_text"]
