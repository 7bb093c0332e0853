"""The explicit-spec route: ``ElasticTopKRouter`` in a layer spec instead of the monkey-patch.

:func:`elastic_router_spec` deep-copies a layer/block/MoE ``ModuleSpec`` (a ``functools.partial``
in megatron-core >= 0.19) and binds its MoE routers to an ``ElasticTopKRouter`` subclass carrying
the config. Both routes share :func:`.routing.training_state` and :func:`.routing.elastic_forward`,
the plans and the validation.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.patching import unwrap
from elastic_moe_plugin.mcore import dispatch
from elastic_moe_plugin.mcore.patch import check_megatron_version, resolve_plan, router_module, validate_router
from elastic_moe_plugin.mcore.routing import elastic_arguments, elastic_forward, training_state


def _stock_routing() -> Callable:
    """The unpatched ``TopKRouter.routing``, whether or not :func:`~.patch.apply` is active."""
    return unwrap(router_module().TopKRouter.__dict__["routing"])


def _elastic_router_class() -> type:
    stock: Any = router_module().TopKRouter  # Megatron's class, imported on first use

    class ElasticTopKRouter(stock):
        """A ``TopKRouter`` that routes elastically with its class's ``elastic_config``.

        Build one bound to a config with :meth:`with_config` (what :func:`elastic_router_spec`
        does). Shares :func:`.routing.elastic_forward` with the monkey-patch.
        """

        elastic_config: ElasticConfig = ElasticConfig()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check_megatron_version()
            super().__init__(*args, **kwargs)
            validate_router(self, self.elastic_config)
            # Its maps reach stock dispatchers too; the fixes stay for the life of the process.
            dispatch.SPEC_FIXES.on()

        @classmethod
        def with_config(cls, config: ElasticConfig) -> type:
            return type(cls.__name__, (cls,), {"elastic_config": config, "__module__": __name__})

        def routing(self, logits, *args, **kwargs):
            # whatever stock's routing takes, passed on (the patched method's rule, mcore.routing.patched_routing)
            # the generation of a spec router's plan: its class's config (which never changes)
            state = training_state(self, self.elastic_config, -id(self.elastic_config), resolve_plan)
            if state is None or state.path is None:
                return _stock_routing()(self, logits, *args, **kwargs)
            padding_mask = elastic_arguments(_stock_routing(), args, kwargs)
            return elastic_forward(self, state, state.path, logits, padding_mask)

    return ElasticTopKRouter


_elastic_router_cls = None


def __getattr__(name: str):
    global _elastic_router_cls
    if name == "ElasticTopKRouter":
        if _elastic_router_cls is None:
            _elastic_router_cls = _elastic_router_class()
        return _elastic_router_cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def elastic_router_spec(spec, config: ElasticConfig):
    """A deep copy of a layer/block/MoE ``ModuleSpec`` whose MoE routers are ``ElasticTopKRouter``
    bound to ``config``. Raises ValueError if the spec contains no MoE submodules."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    router_class = __getattr__("ElasticTopKRouter").with_config(config)
    spec = copy.deepcopy(spec)
    replaced = 0

    def visit(node, seen):
        nonlocal replaced
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, MoESubmodules):
            node.router = router_class
            replaced += 1
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                visit(getattr(node, field.name), seen)
        elif isinstance(node, functools.partial):
            # megatron-core >= 0.19 specs are partials, e.g. partial(MoELayer, submodules=MoESubmodules(...))
            visit(node.args, seen)
            visit(node.keywords, seen)
        elif isinstance(node, (list, tuple)):
            for item in node:
                visit(item, seen)
        elif isinstance(node, dict):
            for item in node.values():
                visit(item, seen)
        elif hasattr(node, "submodules") and not isinstance(node, type):
            visit(node.submodules, seen)

    visit(spec, set())
    if replaced == 0:
        raise ValueError("elastic_router_spec: the spec contains no MoE layer (no MoESubmodules found).")
    return spec
