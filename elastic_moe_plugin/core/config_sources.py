"""Where a config's values come from besides Python: YAML files, ``ELASTIC_MOE_*`` environment
variables and ``--elastic-moe-*`` flags, and the one rule their text is read by (:func:`parse_text`).

Each reader hands back the values as written and how each was written (a :class:`Spelling`), so
that :meth:`~elastic_moe_plugin.core.config.ElasticConfig.from_dict` validates them the same way for
every entry point and its messages show each setting in the form it came in. A name that is no
setting (a variable, a key) is an error, never ignored: a typo must not silently train stock.

The field names come in as arguments (``env_vars``: field name -> variable, ``known``): the config
module imports this one, never the reverse.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.config_values import ALL_LAYERS, BOOLEAN_FIELDS, LOG_METRICS_BOOLEANS, LOG_METRICS_CHOICES
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.spelling import CLI_PREFIX, ENV_PREFIX, Spelling

ENV_CONFIG_FILE = "ELASTIC_MOE_CONFIG"
#: ``ELASTIC_MOE_*`` variables that steer the adapters, not the routing; not ElasticConfig fields
OPERATIONAL_ENV_VARS: frozenset[str] = frozenset(
    {
        "ELASTIC_MOE_ALLOW_UNSUPPORTED_MCORE",  # try an untested megatron-core
        "ELASTIC_MOE_ALLOW_UNSUPPORTED_TRANSFORMERS",  # try an untested transformers
        "ELASTIC_MOE_ALLOW_UNSUPPORTED_TORCHTITAN",  # try an untested torchtitan
        "ELASTIC_MOE_DEBUG",  # assert dispatcher invariants (syncs)
        "ELASTIC_MOE_SWIFT_HOOK",  # 0: the ms-swift --plugin start-up hook stands aside
    }
)

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


# ---------------------------------------------------------------------------------- text
def parse_text(name: str, text: str, spelling: Spelling) -> Any:
    """The value of field ``name`` written as ``text`` (environment, flag or YAML string): the one
    rule every text entry point reads with. Words: ``auto`` (``center``), ``all`` / empty
    (``layers``), ``none`` / ``all`` (``top_p_max_experts``), 1/0, true/false, yes/no, on/off
    (booleans; for ``log_metrics`` the old spellings of ``layers`` / ``off``), numbers for ``sigma``
    and ``top_p``; other fields keep the text.

    Raises:
        ConfigError: text that is none of those, naming the setting as typed and the fixes.
    """
    value = text.strip()
    spelled = spelling.typed_as(text)
    if name in BOOLEAN_FIELDS:
        return _parse_boolean(name, text, value, spelled)
    if name == "center":
        return _parse_center(name, text, value, spelled)
    if name == "top_p_max_experts":
        return _parse_expert_cap(name, text, value, spelled)
    if name in ("sigma", "top_p"):
        return _parse_number(name, text, value, spelled)
    if name == "layers" and value.lower() in ("", ALL_LAYERS):
        return None
    if name == "log_metrics":
        return _parse_log_metrics(value)
    return value


def _parse_log_metrics(value: str) -> str:
    """``log_metrics``: ``layers`` / ``means`` / ``off`` in any case, and the booleans of the Megatron-LM
    entry point's old ``--elastic-moe-log-metrics true|false`` (true: ``layers``, false: ``off``);
    anything else is kept, for the choice check to refuse with every choice."""
    word = value.lower()
    if word in LOG_METRICS_CHOICES:
        return word
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return LOG_METRICS_BOOLEANS[word in TRUE_WORDS]
    return value


def _parse_boolean(name: str, text: str, value: str, spelled: Spelling) -> bool:
    """``enabled`` or ``allow_off_center``: 1/0, true/false, yes/no, on/off, in any case."""
    if value.lower() in TRUE_WORDS:
        return True
    if value.lower() in FALSE_WORDS:
        return False
    raise _TextError(
        name,
        spelled,
        lambda fixes: (
            f"{spelled.current(name, text)} is invalid: expected {'/'.join(TRUE_WORDS[:2])} or "
            f"{'/'.join(FALSE_WORDS[:2])} (also yes/no, on/off): " + _boolean_hint(name, spelled, fixes) + "."
        ),
        ({name: True}, {name: False}),
    )


def _parse_center(name: str, text: str, value: str, spelled: Spelling) -> int | None:
    """``center``: ``auto`` (or empty, ``none``) is the model's own top-k."""
    if value.lower() in ("", "none", "auto"):
        return None
    if not value.isdigit():
        raise _TextError(
            name,
            spelled,
            lambda fixes: (
                f"{spelled.current(name, text)} is invalid: expected a positive integer (the model's top-k) or "
                f"'auto'. Use {_either(spelled, name, fixes)} to centre on the model's own top-k."
            ),
            ({name: None},),
        )
    return int(value)


