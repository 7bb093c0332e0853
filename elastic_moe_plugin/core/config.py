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
import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.schedule import SAMPLING_MODES, BudgetSchedule

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
})

_LAYER_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


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

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, str) or not self.schedule.strip():
            raise ConfigError(
                f"schedule={self.schedule!r} is invalid: expected 'LOW-HIGH' (e.g. '6-10'), 'static' or "
                f"the integer center."
            )
        if self.center is not None and (isinstance(self.center, bool) or not isinstance(self.center, int) or self.center < 1):
            raise ConfigError(
                f"center={self.center!r} is invalid: expected a positive integer (the model's top-k) or "
                f"None to use the model's top-k."
            )
        if isinstance(self.sigma, bool) or not isinstance(self.sigma, (int, float)) or not math.isfinite(self.sigma) or self.sigma <= 0:
            raise ConfigError(f"sigma={self.sigma!r} is invalid: expected a finite number > 0 (the paper uses 1.5).")
        if self.gate not in GATE_CHOICES:
            raise ConfigError(f"gate={self.gate!r} is not a gate convention: expected one of {GATE_CHOICES}.")
        if self.sampling not in SAMPLING_MODES:
            raise ConfigError(f"sampling={self.sampling!r} is not a sampling mode: expected one of {SAMPLING_MODES}.")
        for name in ("enabled", "allow_off_center"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: expected true or false.")
        if self.mode not in ROUTER_MODES:
            raise ConfigError(f"mode={self.mode!r} is not a router mode: expected one of {ROUTER_MODES}.")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p!r} is invalid: expected a number in (0, 1] (the paper's control uses 0.4).")
        if self.top_p_max_experts is not None and (
            isinstance(self.top_p_max_experts, bool) or not isinstance(self.top_p_max_experts, int) or self.top_p_max_experts < 1
        ):
            raise ConfigError(
                f"top_p_max_experts={self.top_p_max_experts!r} is invalid: expected a positive integer, or None for no cap."
            )
        layer_set = None if self.layers is None else parse_layers(self.layers)
        object.__setattr__(self, "_layer_set", layer_set)
        # Validate the schedule's own shape now, so a bad spec fails at start-up on every rank;
        # a provisional center is the midpoint of a range, the model's top-k arrives in resolve().
        try:
            self.budget_schedule(self.center if self.center is not None else self._provisional_center())
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def _provisional_center(self) -> int:
        text = self.schedule.strip().lower()
        if text == "static":
            return 1
        if "-" in text:
            low, _, high = text.partition("-")
            if low.strip().isdigit() and high.strip().isdigit():
                if self.allow_off_center:
                    return int(low)
                return max(1, (int(low) + int(high)) // 2)
        return int(text) if text.isdigit() else 1

    # ------------------------------------------------------------------ model binding
    def budget_schedule(self, model_topk: int) -> BudgetSchedule:
        """The :class:`BudgetSchedule` for a model whose deployment top-k is ``model_topk``."""
        center = self.center if self.center is not None else model_topk
        return BudgetSchedule.parse(self.schedule, center, self.sigma, allow_off_center=self.allow_off_center)

    def resolve(self, *, num_experts: int, topk: int, num_layers: int | None = None) -> BudgetSchedule:
        """Check this config against a model and return its schedule (the point mass at the
        model's top-k in ``mode="top_p"``, whose per-token budgets come from the probabilities).

        Raises:
            ConfigError: if the center is not the model's top-k, the schedule reaches past
                ``num_experts``, ``top_p_max_experts`` exceeds it, or a selected layer index is
                >= ``num_layers``.
        """
        if self.mode == "top_p":
            # The budget is read off the probabilities, not sampled: the schedule does not apply.
            if self.top_p_max_experts is not None and self.top_p_max_experts > num_experts:
                raise ConfigError(
                    f"top_p_max_experts={self.top_p_max_experts} exceeds the model's {num_experts} experts: "
                    f"expected at most {num_experts}, or None for no cap."
                )
            schedule = BudgetSchedule.static(topk)
        else:
            try:
                schedule = self.budget_schedule(topk)
                schedule.validate_for(num_experts, topk)
            except ValueError as error:
                raise ConfigError(str(error)) from None
        if num_layers is not None and self._layer_set:
            outside = sorted(i for i in self._layer_set if i >= num_layers)
            if outside:
                raise ConfigError(
                    f"layers={self.layers!r} selects layer(s) {outside}, but the model has {num_layers} "
                    f"decoder layers (0-based indices 0..{num_layers - 1}). Narrow the range."
                )
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
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> "ElasticConfig":
        """Build from a mapping of field names; unknown keys are errors naming ``source``."""
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
        try:
            return cls(**dict(values))
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> "ElasticConfig":
        """Load from a YAML file (``yaml.safe_load``). The file may nest fields under ``elastic_moe:``."""
        return cls.from_dict(_read_yaml(path), source=str(path))

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
        return cls.from_dict(values, source="environment" if not config_file else f"environment (+ {config_file})")


#: field name -> environment variable
ENV_VARS: dict[str, str] = {
    name: ENV_PREFIX + name.upper() for name in ElasticConfig.field_names()
}


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
    return ElasticConfig.from_dict({**base.to_dict(), **overrides}, source="command line")
