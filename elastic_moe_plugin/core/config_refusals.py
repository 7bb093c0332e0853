"""How a refused :class:`~elastic_moe_plugin.core.config.ElasticConfig` is told: the setting spelled as
the user wrote it (:mod:`.spelling`), and the fixes the message offers, each validated first.

A fix is offered only if the config with it applied is accepted, by the model too when it is known
(:class:`ModelShape`): pasting a suggested fix must never meet a second refusal. Validating a fix
builds a candidate config, whose own refusals then list their fixes unvalidated (:class:`_Build`
``check_fixes``), so that a check never recurses. What to refuse is :mod:`.config_checks`'s job.

The config module imports this one, never the reverse (``tests/test_architecture.py`` refuses the
cycle): a refusal reaches the config only through the instance it is handed, its fields and public
methods, and builds a candidate with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from elastic_moe_plugin.core.config_values import AUTO_HALF_WIDTH, AUTO_SCHEDULE
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.spelling import PYTHON, Spelling


class ModelShape(NamedTuple):
    """What a config is checked against: a router's top-k, its routed experts, the model's decoder
    layers and, where only some of them route elastically (a hybrid pattern, DeepSeek-V4's
    hash-routed first layers), the 0-based layer numbers of those that do (``None``: not known, or
    every layer may hold a router), with why the other MoE layers cannot (``static_layers_note``;
    None where the others hold no router)."""

    topk: int
    num_experts: int | None = None
    num_layers: int | None = None
    moe_layers: tuple[int, ...] | None = None
    static_layers_note: str | None = None

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


# The dataclass's __init__ takes only its fields: how they were written reaches __post_init__ here.
_BUILD: contextvars.ContextVar[_Build | None] = contextvars.ContextVar("elastic_moe_config_build", default=None)


@contextlib.contextmanager
def _building(build: _Build) -> Iterator[None]:
    token = _BUILD.set(build)
    try:
        yield
    finally:
        _BUILD.reset(token)


# ---------------------------------------------------------------------------------- refusals
class Refusals:
    """The refusals of one config: its settings spelled as the user wrote them, and validated fixes.

    ``config``: the ``ElasticConfig`` being checked (not imported, see the module docstring);
    ``spellings``: how the user wrote each field (unlisted: as in Python); ``explicit``: the fields
    the user set (a default is spelled as the setting that would change it).
    """

    def __init__(self, config: Any, spellings: Mapping[str, Spelling], explicit: frozenset[str]) -> None:
        self.config, self.spellings, self.explicit = config, spellings, explicit

    # ------------------------------------------------------------------ spelling
    def _spelling(self, name: str) -> Spelling:
        return self.spellings.get(name, PYTHON)

    def spell(self, name: str, *value: Any) -> str:
        """``name`` with its current value as the user wrote it, or set to ``value``."""
        spelling = self._spelling(name)
        if value:
            return spelling.setting(name, value[0])
        return spelling.current(name, getattr(self.config, name))

    def _spell_fix(self, fix: Mapping[str, Any]) -> str:
        return " and ".join(self.spell(name, value) for name, value in fix.items())

    def _spell_fixes(self, fixes: tuple[dict, ...], joiner: str = " or ") -> str:
        return joiner.join(self._spell_fix(fix) for fix in fixes)

    def _verb(self, fix: Mapping[str, Any]) -> str:
        return self._spelling(next(iter(fix))).verb

    def _schedule_label(self) -> str:
        """The schedule as written; for the default, which the user never typed, the variable unset."""
        if "schedule" in self.explicit:
            return self.spell("schedule")
        return (
            f"{self._spelling('schedule').unset('schedule')} (the default, {AUTO_SCHEDULE!r}: "
            f"k-{AUTO_HALF_WIDTH}..k+{AUTO_HALF_WIDTH} around the model's top-k)"
        )

    # ------------------------------------------------------------------ fixes
    def _accepts(self, fix: Mapping[str, Any], model: ModelShape | None) -> bool:
        """Whether these settings with ``fix`` applied are accepted (by the model, when known)."""
        build = _Build(self.spellings, self.explicit | frozenset(fix), None, check_fixes=False)
        with _building(build):
            try:
                candidate = dataclasses.replace(self.config, **fix)
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

    def _refuse(
        self,
        name: str,
        message: Callable[[tuple[dict, ...]], str],
        candidates: list[dict],
        model: ModelShape | None,
        limit: int = 2,
    ) -> ConfigError:
        """The error refusing field ``name``: ``message`` told the accepted ``candidates`` (``limit`` at most)."""
        fixes = self._accepted(candidates, model, limit)
        return ConfigError(message(fixes), field=name, fixes=fixes)

    def _use(self, fixes: tuple[dict, ...], what: str = "") -> str:
        """``"Use A (what), or B."``, or a plain sentence when no fix is accepted."""
        if not fixes:
            return "No single change of this setting is accepted; see the other settings."
        first = self._spell_fix(fixes[0]) + (f" ({what})" if what else "")
        rest = "".join(f", or {self._spell_fix(fix)}" for fix in fixes[1:])
        return f"Use {first}{rest}."