def _parse_expert_cap(name: str, text: str, value: str, spelled: Spelling) -> int | None:
    """``top_p_max_experts``: ``none`` (or empty, ``all``) is no cap."""
    if value.lower() in ("", "none", "all"):
        return None
    if not value.isdigit():
        raise _TextError(
            name,
            spelled,
            lambda fixes: (
                f"{spelled.current(name, text)} is invalid: expected a positive integer or 'none'. Use "
                f"{_either(spelled, name, fixes)} for no cap."
            ),
            ({name: None},),
        )
    return int(value)


def _parse_number(name: str, text: str, value: str, spelled: Spelling) -> float:
    """``sigma`` or ``top_p``; their ranges are checked with the other settings, not here."""
    try:
        return float(value)
    except ValueError:
        default = {"sigma": 1.5, "top_p": 0.4}[name]
        what = "a finite number > 0" if name == "sigma" else "a number in (0, 1]"
        raise _TextError(
            name,
            spelled,
            lambda fixes: (
                f"{spelled.current(name, text)} is invalid: expected {what}, e.g. {_either(spelled, name, fixes)} "
                f"(the paper's value)."
            ),
            ({name: default},),
        ) from None


def _boolean_hint(name: str, spelling: Spelling, fixes: tuple[dict, ...]) -> str:
    meaning = {
        ("enabled", True): "to route elastically",
        ("enabled", False): "to leave every router stock",
        ("allow_off_center", True): "to accept a schedule whose mean is not the model's top-k",
        ("allow_off_center", False): "to refuse one",
        ("allow_uncovered_routers", True): "to keep a MoE model the plugin cannot make elastic static on purpose",
        ("allow_uncovered_routers", False): "to refuse it when it is built",
    }
    return ", ".join(f"{spelling.setting(name, fix[name])} {meaning[(name, fix[name])]}" for fix in fixes)


def _either(spelling: Spelling, name: str, fixes: tuple[dict, ...]) -> str:
    return " or ".join(spelling.setting(name, fix[name]) for fix in fixes)


class _TextError(Exception):
    """A text value :func:`parse_text` cannot read; the loader turns it into a :class:`ConfigError`
    once its fixes are validated against the other settings (and the model, when known)."""

    def __init__(
        self, name: str, spelling: Spelling, message: Callable[[tuple[dict, ...]], str], fixes: tuple[dict, ...]
    ) -> None:
        super().__init__(name)
        self.name, self.spelling, self.message, self.fixes = name, spelling, message, fixes

    def as_config_error(self, accepted: tuple[dict, ...]) -> ConfigError:
        return ConfigError(self.message(accepted), field=self.name, fixes=accepted)


# ---------------------------------------------------------------------------------- unknown names
def _unknown_keys(
    unknown: list, known: tuple[str, ...], values: Mapping[str, Any], prefix: str, spellings: Mapping[str, Spelling]
) -> ConfigError:
    """The error for keys of a mapping that are no field (``known``), offering the closest field as a
    rename where it is not set already."""
    hints, fixes, renames = [], [], {}
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if close and close[0] not in values:
            renames[str(key)] = close[0]
            fixes.append({close[0]: values[key]})
    rename = "".join(
        f" Rename it: {spellings[name].setting(name, value)}." for fix in fixes for name, value in fix.items()
    )
    return ConfigError(
        f"{prefix}unknown key(s) {', '.join(hints)}. Accepted keys: {', '.join(known)}.{rename}",
        fixes=tuple(fixes),
        renames=renames,
    )


