"""The checks of an :class:`~elastic_moe_plugin.core.config.ElasticConfig`'s ``layers``: the spec
on its own (text, not ``"none"``, parsable) at construction, and the selection against the model's
decoder layers when it is known.

Kept apart from :mod:`.config_checks`, whose :class:`~.config_checks.ConfigChecks` extends
:class:`LayerChecks`: the layer selection has its own grammar (:mod:`.config_values`) and fixes,
and shares nothing with the schedule's checks but how a refusal is told (:class:`Refusals`).
Imported by the checks only, never by the config module directly.
"""

from __future__ import annotations

from typing import NoReturn

from elastic_moe_plugin.core.config_refusals import ModelShape, Refusals
from elastic_moe_plugin.core.config_values import (
    ALL_LAYERS,
    LayerProblem,
    layer_problem_text,
    layers_text,
    parse_layer_items,
)


class LayerChecks(Refusals):
    """The checks of one config's ``layers`` (:class:`Refusals`: how they are told)."""

    def _layer_text_fixes(self) -> list[dict]:
        """For ``layers`` that is no text: the number as its text (``layers=4`` meant ``'4'``), or every layer."""
        candidates = []
        if isinstance(self.config.layers, int) and not isinstance(self.config.layers, bool):
            candidates.append({"layers": str(self.config.layers)})
        return candidates + [{"layers": None}]

    def layer_selection(self, model: ModelShape | None) -> frozenset[int] | None:
        """The 0-based layers ``layers`` selects (None: every MoE layer). Refuses ``"none"``, which is
        ambiguous, and a spec that does not parse (empty, malformed or a reversed range)."""
        layers = self.config.layers
        selected = None if self._layers_mean_all() else parse_layer_items(layers)
        if layers is not None and isinstance(layers, str) and layers.strip().lower() == "none":
            self._refuse_layers_none(model)
        if isinstance(selected, LayerProblem):
            self._refuse_layers(selected, model)
        return selected

    def _layers_mean_all(self) -> bool:
        layers = self.config.layers
        return layers is None or (isinstance(layers, str) and layers.strip().lower() == ALL_LAYERS)

    def _refuse_layers_none(self, model: ModelShape | None) -> NoReturn:
        """Refuse ``layers="none"``: it reads as 'no layer', but it used to select every MoE layer."""
        every, off = {"layers": None}, {"layers": None, "enabled": False}

        def message(fixes: tuple[dict, ...]) -> str:
            parts = []
            if every in fixes:
                parts.append(f"For every MoE layer use {self._spell_fix(every)} (or leave it unset)")
            if off in fixes:
                parts.append(
                    f"to route no layer elastically use {self._spell_fix(off)} (every router stock), or "
                    f"train without the plugin"
                )
            return (
                f"{self.spell('layers')} is ambiguous, so it is refused: it reads as 'no layer', but it used to "
                f"select every MoE layer. " + "; ".join(parts) + "."
            )

        raise self._refuse("layers", message, [every, off], model)

    def _refuse_layers(self, problem: LayerProblem, model: ModelShape | None) -> NoReturn:
        """Refuse a ``layers`` spec that does not parse; a reversed range is offered turned round
        (and narrowed to the model's layers, when they are known)."""
        candidates: list[dict] = [{"layers": problem.repaired}] if problem.repaired else []
        narrowed = ""  # told only when the range narrowed to the model's layers is the first fix
        if problem.repaired and model is not None and model.num_layers is not None:
            repaired = parse_layer_items(problem.repaired)
            inside = sorted(i for i in repaired if i < model.num_layers) if isinstance(repaired, frozenset) else []
            if inside:
                candidates.append({"layers": layers_text(inside)})
                narrowed = f"the range turned round, within the model's {model.num_layers} layers"
        candidates.append({"layers": None})

        def message(fixes: tuple[dict, ...]) -> str:
            first = fixes[0]["layers"] if fixes else None
            what = (
                "every MoE layer"
                if first is None
                else "the range turned round"
                if first == problem.repaired
                else narrowed
            )
            return f"{layer_problem_text(self.spell('layers'), problem)}. " + self._use(fixes, what)

        raise self._refuse("layers", message, candidates, model)

    def _check_layers_within(self, model: ModelShape) -> None:
        """Refuse a ``layers`` selection that names a layer past the model's decoder layers (another
        model's range, or a 1-based index), or that selects none of its MoE layers (a hybrid pattern's
        attention or MLP layers only): no router there would route elastically."""
        num_layers, selected = model.num_layers, self.config.layer_set
        if num_layers is None or not selected:
            return
        self._check_layers_past_the_model(num_layers, selected, model)
        self._check_layers_hold_a_router(selected, model)

    def _check_layers_hold_a_router(self, selected: frozenset[int], model: ModelShape) -> None:
        """Refuse a selection that holds none of ``model.moe_layers``; the fixes are the MoE layers
        inside the selection's span, then every MoE layer."""
        moe_layers = model.moe_layers
        if moe_layers is None or selected & set(moe_layers):
            return
        span = [layer for layer in moe_layers if min(selected) <= layer <= max(selected)]
        near = span or sorted(moe_layers, key=lambda layer: (min(abs(layer - s) for s in selected), layer))[:1]
        candidates = ([{"layers": layers_text(near)}] if near else []) + [{"layers": None}]
        numbers = ", ".join(str(layer) for layer in moe_layers) or "none"
        if model.static_layers_note is None:
            what = (
                f"none of which is an MoE layer: the model's MoE layers are {numbers} (0-based layer numbers; "
                f"in a hybrid pattern every symbol is a layer, and only 'E' layers route)"
            )
            near_what = "the MoE layers within that range" if span else "the nearest MoE layer"
        else:
            what = (
                f"none of which can route elastically: {model.static_layers_note}; the layers that can are "
                f"{numbers} (0-based layer numbers)"
            )
            near_what = "the elastic-capable layers within that range" if span else "the nearest one"
        raise self._refuse(
            "layers",
            lambda fixes: (
                f"{self.spell('layers')} selects layer(s) {sorted(selected)}, {what}. "
                + self._use(fixes, near_what if fixes and fixes[0]["layers"] is not None else "")
            ),
            candidates,
            model,
        )

    def _check_layers_past_the_model(self, num_layers: int, selected: frozenset[int], model: ModelShape) -> None:
        outside = sorted(i for i in selected if i >= num_layers)
        if outside:
            inside = sorted(i for i in selected if i < num_layers)
            candidates = ([{"layers": layers_text(inside)}] if inside else []) + [{"layers": None}]
            moe = (
                ""
                if model.moe_layers is None
                else f"; its MoE layers are {', '.join(str(layer) for layer in model.moe_layers) or 'none'}"
            )
            raise self._refuse(
                "layers",
                lambda fixes: (
                    f"{self.spell('layers')} selects layer(s) {outside}, but the model has {num_layers} decoder "
                    f"layers (0-based indices 0..{num_layers - 1}{moe}). Narrow the range"
                    + "".join(f", e.g. {self._spell_fix(fix)}" for fix in fixes if fix["layers"] is not None)
                    + "".join(
                        f", or {self._verb(fix)} {self._spell_fix(fix)} for every MoE layer"
                        for fix in fixes
                        if fix["layers"] is None
                    )
                    + "."
                ),
                candidates,
                model,
            )
