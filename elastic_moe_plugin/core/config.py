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

This module holds the dataclass and its loaders. The checks are :mod:`.config_checks`'s (told by
:mod:`.config_refusals`), the reading of YAML, variables and flags :mod:`.config_sources`'s, and the
values each field accepts :mod:`.config_values`'s; their public names are importable from here too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# Besides what this module uses, the split modules' public names are imported here so that every
# `from elastic_moe_plugin.core.config import ...` written before the split keeps working.
from elastic_moe_plugin.core.config_checks import ConfigChecks
from elastic_moe_plugin.core.config_refusals import _BUILD, ModelShape, _Build, _building
from elastic_moe_plugin.core.config_sources import (
    ENV_CONFIG_FILE,
    OPERATIONAL_ENV_VARS,
    _command_line_values,
    _environment_values,
    _override_values,
    _read_yaml,
    _TextError,
    _unknown_keys,
    parse_text,
)
from elastic_moe_plugin.core.config_values import (
    ALL_LAYERS,
    AUTO_HALF_WIDTH,
    AUTO_SCHEDULE,
    BOOLEAN_FIELDS,
    DEFAULT_LOG_METRICS,
    GATE_CHOICES,
    LOG_METRICS_BOOLEANS,
    LOG_METRICS_CHOICES,
    ROUTER_MODES,
    GateConvention,
    LogMetrics,
    log_layout,
    parse_layers,
)
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.schedule import SAMPLING_MODES, BudgetSchedule, symmetric_range
from elastic_moe_plugin.core.spelling import CLI_PREFIX, ENV_PREFIX, NONE_WORDS, PYTHON, TYPED_KINDS, Spelling