def _unknown_variable(key: str, environ: Mapping[str, str], env_vars: Mapping[str, str]) -> ConfigError:
    close = difflib.get_close_matches(key, list(env_vars.values()) + [ENV_CONFIG_FILE], n=1)
    fixes: tuple[dict[str, str], ...] = ()
    renames: dict[str, str] = {}
    rename = ""
    if close and close[0] != ENV_CONFIG_FILE and close[0] not in environ:
        name = close[0][len(ENV_PREFIX) :].lower()
        fixes, renames = ({name: environ[key]},), {key: close[0]}
        rename = f" Rename it: {Spelling('env').setting(name, environ[key])}."
    return ConfigError(
        f"environment variable {key} is not an elastic-moe setting"
        + (f" (did you mean {close[0]}?)" if close else "")
        + f". Accepted: {', '.join(sorted(env_vars.values()))}, {ENV_CONFIG_FILE}.{rename}",
        fixes=fixes,
        renames=renames,
    )


# ---------------------------------------------------------------------------------- sources
def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist. Check the path (ELASTIC_MOE_CONFIG or --elastic-moe-config)."
        )
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if isinstance(data, dict) and "elastic_moe" in data and len(data) == 1:
        data = data["elastic_moe"]
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of ElasticConfig fields, got {type(data).__name__}.")
    return data


def _environment_values(
    environ: Mapping[str, str], env_vars: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, Spelling], str]:
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
    spellings = {name: Spelling("yaml") if name in values else Spelling("env") for name in env_vars}
    stray = [
        key
        for key in environ
        if key.startswith(ENV_PREFIX)
        and key != ENV_CONFIG_FILE
        and key not in OPERATIONAL_ENV_VARS
        and key not in env_vars.values()
    ]
    if stray:
        raise _unknown_variable(stray[0], environ, env_vars)
    for name, var in env_vars.items():
        if var in environ:
            values[name] = environ[var]
            spellings[name] = Spelling("env")
    return values, spellings, "environment" if not config_file else f"environment (+ {config_file})"


def _command_line_values(
    args: argparse.Namespace, environ: Mapping[str, str] | None, env_vars: Mapping[str, str], prefix: str = CLI_PREFIX
) -> tuple[dict[str, Any], dict[str, Spelling], str]:
    """(values, spellings, source) of defaults < YAML (``--elastic-moe-config`` or ``ELASTIC_MOE_CONFIG``)
    < environment < the flags of ``add_cli_arguments`` (``prefix``), unparsed."""
    environ = dict(os.environ if environ is None else environ)
    if getattr(args, "elastic_moe_config", None):
        environ[ENV_CONFIG_FILE] = args.elastic_moe_config
    values, spellings, source = _environment_values(environ, env_vars)
    cli = Spelling("cli", "" if prefix == CLI_PREFIX else prefix)
    overrides = {
        name: getattr(args, "elastic_moe_" + name)
        for name in env_vars
        if getattr(args, "elastic_moe_" + name, None) is not None
    }
    # what the variables or the file set keeps their spelling; the rest is what a flag would change
    for name in env_vars:
        if name in overrides or name not in values:
            spellings[name] = cli
    if overrides or not values:
        source = "command line"
    return {**values, **overrides}, spellings, source


#: the key of torchtitan's override arguments that names a YAML file (as ``--elastic-moe-config``)
OVERRIDE_CONFIG_KEY = "config"


def _override_values(
    fields: Mapping[str, Any], environ: Mapping[str, str] | None, env_vars: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, Spelling], str]:
    """(values, spellings, source) of defaults < YAML (``fields["config"]`` or ``ELASTIC_MOE_CONFIG``)
    < environment < the other ``fields`` (torchtitan's override arguments, typed by JSON), unparsed."""
    environ = dict(os.environ if environ is None else environ)
    if fields.get(OVERRIDE_CONFIG_KEY):
        environ[ENV_CONFIG_FILE] = str(fields[OVERRIDE_CONFIG_KEY])
    values, spellings, source = _environment_values(environ, env_vars)
    overrides = {name: value for name, value in fields.items() if name != OVERRIDE_CONFIG_KEY}
    for name in env_vars:
        if name in overrides or name not in values:
            spellings[name] = Spelling("override")
    if overrides or not values:
        source = "torchtitan --override.imports"
    return {**values, **overrides}, spellings, source
