"""The checks of an :class:`~elastic_moe_plugin.core.config.ElasticConfig`: what is refused, and why.

A config's values are checked on their own at construction (types, choices, a ``layers`` spec, a
schedule that no model accepts), and against the shape of a model (:class:`ModelShape`) when an
adapter meets it in ``resolve()``, or at construction when the loader knows it. Each refusal is
told by :class:`~elastic_moe_plugin.core.config_refusals.Refusals`: the setting as the user wrote
it, what is accepted, and fixes validated before they are offered. The ``layers`` checks are
:mod:`.config_layer_checks`'s, inherited here.

The config module imports this one, never the reverse: a check reads the config it is handed.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

from elastic_moe_plugin.core.config_layer_checks import LayerChecks
from elastic_moe_plugin.core.config_refusals import ModelShape
from elastic_moe_plugin.core.config_values import (
    AUTO_HALF_WIDTH,
    AUTO_SCHEDULE,
    BOOLEAN_FIELDS,
    GATE_CHOICES,
    LOG_METRICS_CHOICES,
    ROUTER_MODES,
)
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.schedule import SAMPLING_MODES, BudgetSchedule, parse_range, symmetric_range


def _is_number(value: Any) -> bool:
    # bool is an int to Python, but `sigma=True` is a mistake, not 1.0
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _is_positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


#: what a ``schedule`` may be written as, told by the refusals of one that does not parse
_SCHEDULE_FORMS = (
    f"{AUTO_SCHEDULE!r} (k-{AUTO_HALF_WIDTH}..k+{AUTO_HALF_WIDTH} around the model's top-k), 'LOW-HIGH' "
    f"(e.g. 6-10 around top-8), 'static' or the model's top-k"
)


# ---------------------------------------------------------------------------------- the checks
class ConfigChecks(LayerChecks):
    """The checks of one config: what is refused, and why (:class:`LayerChecks`: those of ``layers``;
    :class:`~.config_refusals.Refusals`: how it is told)."""

    # ------------------------------------------------------------------ construction checks
    def check_fields(self, model: ModelShape | None) -> None:
        """Refuse a field of the wrong type, or outside its range or its choices: each is refused on
        its own, before any check that combines fields reads it."""
        config = self.config
        if not isinstance(config.schedule, str) or not config.schedule.strip():
            raise self._invalid(
                "schedule", _SCHEDULE_FORMS, [{"schedule": AUTO_SCHEDULE}, {"schedule": "static"}], model
            )
        if config.center is not None and not _is_positive_int(config.center):
            expected = "a positive integer (the model's top-k)"
            raise self._invalid("center", expected, [{"center": None}], model, "the model's own top-k")
        if not _is_number(config.sigma) or not math.isfinite(config.sigma) or config.sigma <= 0:
            raise self._invalid("sigma", "a finite number > 0", [{"sigma": 1.5}], model, "the paper's σ")
        self._check_choices(model)
        if not _is_number(config.top_p) or not 0.0 < config.top_p <= 1.0:
            raise self._invalid("top_p", "a number in (0, 1]", [{"top_p": 0.4}], model, "the paper's control")
        if config.top_p_max_experts is not None and not _is_positive_int(config.top_p_max_experts):
            raise self._invalid(
                "top_p_max_experts", "a positive integer", [{"top_p_max_experts": None}], model, "no cap"
            )
        if config.layers is not None and not isinstance(config.layers, str):
            expected = "0-based decoder-layer indices as text, such as '3-7' or '0,2,5-7'"
            raise self._invalid("layers", expected, self._layer_text_fixes(), model, "every MoE layer")

    def _invalid(
        self, name: str, expected: str, candidates: list[dict], model: ModelShape | None, what: str = ""
    ) -> ConfigError:
        """The error for field ``name`` holding no value it accepts: ``expected`` says which it does,
        ``what`` what the first fix stands for."""
        return self._refuse(
            name,
            lambda fixes: f"{self.spell(name)} is invalid: expected {expected}. " + self._use(fixes, what),
            candidates,
            model,
        )

    def _check_choices(self, model: ModelShape | None) -> None:
        """Refuse a gate, sampling mode, router mode, metrics layout or boolean that is none of its
        choices; the message lists every choice the other settings accept."""
        config = self.config
        if config.gate not in GATE_CHOICES:
            raise self._choice_error("gate", "a gate convention", GATE_CHOICES, model)
        if config.sampling not in SAMPLING_MODES:
            raise self._choice_error("sampling", "a sampling mode", SAMPLING_MODES, model)
        for name in BOOLEAN_FIELDS:
            if not isinstance(getattr(config, name), bool):
                raise self._choice_error(name, "true or false", (True, False), model)
        if config.mode not in ROUTER_MODES:
            raise self._choice_error("mode", "a router mode", ROUTER_MODES, model)
        if config.log_metrics not in LOG_METRICS_CHOICES:
            raise self._refuse_log_metrics(model)

    def _refuse_log_metrics(self, model: ModelShape | None) -> ConfigError:
        """Refuse a ``log_metrics`` that is none of its choices, saying what each one logs."""
        meaning = {
            "layers": "every layer's routing metrics where the framework logs per layer, and the layer means",
            "means": "the layer means only",
            "off": "none",
        }
        old = "; true and false read as layers and off" if self._spelling("log_metrics").reads_text else ""

        def message(fixes: tuple[dict, ...]) -> str:
            choices = [f"{self._spell_fix(fix)} ({meaning[fix['log_metrics']]})" for fix in fixes]
            expected = ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else "".join(choices)
            return f"{self.spell('log_metrics')} is not a metrics layout: expected {expected}{old}."

        candidates = [{"log_metrics": choice} for choice in LOG_METRICS_CHOICES]
        return self._refuse("log_metrics", message, candidates, model, limit=len(LOG_METRICS_CHOICES))

    def _choice_error(self, name: str, what: str, choices: tuple, model: ModelShape | None) -> ConfigError:
        return self._refuse(
            name,
            lambda fixes: f"{self.spell(name)} is not {what}: expected one of {self._spell_fixes(fixes, ', ')}.",
            [{name: choice} for choice in choices],
            model,
            limit=len(choices),
        )

    def check_schedule(self, model: ModelShape | None) -> None:
        """Refuse a schedule that no model accepts, then one that does not fit ``model`` (None: not
        known, so only a set ``center`` stands in for its top-k).

        Run at construction, so that a bad spec fails at start-up on every rank; the model's own
        checks (centre, width, layers) run in ``resolve()``, and here too when the loader was given
        the model.
        """
        self._check_schedule_shape(model)
        if model is not None:
            # every check of resolve(), in its order (the centre first)
            self.config.resolve(**model._asdict())
        elif self.config.center is not None:
            self._check_schedule_around(self.config.center, None, None)

    def _check_schedule_shape(self, model: ModelShape | None) -> None:
        """Refuse a schedule no model accepts: unparsable, reversed, or with budgets below 1. Fixes are
        computed around the model's top-k when it is known."""
        text = self.config.schedule.strip().lower()
        if text in (AUTO_SCHEDULE, "static"):
            return
        if text.isdigit():
            if int(text) < 1:
                raise self._refuse(
                    "schedule",
                    lambda fixes: (
                        f"{self._schedule_label()} is invalid: every token needs at least one expert. "
                        + self._use(fixes, "the model's own top-k")
                    ),
                    [{"schedule": "static"}, {"schedule": AUTO_SCHEDULE}],
                    model,
                    limit=1,
                )
            return
        bounds = parse_range(self.config.schedule)
        if bounds is None:
            raise self._refuse(
                "schedule",
                lambda fixes: (
                    f"{self._schedule_label()} does not parse: expected {_SCHEDULE_FORMS}. "
                    + self._use(fixes, "stock top-k")
                ),
                [{"schedule": "static"}, {"schedule": AUTO_SCHEDULE}],
                model,
                limit=1,
            )
        low, high = bounds
        if low > high:
            self._refuse_reversed_schedule(low, high, model)
        if low < 1:
            self._refuse_budget_below_one(low, high, model)

    def _refuse_reversed_schedule(self, low: int, high: int, model: ModelShape | None) -> NoReturn:
        """Refuse a ``LOW-HIGH`` range written high first; the fix is the range turned round when it
        fits, else the same width around the model's top-k."""
        reordered = {"schedule": f"{high}-{low}"}

        def reversed_message(fixes: tuple[dict, ...]) -> str:
            head = f"{self._schedule_label()} has low={low} > high={high}: write the range as LOW-HIGH"
            if fixes and fixes[0] == reordered:
                return f"{head}, e.g. {self._spell_fix(reordered)}."
            # without a model the range is checked against the config's own center
            target = f"the model ({model.describe()})" if model is not None else f"center={self.config.center}"
            around = "its top-k" if model is not None else target
            what = "" if not fixes or fixes[0]["schedule"] == AUTO_SCHEDULE else f"the same width around {around}"
            return f"{head}; {high}-{low} does not fit {target} either. " + self._use(fixes, what)

        raise self._refuse(
            "schedule",
            reversed_message,
            [reordered, *self._around(model, (low - high) // 2), {"schedule": AUTO_SCHEDULE}],
            model,
            limit=1,
        )

    def _refuse_budget_below_one(self, low: int, high: int, model: ModelShape | None) -> NoReturn:
        """Refuse a range whose low budget is below 1: every token needs at least one expert."""
        center = self.config.center
        centre = (
            f"the model's top-{model.topk}"
            if model is not None
            else (f"top-{center}" if center is not None else "the model's top-k")
        )
        around = self._around(model, (high - low) // 2)

        def low_message(fixes: tuple[dict, ...]) -> str:
            what = (
                ""
                if not fixes or fixes[0] not in around
                else (
                    f"no budget below 1 fits around {centre}: stock top-k"
                    if fixes[0]["schedule"] == "static"
                    else f"symmetric around {centre}, low >= 1"
                )
            )
            return (
                f"{self._schedule_label()} is invalid: low={low}, but every token needs at least one expert, "
                f"so low must be >= 1. " + self._use(fixes, what)
            )

        raise self._refuse(
            "schedule",
            low_message,
            [*around, {"schedule": AUTO_SCHEDULE}, {"schedule": "static"}],
            model,
            limit=1 if around else 2,
        )

    def _around(self, model: ModelShape | None, half_width: int) -> list[dict]:
        """The range of ``half_width`` around the model's top-k (the user's centre when the model is
        not known), within the model's experts."""
        centre = model.topk if model is not None else self.config.center
        if centre is None:
            return []
        return [{"schedule": symmetric_range(centre, half_width, model.num_experts if model else None)}]

    # ------------------------------------------------------------------ model checks
    def _check_schedule_around(self, topk: int, num_experts: int | None, model: ModelShape | None) -> None:
        """Refuse a schedule that does not fit a model routing to top-``topk`` of ``num_experts``
        (None: unknown yet): one that misses the top-k, reaches past the experts, or leaves its mean
        off the top-k (no longer compute-matched with static top-k). Every fix is validated before
        it is printed."""
        config = self.config
        text = config.schedule.strip().lower()
        if text == AUTO_SCHEDULE:
            if config.auto_range(topk, num_experts) is None:
                self._refuse_auto(topk, num_experts, model)
            return
        if text.isdigit() and int(text) != topk:
            raise self._refuse(
                "schedule",
                lambda fixes: (
                    f"{self._schedule_label()} is a point mass at {text}, but the model routes to top-{topk}: a static "
                    f"schedule must equal the model's top-k (to train with more experts change the model's top-k "
                    f"instead). " + self._use(fixes)
                ),
                [{"schedule": "static"}, {"schedule": AUTO_SCHEDULE}],
                model,
                limit=1,
            )
        bounds = parse_range(config.schedule)
        if bounds is None:
            return
        low, high = bounds
        same_width = {"schedule": symmetric_range(topk, (high - low) // 2, num_experts)}
        if not low <= topk <= high:
            raise self._refuse(
                "schedule",
                lambda fixes: (
                    f"{self._schedule_label()} does not contain the model's top-{topk}: a schedule is centred on the "
                    f"model's top-k (low <= k <= high). "
                    + self._use(
                        fixes,
                        f"the same width around top-{topk}, at least one expert per token"
                        if fixes and fixes[0] == same_width
                        else "",
                    )
                ),
                [same_width, {"schedule": AUTO_SCHEDULE}],
                model,
                limit=1,
            )
        if num_experts is not None and high > num_experts:
            raise self._refuse(
                "schedule",
                lambda fixes: (
                    f"{self._schedule_label()} reaches budget {high}, but the model has only {num_experts} experts: "
                    f"expected high <= {num_experts}. " + self._use(fixes)
                ),
                [same_width, {"schedule": AUTO_SCHEDULE}],
                model,
                limit=1,
            )
        around_topk = BudgetSchedule(low, high, topk, config.sigma, allow_off_center=True)
        self._check_symmetric(topk, around_topk, same_width, model)

    def _check_symmetric(
        self, topk: int, around_topk: BudgetSchedule, same_width: dict, model: ModelShape | None
    ) -> None:
        """Refuse a range around ``topk`` whose mean is not ``topk``: training would no longer be
        compute-matched with static top-k (unless ``allow_off_center``), and ``sampling="balanced"``
        cannot hit the total budget exactly (whatever ``allow_off_center`` says)."""
        if not around_topk.is_symmetric and not self.config.allow_off_center:
            accept = {"allow_off_center": True}
            raise self._refuse(
                "schedule",
                lambda fixes: (
                    f"{self._schedule_label()} around the model's top-{topk} has mean {around_topk.mean:.4f}, not "
                    f"{topk}: training would no longer be compute-matched with static top-{topk}. Use a range "
                    f"symmetric around {topk} (low + high == {2 * topk})"
                    + (f", e.g. {self._spell_fix(same_width)}" if same_width in fixes else "")
                    + (f", or {self._verb(accept)} {self._spell_fix(accept)} to accept it" if accept in fixes else "")
                    + "."
                ),
                [same_width, accept],
                model,
            )
        if not around_topk.is_symmetric and self.config.sampling == "balanced":
            iid = {"sampling": "iid"}
            raise self._refuse(
                "sampling",
                lambda fixes: (
                    f"{self.spell('sampling')} needs a schedule symmetric around the model's top-{topk}, got "
                    f"{self.spell('schedule')}: use {self._spell_fixes(fixes, ', or ')}."
                ),
                [iid, same_width],
                model,
            )

    def _refuse_auto(self, topk: int, num_experts: int | None, model: ModelShape | None) -> NoReturn:
        """Refuse ``schedule="auto"`` where no elastic range exists around the model's top-k (top-1,
        or top-E: every expert already)."""
        static: dict[str, Any] = {"schedule": "static"}
        off_centre: dict[str, Any] = {"schedule": f"1-{1 + AUTO_HALF_WIDTH}", "allow_off_center": True}
        if topk == 1:
            why = (
                "the model routes to top-1, and no budget range symmetric around 1 keeps every token at >= 1 "
                "expert, so no elastic schedule can be resolved from it"
            )
            candidates = [static, off_centre]
        else:
            why = (
                f"the model routes every token to all {num_experts} of its experts (top-{topk} of {num_experts}), "
                f"so there is no budget above {topk} and no elastic range around it"
            )
            candidates = [static]

        def message(fixes: tuple[dict, ...]) -> str:
            parts = []
            if static in fixes:
                parts.append(f"{self._spell_fix(static)} to train stock top-{topk} with the plugin's metrics")
            if off_centre in fixes:
                parts.append(
                    f"{self._spell_fix(off_centre)} for an off-centre range (E[κ] > 1: more compute than top-1)"
                )
            if topk > 1:
                parts.append("lower the model's top-k")
            return f"{self._schedule_label()}: {why}. Use " + ", or ".join(parts) + "."

        raise self._refuse("schedule", message, candidates, model)

    def checked_schedule(self, model: ModelShape) -> BudgetSchedule:
        """Every check against ``model``, then the schedule (``resolve()`` without its memo): the point
        mass at the model's top-k in ``mode="top_p"``, whose per-token budgets come from the probabilities."""
        config = self.config
        topk, num_experts = model.topk, model.num_experts
        if config.mode == "top_p":
            # The budget is read off the probabilities, not sampled: the schedule does not apply.
            self._check_top_p_cap(model)
            schedule = BudgetSchedule.static(topk)
        else:
            if config.center is not None and config.center != topk:
                self._refuse_center(model)
            self._check_schedule_around(topk, num_experts, model)
            try:
                schedule = config.budget_schedule(topk, num_experts)
                if num_experts is not None:
                    schedule.validate_for(num_experts, topk)
            except ValueError as error:  # pragma: no cover - the checks above refuse it first
                raise ConfigError(str(error), field="schedule") from None
        self._check_layers_within(model)
        return schedule

    def _check_top_p_cap(self, model: ModelShape) -> None:
        """Refuse a ``top_p_max_experts`` above the model's experts: the cap could never bind."""
        cap, num_experts = self.config.top_p_max_experts, model.num_experts
        if num_experts is not None and cap is not None and cap > num_experts:
            raise self._refuse(
                "top_p_max_experts",
                lambda fixes: (
                    f"{self.spell('top_p_max_experts')} exceeds the model's {num_experts} experts: expected at most "
                    f"{num_experts}. " + self._use(fixes)
                ),
                [{"top_p_max_experts": num_experts}, {"top_p_max_experts": None}],
                model,
            )

    def _refuse_center(self, model: ModelShape) -> NoReturn:
        """Refuse a ``center`` that is not the model's top-k: the schedule is centred on the top-k the
        model is deployed with, so that training stays compute-matched with it."""
        topk, num_experts = model.topk, model.num_experts
        # the range moves with the center: keep its width around the model's top-k
        bounds = parse_range(self.config.schedule)
        moved: dict[str, Any] = (
            {}
            if bounds is None or bounds[0] > bounds[1]
            else {"schedule": symmetric_range(topk, (bounds[1] - bounds[0]) // 2, num_experts)}
        )
        if moved.get("schedule") == self.config.schedule:
            moved = {}
        candidates = [
            {"center": None},
            {"center": None, **moved},
            {"center": topk},
            {"center": topk, **moved},
            {"center": None, "schedule": AUTO_SCHEDULE},
            {"center": None, "schedule": "static"},
        ]

        def center_message(fixes: tuple[dict, ...]) -> str:
            head = (
                f"{self.spell('center')}, but the model routes to top-{topk}: the schedule's center must "
                f"be the model's deployment top-k."
            )
            if not fixes:
                return f"{head} {self._use(fixes)}"
            return (
                f"{head} Set {self._spell_fix(fixes[0])} (the model's top-k)"
                + "".join(f" or {self._spell_fix(fix)}" for fix in fixes[1:])
                + "."
            )

        raise self._refuse("center", center_message, candidates, model)