#: what a resolved schedule is kept under: (num_experts, topk, num_layers, moe_layers, static_layers_note)
#: of ``resolve``
_ShapeKey = tuple[int | None, int, int | None, tuple[int, ...] | None, str | None]


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
        allow_uncovered_routers: the transformers door refuses a MoE model whose routers it cannot
            make elastic when the model is built (``False``, the default: never silently static);
            ``True`` builds it and keeps it static top-k on purpose.
        log_metrics: what the plugin's logging hooks write at a logging step (operational: routing
            is the same under every value): ``"layers"`` (the default) every layer's routing
            metrics and the layer means, where the framework logs per layer (transformers and
            ``swift sft`` always; Megatron with ``moe_per_layer_logging``, else the means);
            ``"means"`` the layer means only; ``"off"`` nothing, and Megatron-LM's log gets no hook.
            Text also reads the Megatron-LM entry point's old ``true`` / ``false`` (1/0, yes/no, on)
            as ``layers`` / ``off``. ``docs/diagnostics.md``: what each costs.
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
    allow_uncovered_routers: bool = False
    log_metrics: LogMetrics = DEFAULT_LOG_METRICS
    _layer_set: frozenset[int] | None = field(init=False, repr=False, compare=False)

    _spellings: Mapping[str, Spelling] = field(init=False, repr=False, compare=False)
    _explicit: frozenset[str] = field(init=False, repr=False, compare=False)
    # resolve()'s schedules by (num_experts, topk, num_layers): the config never changes, and the
    # metrics of every logging step resolve it again (the checks cost more than the log's reads)
    _resolved: dict[_ShapeKey, BudgetSchedule] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        build = _BUILD.get()
        if build is None:  # built in Python: the fields that differ from their defaults were set
            defaults = {f.name: f.default for f in dataclasses.fields(self) if f.init}
            build = _Build({}, frozenset(name for name, default in defaults.items() if getattr(self, name) != default))
        object.__setattr__(self, "_spellings", dict(build.spellings))
        object.__setattr__(self, "_explicit", build.explicit)
        object.__setattr__(self, "_resolved", {})
        checks = self._checks()
        checks.check_fields(build.model)
        object.__setattr__(self, "_layer_set", checks.layer_selection(build.model))
        checks.check_schedule(build.model)

    def _checks(self) -> ConfigChecks:
        return ConfigChecks(self, self._spellings, self._explicit)

    def spell(self, name: str, *value: Any) -> str:
        """The setting ``name`` as the user's entry point writes it: its current value as typed, or
        set to ``value`` (``ELASTIC_MOE_ENABLED=0``, ``--elastic-moe-enabled false``, ``enabled=False``)."""
        return self._checks().spell(name, *value)

    # ------------------------------------------------------------------ model binding
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

    def budget_schedule(self, model_topk: int, num_experts: int | None = None) -> BudgetSchedule:
        """The :class:`BudgetSchedule` for a model whose deployment top-k is ``model_topk`` (``"auto"``
        resolved within ``num_experts`` when given)."""
        center = self.center if self.center is not None else model_topk
        spec = self.schedule
        if self.schedule_from_model:
            spec = self.auto_range(center, num_experts) or "static"
        return BudgetSchedule.parse(spec, center, self.sigma, allow_off_center=self.allow_off_center)

    def resolve(
        self,
        *,
        num_experts: int | None,
        topk: int,
        num_layers: int | None = None,
        moe_layers: tuple[int, ...] | None = None,
        static_layers_note: str | None = None,
    ) -> BudgetSchedule:
        """Check this config against a model and return its schedule (the point mass at the
        model's top-k in ``mode="top_p"``, whose per-token budgets come from the probabilities).
        The config is immutable, so a shape that passed is not checked again: the schedule is
        kept per ``(num_experts, topk, num_layers)``.

        ``num_experts`` / ``num_layers`` None: not known (``elastic-moe schedule`` without ``--experts``);
        the checks that need them are left out. ``moe_layers``: the 0-based layer numbers that hold a
        router that can route elastically where only some do (a hybrid pattern's ``E`` layers,
        DeepSeek-V4's top-k layers); ``layers`` must select one of them. ``static_layers_note``:
        why the other MoE layers cannot (DeepSeek-V4: "layer(s) 0 are hash-routed: ..."), for the
        refusal; None where they hold no router.

        Raises:
            ConfigError: if the center is not the model's top-k, the schedule is not centred on it or
                reaches past ``num_experts``, ``"auto"`` finds no elastic range (top-1, top-E),
                ``top_p_max_experts`` exceeds the experts, a selected layer index is >= ``num_layers``,
                or ``layers`` selects none of ``moe_layers``.
                ``error.fixes`` lists the changes the message suggests, each accepted by this model.
        """
        key = (num_experts, topk, num_layers, moe_layers, static_layers_note)
        schedule = self._resolved.get(key)
        if schedule is None:
            shape = ModelShape(topk, num_experts, num_layers, moe_layers, static_layers_note)
            schedule = self._resolved[key] = self._checks().checked_schedule(shape)
        return schedule

    @property
    def layer_set(self) -> frozenset[int] | None:
        """The selected 0-based layer indices, or None for every MoE layer."""
        return self._layer_set

    def layer_is_elastic(self, layer_index: int) -> bool:
        """Whether the 0-based decoder layer ``layer_index`` routes elastically."""
        return self.enabled and (self._layer_set is None or layer_index in self._layer_set)

    def replace(self, **changes: Any) -> ElasticConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    # ------------------------------------------------------------------ loaders
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def from_dict(
        cls,
        values: Mapping[str, Any],
        *,
        source: str = "config",
        spelling: Spelling | Mapping[str, Spelling] = PYTHON,
        model: ModelShape | None = None,
    ) -> ElasticConfig:
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
        spellings = (
            dict.fromkeys(known, spelling)
            if isinstance(spelling, Spelling)
            else {name: spelling.get(name, PYTHON) for name in known}
        )
        unknown = [key for key in values if key not in known]
        if unknown:
            raise _unknown_keys(unknown, known, values, prefix, spellings)
        parsed: dict[str, Any] = {}
        for name, value in values.items():
            if spellings[name].reads_text and isinstance(value, str):
                if spellings[name].kind not in TYPED_KINDS:  # YAML and JSON values are typed: echo the parsed value
                    spellings[name] = spellings[name].typed_as(value)
                try:
                    value = parse_text(name, value, spellings[name])
                except _TextError as error:
                    fixes = cls._accepted_text_fixes(error, values, spellings, model)
                    raise ConfigError(f"{prefix}{error.message(fixes)}", field=name, fixes=fixes) from None
            elif spellings[name].kind in TYPED_KINDS and name == "log_metrics" and value in (True, False):
                value = LOG_METRICS_BOOLEANS[bool(value)]  # `log_metrics: off` is YAML's false, `true` its true
            elif spellings[name].kind in TYPED_KINDS and isinstance(value, int) and not isinstance(value, bool):
                # YAML typed the number; the user meant what the same text means in every entry point
                if name in ("layers", "schedule"):
                    value = str(value)  # `layers: 4` is the text '4'
                elif name in BOOLEAN_FIELDS and value in (0, 1):
                    value = bool(value)  # `enabled: 0`, as ELASTIC_MOE_ENABLED=0
            parsed[name] = value
        try:
            with _building(_Build(spellings, frozenset(values), model)):
                return cls(**parsed)
        except ConfigError as error:
            raise ConfigError(f"{prefix}{error}", field=error.field, fixes=error.fixes, renames=error.renames) from None

    @classmethod
    def _accepted_text_fixes(
        cls, error: _TextError, values: Mapping[str, Any], spellings: Mapping[str, Spelling], model: ModelShape | None
    ) -> tuple[dict, ...]:
        """The fixes of an unreadable text value that give settings the model (when known) accepts."""
        accepted = []
        for fix in error.fixes:
            trial_spellings = {**spellings, error.name: spellings[error.name].typed_as(None)}
            try:
                parsed = {
                    name: parse_text(name, value, trial_spellings[name])
                    if trial_spellings[name].reads_text and isinstance(value, str)
                    else value
                    for name, value in values.items()
                    if name != error.name
                }
                with _building(_Build(trial_spellings, frozenset(values), None, check_fixes=False)):
                    candidate = cls(**parsed, **fix)
                    if model is not None:
                        candidate.resolve(**model._asdict())
            except (ConfigError, _TextError):
                continue
            accepted.append(fix)
        return tuple(accepted)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, model: ModelShape | None = None) -> ElasticConfig:
        """Load from a YAML file (``yaml.safe_load``). The file may nest fields under ``elastic_moe:``."""
        return cls.from_dict(_read_yaml(path), source=str(path), spelling=Spelling("yaml"), model=model)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, model: ModelShape | None = None) -> ElasticConfig:
        """Load from ``ELASTIC_MOE_*`` variables (``ENV_VARS``), over ``ELASTIC_MOE_CONFIG``'s YAML.

        Unknown ``ELASTIC_MOE_*`` variables are errors: a typo must not silently train stock.
        ``model``: as in :meth:`from_dict`.
        """
        values, spellings, source = _environment_values(os.environ if environ is None else environ, ENV_VARS)
        return cls.from_dict(values, source=source, spelling=spellings, model=model)


