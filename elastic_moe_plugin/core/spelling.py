"""How a user wrote a setting, and the one rule that renders a setting in that form.

Every entry point spells the same :class:`~elastic_moe_plugin.core.config.ElasticConfig` field
its own way; a message shows the refused setting and every fix it suggests in the form the user
typed, so the fix can be pasted where the setting came from:

=================  =====================================  ===========================================
kind               a setting                              where
=================  =====================================  ===========================================
``python``         ``schedule='6-10'``, ``layers=None``   ``ElasticConfig(...)``, ``from_dict``
``env``            ``ELASTIC_MOE_SCHEDULE=6-10``          ``from_env``, the ms-swift plugin
``yaml``           ``schedule: 6-10`` (``prefix``:        ``from_yaml``, ``ELASTIC_MOE_CONFIG``, a
                   ``elastic.schedule: 6-10``)            recipe's ``elastic:`` block
``cli``            ``--elastic-moe-schedule 6-10``        ``--elastic-moe-*`` flags (``prefix``
                                                          replaces ``--elastic-moe-``, e.g. ``--``)
``schedule_cli``   ``elastic-moe schedule 6-10``,         ``elastic-moe schedule`` (the spec is its
                   ``--sigma 1.5``, ``--allow-off-center``  positional argument)
``override``       ``"schedule": "6-10"``                 the JSON keyword arguments of torchtitan's
                                                          ``--override.imports`` entry
                                                          (``elastic_moe_plugin.titan.elastic_moe``)
=================  =====================================  ===========================================

Values are written as the entry point reads them back: ``None`` as the word that means it
(:data:`NONE_WORDS`: ``auto``, ``all``, ``none``; ``None`` in Python), booleans as ``1``/``0``
(environment), ``true``/``false`` (flags, YAML, JSON) or ``True``/``False`` (Python), and text quoted for
a shell (environment, flags), for YAML where it would otherwise read as another type, or as a JSON string. The
current value of a setting read from text is echoed as typed (``ELASTIC_MOE_SIGMA=0``, not ``0.0``).
Nothing here imports a framework.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Literal

ENV_PREFIX = "ELASTIC_MOE_"
CLI_PREFIX = "--elastic-moe-"
#: fields whose ``None`` is written as a word in every text entry point (environment, flags, YAML)
NONE_WORDS: dict[str, str] = {"center": "auto", "layers": "all", "top_p_max_experts": "none"}
#: ``elastic-moe schedule``'s spelling of the fields it takes (the spec is its positional argument)
SCHEDULE_CLI_FLAGS: dict[str, str] = {"sigma": "--sigma", "allow_off_center": "--allow-off-center"}

SpellingKind = Literal["python", "env", "yaml", "cli", "schedule_cli", "override"]
TEXT_KINDS: frozenset[str] = frozenset({"env", "yaml", "cli", "schedule_cli", "override"})
#: the kinds whose values arrive typed by their parser (YAML, JSON): a number there means its text
TYPED_KINDS: frozenset[str] = frozenset({"yaml", "override"})


@dataclass(frozen=True)
class Spelling:
    """How the user wrote one setting.

    Attributes:
        kind: the entry point's form (module docstring).
        prefix: ``yaml``: put before the key (``"elastic."``); ``cli``: replaces ``--elastic-moe-``
            (``"--"`` for a tool whose flags are ``--schedule``).
        typed: the value as the user typed it (environment or command-line text), echoed as the
            current value; None where the value was not text.
    """

    kind: SpellingKind = "python"
    prefix: str = ""
    typed: str | None = None

    @property
    def reads_text(self) -> bool:
        """Whether this entry point hands over text, which :func:`~elastic_moe_plugin.core.config.parse_text`
        turns into the field's value (every kind but ``python``)."""
        return self.kind in TEXT_KINDS

    @property
    def verb(self) -> str:
        """How a message asks for a fix: ``set X`` (a value), ``pass X`` (an ``elastic-moe schedule`` flag)."""
        return "pass" if self.kind == "schedule_cli" else "set"

    def typed_as(self, text: str | None) -> Spelling:
        return Spelling(self.kind, self.prefix, text)

    def name(self, name: str) -> str:
        """The setting's name alone: ``ELASTIC_MOE_SCHEDULE``, ``--elastic-moe-schedule``, ``schedule``."""
        if self.kind == "env":
            return ENV_PREFIX + name.upper()
        if self.kind == "cli":
            return (self.prefix or CLI_PREFIX) + name.replace("_", "-")
        if self.kind == "schedule_cli":
            return (
                "the SPEC argument of elastic-moe schedule"
                if name == "schedule"
                else SCHEDULE_CLI_FLAGS.get(name, "--" + name.replace("_", "-"))
            )
        if self.kind == "override":
            return json.dumps(name)
        return f"{self.prefix}{name}" if self.kind == "yaml" else name

    def setting(self, name: str, value: Any) -> str:
        """``name`` set to ``value``, as this entry point writes it."""
        if self.kind == "env":
            return f"{self.name(name)}={_shell(_word(name, value, true='1', false='0'))}"
        if self.kind == "cli":
            return f"{self.name(name)} {_shell(_word(name, value, true='true', false='false'))}"
        if self.kind == "yaml":
            return f"{self.name(name)}: {_yaml_scalar(name, value)}"
        if self.kind == "override":
            written = NONE_WORDS.get(name) if value is None else value
            return f"{self.name(name)}: {json.dumps(written)}"
        if self.kind == "schedule_cli":
            if name == "schedule":
                return f"elastic-moe schedule {_shell(str(value))}"
            if isinstance(value, bool):
                flag = self.name(name)
                return flag if value else f"no {flag}"
            return f"{self.name(name)} {_shell(_word(name, value, true='true', false='false'))}"
        return f"{name}={value!r}"

    def current(self, name: str, value: Any) -> str:
        """The setting as the user wrote it: the typed text where there is one, else :meth:`setting`."""
        if self.typed is None:
            return self.setting(name, value)
        if self.kind == "env":
            return f"{self.name(name)}={_shell(self.typed)}"
        if self.kind == "cli" or (self.kind == "schedule_cli" and name != "schedule"):
            return f"{self.name(name)} {_shell(self.typed)}"
        if self.kind == "schedule_cli":
            return f"elastic-moe schedule {_shell(self.typed)}"
        return self.setting(name, value)

    def unset(self, name: str) -> str:
        """The setting left out: ``ELASTIC_MOE_SCHEDULE unset``, ``no --elastic-moe-schedule``."""
        if self.kind == "schedule_cli" and name == "schedule":
            return "no SPEC given to elastic-moe schedule"
        if self.kind in ("cli", "schedule_cli"):
            return f"no {self.name(name)}"
        if self.kind in ("yaml", "override"):
            return f"no {self.name(name)} key"
        return f"{self.name(name)} unset"


PYTHON = Spelling()


def _word(name: str, value: Any, *, true: str, false: str) -> str:
    if value is None:
        return NONE_WORDS.get(name, "none")
    if isinstance(value, bool):
        return true if value else false
    return str(value)


def _shell(text: str) -> str:
    """``text`` as one shell word (``6-10`` stays bare; ``''`` for empty; quotes for spaces)."""
    return shlex.quote(text)


def _yaml_scalar(name: str, value: Any) -> str:
    """``value`` as a YAML scalar that reads back as the same value: words for ``None``, quotes for
    text YAML would read as a number or a boolean (``layers: '4'``)."""
    import yaml

    if value is None:
        return NONE_WORDS.get(name, "null")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        if yaml.safe_load(value) != value or not value or value.strip() != value:
            return "'" + value.replace("'", "''") + "'"
        return value
    return str(value)


__all__ = [
    "CLI_PREFIX",
    "ENV_PREFIX",
    "NONE_WORDS",
    "PYTHON",
    "SCHEDULE_CLI_FLAGS",
    "TYPED_KINDS",
    "Spelling",
    "SpellingKind",
]
