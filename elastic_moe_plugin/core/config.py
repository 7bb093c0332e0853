"""``ElasticConfig``: the one validated source of truth for the plugin's settings.

Every entry point maps onto this dataclass and validates the same way:

- Python: ``ElasticConfig(schedule="6-10", layers="3-7")``;
- YAML: ``ElasticConfig.from_yaml(path)`` (safe loading; unknown keys are errors);
- environment: ``ElasticConfig.from_env()`` reads ``ELASTIC_MOE_*`` (see ``ENV_VARS``), with
  ``ELASTIC_MOE_CONFIG`` naming a YAML file whose values the other variables override;
- CLI flags: ``--elastic-moe-<field>`` (see :func:`add_cli_arguments`).

Nothing here imports a training framework; model-dependent checks (top-k, expert and layer
counts) happen in :meth:`ElasticConfig.resolve` when an adapter meets a model.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.schedule import SAMPLING_MODES, BudgetSchedule, parse_range, symmetric_range

GateConvention = Literal["auto", "full_softmax", "renormalized"]
GATE_CHOICES: tuple[str, ...] = ("auto", "full_softmax", "renormalized")
ROUTER_MODES: tuple[str, ...] = ("elastic", "top_p")

ENV_PREFIX = "ELASTIC_MOE_"
ENV_CONFIG_FILE = "ELASTIC_MOE_CONFIG"
#: ``ELASTIC_MOE_*`` variables that steer the adapters, not the routing; not ElasticConfig fields
OPERATIONAL_ENV_VARS: frozenset[str] = frozenset({
    "ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE",         # try an untested megatron-core
    "ELASTIC_MOE_ALLOW_UNSUPPORTED_TRANSFORMERS",  # try an untested transformers
    "ELASTIC_MOE_DEBUG",                           # assert dispatcher invariants (syncs)
    "ELASTIC_MOE_SWIFT_HOOK",                      # 0: the ms-swift --plugin start-up hook stands aside
})

_LAYER_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
#: fields whose ``None`` is written as a word in the environment and on the command line
_NONE_WORDS = {"center": "auto", "layers": "all", "top_p_max_experts": "none"}


@dataclass(frozen=True)
class Spelling:
    """How the user wrote a setting. Messages show the refused setting and every suggested fix in
    the same form, so the fix can be pasted where the setting came from.

    ``kind``: ``"python"`` (``schedule='6-10'``), ``"env"`` (``ELASTIC_MOE_SCHEDULE=6-10``),
    ``"yaml"`` (``schedule: 6-10``; ``prefix`` such as ``"elastic."`` for a recipe's block) or
    ``"cli"`` (``--elastic-moe-schedule 6-10``; ``prefix`` replaces ``--elastic-moe-``, e.g. ``"--"``
    for a tool whose flags are ``--schedule``).
    """

    kind: Literal["python", "env", "yaml", "cli"] = "python"
    prefix: str = ""

    def setting(self, name: str, value: Any) -> str:
        if self.kind == "env":
            return f"{ENV_PREFIX}{name.upper()}={_word(name, value, true='1', false='0')}"
        if self.kind == "cli":
            flag = (self.prefix or "--elastic-moe-") + name.replace("_", "-")
            return f"{flag} {_word(name, value, true='true', false='false')}"
        if self.kind == "yaml":
            text = "null" if value is None else ("true" if value is True else "false" if value is False else value)
            return f"{self.prefix}{name}: {text}"
        return f"{name}={value!r}"


def _word(name: str, value: Any, *, true: str, false: str) -> str:
    if value is None:
        return _NONE_WORDS.get(name, "none")
    if isinstance(value, bool):
        return true if value else false
    return str(value)


PYTHON = Spelling()
#: (spelling per field, fields the user set) of the config being built; set by the loaders
_BUILD_CONTEXT: contextvars.ContextVar[tuple[Mapping[str, Spelling], frozenset[str]] | None] = (
    contextvars.ContextVar("elastic_moe_config_build", default=None))


@contextlib.contextmanager
def _spelled(spellings: Mapping[str, Spelling], explicit: frozenset[str]) -> Iterator[None]:
    token = _BUILD_CONTEXT.set((spellings, explicit))
    try:
        yield
    finally:
        _BUILD_CONTEXT.reset(token)




def parse_layers(spec: str) -> frozenset[int]:
    """Parse a 0-based decoder-layer selection: ``"3-7"``, ``"0,2,5-7"`` or ``"4"``.

    Indices are 0-based as in the paper's L0-L15 (Megatron's ``layer_number`` is 1-based).

    Raises:
        ConfigError: on an empty item, a reversed range or anything but digits, ',' and '-'.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            f"layers={spec!r} is malformed: expected 0-based decoder-layer indices such as '3-7' or "
            f"'0,2,5-7', or leave it unset for every MoE layer."
        )
    layers: set[int] = set()
    for item in spec.replace(" ", "").split(","):
        match = _LAYER_ITEM.match(item)
        if not match:
            raise ConfigError(
                f"layers={spec!r} is malformed at {item!r}: expected comma-separated 0-based indices or "
                f"ranges, e.g. '3-7' or '0,2,5-7'."
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ConfigError(
                f"layers={spec!r} has a reversed range {item!r}: write it as '{last}-{first}'."
            )
        layers.update(range(first, last + 1))
    return frozenset(layers)


@dataclass(frozen=True)
class ElasticConfig:
    """Settings of Elastic Expert Routing. Validated on construction; never mutated.

    Attributes:
        schedule: the budget support: ``"LOW-HIGH"`` (e.g. ``"6-10"``), ``"static"`` or the
            integer center. The paper's best is ``"6-10"`` around top-8.
        center: k0, the schedule's center. ``None`` means the model's own top-k (recommended);
            if set it must equal the model's top-k.
        sigma: σ of the discretised Gaussian (paper default 1.5).
        layers: 0-based decoder-layer indices that route elastically (``"3-7"``,
            ``"0,2,5-7"``); ``None`` means every MoE layer. Other layers stay static top-k.
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

    schedule: str = "6-10"
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

    def __post_init__(self) -> None:
        context = _BUILD_CONTEXT.get()
        if context is None:  # built in Python: the fields that differ from their defaults were set
            defaults = {f.name: f.default for f in dataclasses.fields(self) if f.init}
            context = ({}, frozenset(name for name, default in defaults.items() if getattr(self, name) != default))
        object.__setattr__(self, "_spellings", dict(context[0]))
        object.__setattr__(self, "_explicit", context[1])
        if not isinstance(self.schedule, str) or not self.schedule.strip():
            raise self._error(
                "schedule", f"{self._spell('schedule')} is invalid: expected 'LOW-HIGH' (e.g. 6-10 around top-8), "
                f"'static' or the model's top-k. Set {self._spell('schedule', 'static')} to train stock top-k.",
                {"schedule": "static"})
        if self.center is not None and (isinstance(self.center, bool) or not isinstance(self.center, int) or self.center < 1):
            raise self._error(
                "center", f"{self._spell('center')} is invalid: expected a positive integer (the model's top-k), "
                f"or {self._spell('center', None)} to use the model's top-k.", {"center": None})
        if isinstance(self.sigma, bool) or not isinstance(self.sigma, (int, float)) or not math.isfinite(self.sigma) or self.sigma <= 0:
            raise self._error("sigma", f"{self._spell('sigma')} is invalid: expected a finite number > 0 "
                              f"(the paper uses {self._spell('sigma', 1.5)}).", {"sigma": 1.5})
        if self.gate not in GATE_CHOICES:
            raise self._choice_error("gate", "a gate convention", GATE_CHOICES)
        if self.sampling not in SAMPLING_MODES:
            raise self._choice_error("sampling", "a sampling mode", SAMPLING_MODES)
        for name in ("enabled", "allow_off_center"):
            if not isinstance(getattr(self, name), bool):
                raise self._choice_error(name, "true or false", (True, False))
        if self.mode not in ROUTER_MODES:
            raise self._choice_error("mode", "a router mode", ROUTER_MODES)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise self._error("top_p", f"{self._spell('top_p')} is invalid: expected a number in (0, 1] "
                              f"(the paper's control uses {self._spell('top_p', 0.4)}).", {"top_p": 0.4})
        if self.top_p_max_experts is not None and (
            isinstance(self.top_p_max_experts, bool) or not isinstance(self.top_p_max_experts, int) or self.top_p_max_experts < 1
        ):
            raise self._error(
                "top_p_max_experts", f"{self._spell('top_p_max_experts')} is invalid: expected a positive integer, "
                f"or {self._spell('top_p_max_experts', None)} for no cap.", {"top_p_max_experts": None})
        try:
            layer_set = None if self.layers is None else parse_layers(self.layers)
        except ConfigError as error:
            raise self._error("layers", f"{self._spell('layers')}: {error}", {"layers": None}) from None
        object.__setattr__(self, "_layer_set", layer_set)
        # What can be checked without the model, so that a bad spec fails at start-up on every
        # rank; whether the range is centred on the model's top-k is checked in resolve().
        self._check_schedule_shape()
        if self.center is not None:
            self._check_schedule_around(self.center, None)

    # ------------------------------------------------------------------ messages
    def _spelling(self, name: str) -> Spelling:
        return self._spellings.get(name, PYTHON)

    def _spell(self, name: str, *value: Any) -> str:
        """``name`` with its current value (or ``value``) as the user writes it (:class:`Spelling`)."""
        return self._spelling(name).setting(name, value[0] if value else getattr(self, name))

    def _spell_fix(self, fix: Mapping[str, Any]) -> str:
        return " and ".join(self._spell(name, value) for name, value in fix.items())

    def _error(self, name: str, message: str, *fixes: dict[str, Any]) -> ConfigError:
        return ConfigError(message, field=name, fixes=fixes)

    def _choice_error(self, name: str, what: str, choices: tuple) -> ConfigError:
        fixes = [{name: choice} for choice in choices]
        return self._error(name, f"{self._spell(name)} is not {what}: expected one of "
                           f"{', '.join(self._spell_fix(fix) for fix in fixes)}.", *fixes)

    def _schedule_label(self) -> str:
        """The schedule as written, noting when it is the default (which the user never typed)."""
        label = self._spell("schedule")
        if "schedule" not in self._explicit:
            label += " (the default: the paper's range around top-8)"
        return label

    def _schedule_range(self) -> tuple[int, int] | None:
        """(low, high) of a range spec; None for ``static`` or a point mass."""
        return parse_range(self.schedule)

    def _check_schedule_shape(self) -> None:
        """Refuse a schedule no model accepts: unparsable, reversed, or with budgets below 1."""
        text = self.schedule.strip().lower()
        if text == "static" or text.isdigit():
            if text.isdigit() and int(text) < 1:
                raise self._error("schedule", f"{self._schedule_label()} is invalid: every token needs at least one "
                                  f"expert. Use {self._spell('schedule', 'static')} for the model's own top-k.",
                                  {"schedule": "static"})
            return
        bounds = self._schedule_range()
        if bounds is None:
            raise self._error(
                "schedule", f"{self._schedule_label()} does not parse: expected 'LOW-HIGH' (e.g. 6-10 around top-8), "
                f"'static', or the model's top-k. Use {self._spell('schedule', 'static')} to train stock top-k.",
                {"schedule": "static"})
        low, high = bounds
        if low > high:
            fix = {"schedule": f"{high}-{low}"}
            raise self._error("schedule", f"{self._schedule_label()} has low={low} > high={high}: write the range as "
                              f"LOW-HIGH, e.g. {self._spell_fix(fix)}.", fix)
        if low < 1:
            # The centre the user meant: theirs if set, else the middle of their range.
            center = self.center if self.center is not None else (low + high) // 2 if (low + high) % 2 == 0 else None
            fixes = ({"schedule": symmetric_range(center, (high - low) // 2)},) if center is not None and center >= 1 else ()
            hint = f" e.g. {self._spell_fix(fixes[0])} around top-{center}" if fixes else " e.g. 1-3 around top-2"
            raise self._error("schedule", f"{self._schedule_label()} is invalid: low={low}, but every token needs at "
                              f"least one expert, so low must be >= 1. Use a range symmetric around the model's "
                              f"top-k with low >= 1,{hint}.", *fixes)

    def _check_schedule_around(self, topk: int, num_experts: int | None) -> None:
        """Refuse a schedule that does not fit a model routing to top-``topk`` of ``num_experts``
        (None: unknown yet). Every fix suggested is a schedule this check accepts."""
        text = self.schedule.strip().lower()
        if text.isdigit() and int(text) != topk:
            raise self._error(
                "schedule", f"{self._schedule_label()} is a point mass at {text}, but the model routes to top-{topk}: "
                f"a static schedule must equal the model's top-k. Use {self._spell('schedule', 'static')}; to train "
                f"with more experts change the model's top-k instead.", {"schedule": "static"})
        bounds = self._schedule_range()
        if bounds is None:
            return
        low, high = bounds
        same_width = {"schedule": symmetric_range(topk, (high - low) // 2, num_experts)}
        if not low <= topk <= high:
            raise self._error(
                "schedule", f"{self._schedule_label()} does not contain the model's top-{topk}: a schedule is centred "
                f"on the model's top-k (low <= k <= high). Use {self._spell_fix(same_width)} (the same width around "
                f"top-{topk}, at least one expert per token).", same_width)
        if num_experts is not None and high > num_experts:
            raise self._error(
                "schedule", f"{self._schedule_label()} reaches budget {high}, but the model has only {num_experts} "
                f"experts: expected high <= {num_experts}. Use {self._spell_fix(same_width)}.", same_width)
        around_topk = BudgetSchedule(low, high, topk, self.sigma, allow_off_center=True)
        if not around_topk.is_symmetric and not self.allow_off_center:
            mean = around_topk.mean
            accept = {"allow_off_center": True}
            raise self._error(
                "schedule", f"{self._schedule_label()} around the model's top-{topk} has mean {mean:.4f}, not {topk}: "
                f"training would no longer be compute-matched with static top-{topk}. Use a range symmetric around "
                f"{topk} (low + high == {2 * topk}), e.g. {self._spell_fix(same_width)}, or set "
                f"{self._spell_fix(accept)} to accept it.", same_width, accept)
        if not around_topk.is_symmetric and self.sampling == "balanced":
            iid = {"sampling": "iid"}
            raise self._error(
                "sampling", f"{self._spell('sampling')} needs a schedule symmetric around the model's top-{topk}, got "
                f"{self._spell('schedule')}: use {self._spell_fix(iid)}, or {self._spell_fix(same_width)}.",
                iid, same_width)

    # ------------------------------------------------------------------ model binding
    def budget_schedule(self, model_topk: int) -> BudgetSchedule:
        """The :class:`BudgetSchedule` for a model whose deployment top-k is ``model_topk``."""
        center = self.center if self.center is not None else model_topk
        return BudgetSchedule.parse(self.schedule, center, self.sigma, allow_off_center=self.allow_off_center)

    def resolve(self, *, num_experts: int, topk: int, num_layers: int | None = None) -> BudgetSchedule:
        """Check this config against a model and return its schedule (the point mass at the
        model's top-k in ``mode="top_p"``, whose per-token budgets come from the probabilities).

        Raises:
            ConfigError: if the center is not the model's top-k, the schedule is not centred on it or
                reaches past ``num_experts``, ``top_p_max_experts`` exceeds it, or a selected layer
                index is >= ``num_layers``. ``error.fixes`` lists the changes the message suggests.
        """
        if self.mode == "top_p":
            # The budget is read off the probabilities, not sampled: the schedule does not apply.
            if self.top_p_max_experts is not None and self.top_p_max_experts > num_experts:
                fix = {"top_p_max_experts": num_experts}
                raise self._error(
                    "top_p_max_experts", f"{self._spell('top_p_max_experts')} exceeds the model's {num_experts} experts: "
                    f"expected at most {num_experts}, e.g. {self._spell_fix(fix)}, or "
                    f"{self._spell('top_p_max_experts', None)} for no cap.", fix, {"top_p_max_experts": None})
            schedule = BudgetSchedule.static(topk)
        else:
            if self.center is not None and self.center != topk:
                # the range moves with the center: keep its width around the model's top-k
                bounds = self._schedule_range()
                moved = {} if bounds is None else {"schedule": symmetric_range(topk, (bounds[1] - bounds[0]) // 2, num_experts)}
                fixes = ({"center": None, **moved}, {"center": topk, **moved})
                raise self._error(
                    "center", f"{self._spell('center')}, but the model routes to top-{topk}: the schedule's center "
                    f"must be the model's deployment top-k. Set {self._spell_fix(fixes[0])} (the model's top-k) or "
                    f"{self._spell_fix(fixes[1])}.", *fixes)
            self._check_schedule_around(topk, num_experts)
            try:
                schedule = self.budget_schedule(topk)
                schedule.validate_for(num_experts, topk)
            except ValueError as error:  # pragma: no cover - the checks above refuse it first
                raise ConfigError(str(error), field="schedule") from None
        if num_layers is not None and self._layer_set:
            outside = sorted(i for i in self._layer_set if i >= num_layers)
            if outside:
                inside = sorted(i for i in self._layer_set if i < num_layers)
                fixes = ({"layers": _layers_text(inside)},) if inside else ()
                fixes += ({"layers": None},)
                raise self._error(
                    "layers", f"{self._spell('layers')} selects layer(s) {outside}, but the model has {num_layers} "
                    f"decoder layers (0-based indices 0..{num_layers - 1}). Narrow the range"
                    + (f", e.g. {self._spell_fix(fixes[0])}" if inside else "")
                    + f", or set {self._spell('layers', None)} for every MoE layer.", *fixes)
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
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    # ------------------------------------------------------------------ loaders
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config",
                  spelling: Spelling | Mapping[str, Spelling] = PYTHON) -> "ElasticConfig":
        """Build from a mapping of field names; unknown keys are errors naming ``source``.

        ``spelling``: how the user wrote the values (one :class:`Spelling`, or one per field), so
        that messages show the setting and its fix in that form."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: expected a mapping of ElasticConfig fields, got {type(values).__name__}.")
        known = cls.field_names()
        unknown = [key for key in values if key not in known]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(hints)}. Accepted keys: {', '.join(known)}."
            )
        spellings = ({name: spelling for name in known} if isinstance(spelling, Spelling)
                     else {name: spelling.get(name, PYTHON) for name in known})
        try:
            with _spelled(spellings, frozenset(values)):
                return cls(**dict(values))
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}", field=error.field, fixes=error.fixes) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> "ElasticConfig":
        """Load from a YAML file (``yaml.safe_load``). The file may nest fields under ``elastic_moe:``."""
        return cls.from_dict(_read_yaml(path), source=str(path), spelling=Spelling("yaml"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ElasticConfig":
        """Load from ``ELASTIC_MOE_*`` variables (``ENV_VARS``), over ``ELASTIC_MOE_CONFIG``'s YAML.

        Unknown ``ELASTIC_MOE_*`` variables are errors: a typo must not silently train stock.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        config_file = environ.get(ENV_CONFIG_FILE)
        if config_file:
            values.update(_read_yaml(config_file))
        # a field the variables set is written as a variable; one from the file as a YAML key;
        # a default as the variable that would change it
        spellings = {name: Spelling("yaml") if name in values else Spelling("env") for name in ENV_VARS}
        known_vars = {name: var for name, var in ENV_VARS.items()}
        for key in environ:
            if (
                key.startswith(ENV_PREFIX)
                and key != ENV_CONFIG_FILE
                and key not in OPERATIONAL_ENV_VARS
                and key not in known_vars.values()
            ):
                close = difflib.get_close_matches(key, list(known_vars.values()) + [ENV_CONFIG_FILE], n=1)
                raise ConfigError(
                    f"environment variable {key} is not an elastic-moe setting"
                    + (f" (did you mean {close[0]}?)" if close else "")
                    + f". Accepted: {', '.join(sorted(known_vars.values()))}, {ENV_CONFIG_FILE}."
                )
        for name, var in known_vars.items():
            if var in environ:
                values[name] = _coerce(name, environ[var], source=var)
                spellings[name] = Spelling("env")
        return cls.from_dict(values, source="environment" if not config_file else f"environment (+ {config_file})",
                             spelling=spellings)


#: field name -> environment variable
ENV_VARS: dict[str, str] = {
    name: ENV_PREFIX + name.upper() for name in ElasticConfig.field_names()
}


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


def _coerce(name: str, text: str, *, source: str) -> Any:
    """Turn an environment/CLI string into the field's type, naming ``source`` on failure."""
    value = text.strip()
    if name in ("enabled", "allow_off_center"):
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ConfigError(f"{source}={text!r} is invalid: expected one of 1/0, true/false, yes/no, on/off.")
    if name == "center":
        if value.lower() in ("", "none", "auto"):
            return None
        if not value.isdigit():
            raise ConfigError(f"{source}={text!r} is invalid: expected a positive integer or 'auto' (the model's top-k).")
        return int(value)
    if name == "top_p_max_experts":
        if value.lower() in ("", "none", "all"):
            return None
        if not value.isdigit():
            raise ConfigError(f"{source}={text!r} is invalid: expected a positive integer or 'none'.")
        return int(value)
    if name in ("sigma", "top_p"):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{source}={text!r} is invalid: expected a number > 0 (e.g. 1.5).") from None
    if name == "layers":
        return None if value.lower() in ("", "all", "none") else value
    return value


def add_cli_arguments(parser: argparse.ArgumentParser, prefix: str = "--elastic-moe-") -> None:
    """Add one ``{prefix}<field>`` flag per ElasticConfig field (default: unset), plus ``{prefix}config``."""
    group = parser.add_argument_group("elastic-moe")
    group.add_argument(prefix + "config", dest="elastic_moe_config", default=None, help="YAML file of ElasticConfig fields")
    for name in ElasticConfig.field_names():
        group.add_argument(prefix + name.replace("_", "-"), dest="elastic_moe_" + name, default=None, metavar="VALUE",
                           help=f"ElasticConfig.{name} (env {ENV_VARS[name]})")


def config_from_cli(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ElasticConfig:
    """Merge defaults < YAML (``--elastic-moe-config`` or ``ELASTIC_MOE_CONFIG``) < environment < CLI flags."""
    environ = dict(os.environ if environ is None else environ)
    if getattr(args, "elastic_moe_config", None):
        environ[ENV_CONFIG_FILE] = args.elastic_moe_config
    base = ElasticConfig.from_env(environ)
    overrides = {
        name: _coerce(name, getattr(args, "elastic_moe_" + name), source="--elastic-moe-" + name.replace("_", "-"))
        for name in ElasticConfig.field_names()
        if getattr(args, "elastic_moe_" + name, None) is not None
    }
    if not overrides:
        return base
    # what the variables or the file set keeps their spelling; the rest is what a flag would change
    spellings = {name: base._spellings[name] if name in base._explicit and name not in overrides else Spelling("cli")
                 for name in ElasticConfig.field_names()}
    merged = {**{name: getattr(base, name) for name in base._explicit}, **overrides}
    return ElasticConfig.from_dict(merged, source="command line", spelling=spellings)
