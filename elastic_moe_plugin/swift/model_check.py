"""Whether the model ms-swift is about to train has a router the plugin covers.

Asked twice, so that a model the plugin cannot route stops the run before any training step rather
than training it plain and exiting 0:

- before the model is built, from the ``config.json`` of the local folder ``--model`` names
  (:func:`peek_model`): its top-k, experts and layers check the settings as the plugin loads, and a
  config that declares no experts is refused there, on every rank;
- when training starts, from the built model's routers (:func:`require_covered_routers`, called by
  the callbacks of :mod:`.callbacks`): this covers a hub id, which has no local ``config.json``, and
  a MoE family the plugin does not cover.

Both refusals are :class:`~elastic_moe_plugin.core.errors.NoMoERouterError` with the same advice
(:func:`no_moe_router`). The framework imports stay inside the functions: this module is imported
while the plugin file loads, before ms-swift builds anything.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from elastic_moe_plugin.swift.entry import argument_groups

if TYPE_CHECKING:
    from elastic_moe_plugin.core.config import ElasticConfig
    from elastic_moe_plugin.hf.families import ConfigRouters


def peek_model(arguments: list[str]) -> tuple[str, ConfigRouters] | None:
    """``(path, ConfigRouters)`` of the local checkpoint folder ``--model`` names, or None (a hub id,
    no config.json): what its ``config.json`` says about the routers, before ms-swift builds it."""
    import json

    from elastic_moe_plugin.hf.families import config_routers

    values = next((values for flag, values in reversed(argument_groups(arguments)) if flag == "--model"), None)
    if not values:
        return None
    config_file = os.path.join(values[0], "config.json")
    try:
        with open(config_file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return (values[0], config_routers(data)) if isinstance(data, dict) else None


def no_moe_router(config: ElasticConfig, what: str):
    """The error that refuses ``what`` (a sentence naming the model) for having no covered router."""
    from elastic_moe_plugin.core.errors import NoMoERouterError
    from elastic_moe_plugin.hf.families import family_names

    return NoMoERouterError(
        f"{what}: it has no mixture-of-experts router, so elastic routing would change nothing and the run would "
        f"train it plain. The plugin covers the transformers router families {family_names()} (docs/transformers.md) "
        f"and Megatron-core's TopKRouter. Train this model without --plugin elastic_moe, or use "
        f"{config.spell('enabled', False)} to keep the plugin loaded with every router stock."
    )


def require_covered_routers(model, config: ElasticConfig | None, framework: str, plans: dict) -> None:
    """Refuse to train ``model`` elastically when none of its routers is covered (``plans`` empty: a
    dense model, or a family the plugin does not cover), naming its type and the covered families.

    Raises:
        NoMoERouterError: an enabled config, and no covered router in ``model``.
    """
    if config is None or not config.enabled or plans:
        return
    inner = model[0] if isinstance(model, (list, tuple)) and model else model
    model_config = getattr(inner, "config", None)
    model_type = getattr(model_config, "model_type", None)
    described = f"{type(inner).__name__}" + (f" (model_type={model_type!r})" if model_type else "")
    raise no_moe_router(config, f"the {framework} model {described} has no router the plugin covers")


__all__ = ["no_moe_router", "peek_model", "require_covered_routers"]