#: field name -> environment variable
ENV_VARS: dict[str, str] = {name: ENV_PREFIX + name.upper() for name in ElasticConfig.field_names()}


def add_cli_arguments(parser: argparse.ArgumentParser, prefix: str = CLI_PREFIX) -> None:
    """Add one ``{prefix}<field>`` flag per ElasticConfig field (default: unset), plus ``{prefix}config``."""
    group = parser.add_argument_group("elastic-moe")
    group.add_argument(
        prefix + "config", dest="elastic_moe_config", default=None, help="YAML file of ElasticConfig fields"
    )
    choices = dict(gate=GATE_CHOICES, sampling=SAMPLING_MODES, mode=ROUTER_MODES, log_metrics=LOG_METRICS_CHOICES)
    for name in ElasticConfig.field_names():
        accepted = f": {', '.join(choices[name])}" if name in choices else ""
        group.add_argument(
            prefix + name.replace("_", "-"),
            dest="elastic_moe_" + name,
            default=None,
            metavar="VALUE",
            help=f"ElasticConfig.{name}{accepted} (env {ENV_VARS[name]})",
        )


def config_from_cli(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    *,
    model: ModelShape | None = None,
    prefix: str = CLI_PREFIX,
) -> ElasticConfig:
    """Merge defaults < YAML (``--elastic-moe-config`` or ``ELASTIC_MOE_CONFIG``) < environment < CLI flags.

    ``prefix``: the flags' prefix (:func:`add_cli_arguments`); ``model``: as in :meth:`ElasticConfig.from_dict`."""
    values, spellings, source = _command_line_values(args, environ, ENV_VARS, prefix)
    return ElasticConfig.from_dict(values, source=source, spelling=spellings, model=model)


def config_from_override(
    fields: Mapping[str, Any], environ: Mapping[str, str] | None = None, *, model: ModelShape | None = None
) -> ElasticConfig:
    """Merge defaults < YAML (the key ``"config"``, or ``ELASTIC_MOE_CONFIG``) < environment < ``fields``:
    the JSON keyword arguments of torchtitan's ``--override.imports`` entry
    (``'elastic_moe_plugin.titan.elastic_moe={"schedule": "6-10"}'``), spelled that way in messages.

    ``model``: as in :meth:`ElasticConfig.from_dict`."""
    values, spellings, source = _override_values(fields, environ, ENV_VARS)
    return ElasticConfig.from_dict(values, source=source, spelling=spellings, model=model)


__all__ = [
    "ALL_LAYERS",
    "AUTO_SCHEDULE",
    "ENV_CONFIG_FILE",
    "ENV_PREFIX",
    "ENV_VARS",
    "GATE_CHOICES",
    "LOG_METRICS_CHOICES",
    "NONE_WORDS",
    "OPERATIONAL_ENV_VARS",
    "PYTHON",
    "ROUTER_MODES",
    "ConfigError",
    "ElasticConfig",
    "ModelShape",
    "Spelling",
    "add_cli_arguments",
    "config_from_cli",
    "config_from_override",
    "log_layout",
    "parse_layers",
    "parse_text",
]
