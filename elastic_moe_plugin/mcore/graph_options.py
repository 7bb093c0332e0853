"""Which CUDA graphs capture an elastic router's training forward, and the scope to drop instead.

κ is drawn on the host and copied in inside ``TopKRouter.routing`` at every training forward
(:mod:`.budget_rng`), and Σκ travels to the dispatcher on the host: a graph that replays the
router's routing would reuse the κ of its capture. Evaluation routes stock static top-k, so no
inference graph matters (``inference_cuda_graph_scope``, ``moe_pad_experts_for_cuda_graph_inference``),
and neither does any graph under ``schedule="static"``. What captures the router in training
(megatron-core 0.19's ``cuda_graph_modules``, ``cuda_graph_scope`` in 0.16 and as 0.19's deprecated
spelling; ``transformer_layer.py``, ``cuda_graphs.py``, ``moe/moe_layer.py``):

==================================================  ===================================================
setting                                             the router's training forward
==================================================  ===================================================
``cuda_graph_impl="none"``                          eager: accepted
``cuda_graph_impl="full_iteration"`` (0.19), scope  captured (the whole forward-backward): refused
``full_iteration`` (0.16 / deprecated)
empty scope (Megatron's default ``"full"``)         captured (the whole layer): refused, except
                                                    ``cuda_graph_impl="local"`` with
                                                    ``inference_cuda_graph_scope="block"`` (or the
                                                    deprecated ``full_iteration_inference``): then no
                                                    training layer is graphed, only the inference block
``moe``, ``moe_router``, ``moe_preprocess``         captured (the MoE MLP, or the router, and the
                                                    dispatcher's preprocess after it): refused
``attn`` with ``cuda_graph_impl="local"`` in a      captured: the local implementation graphs a GPT
GPT model                                           ``TransformerLayer`` whole (``cudagraph_manager`` of
                                                    ``create_mcore_cudagraph_manager``), MoE MLP included;
                                                    in a hybrid model (``is_hybrid_model``, a hybrid
                                                    layer pattern) the MoE layer holds no attention
``attn`` (``transformer_engine``), ``mlp`` (dense   eager router: accepted
layers), ``mamba``
==================================================  ===================================================

Megatron applies a scope to every layer alike, so no scope spares the elastic layers only. The
refusal names the scopes to drop as the user spells them and a fix that this module accepts
(:func:`fixed_setting`). The patched router also refuses to route elastically while a graph is
being captured (:func:`.routing.graph_capture_underway`), a backstop for what a config cannot show.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: the per-layer scopes whose training graph holds the MoE router
ROUTER_SCOPES = ("moe", "moe_router", "moe_preprocess")
#: deprecated scope names (0.19 migrates them to other fields; 0.16 knows ``full_iteration`` only)
_FULL_ITERATION, _INFERENCE_BLOCK, _FULL = "full_iteration", "full_iteration_inference", "full"


@dataclasses.dataclass(frozen=True)
class GraphSetting:
    """A model's CUDA-graph options, read the same from a ``TransformerConfig`` (0.16 or 0.19) and
    from a namespace of Megatron-LM's flags.

    Attributes:
        impl: ``"none"``, ``"local"``, ``"transformer_engine"`` or ``"full_iteration"`` (the
            deprecated ``enable_cuda_graph`` / ``external_cuda_graph`` and the scope
            ``full_iteration`` folded in).
        scopes: the per-layer training scopes, in the user's order; empty: the whole layer.
        attribute: the scope list's name as the user spells it (``cuda_graph_modules`` or
            ``cuda_graph_scope``).
        inference_block: inference graphs are owned by the block (0.19), so an empty scope graphs
            no training layer.
        hybrid: MoE layers are a hybrid model's ``MoETransformerLayer`` (no attention inside).
        scope_spelling: the user spelt full-iteration capture as a scope (0.16 / deprecated).
        legacy_switch: ``"enable_cuda_graph"`` / ``"external_cuda_graph"`` where the implementation
            comes from that deprecated switch (a namespace of flags; a config has migrated it).
    """

    impl: str
    scopes: tuple[str, ...]
    attribute: str
    inference_block: bool = False
    hybrid: bool = False
    scope_spelling: bool = False
    legacy_switch: str | None = None


def _names(scopes: Any) -> list[str]:
    if scopes is None:
        return []
    if isinstance(scopes, str):
        scopes = scopes.split(",") if scopes else []
    elif not isinstance(scopes, (list, tuple)):
        scopes = [scopes]
    return [str(getattr(scope, "name", scope)) for scope in scopes]


#: deprecated switch -> the implementation it selects (megatron-core migrates it in ``__post_init__``)
_LEGACY_SWITCHES = {"enable_cuda_graph": "local", "external_cuda_graph": "transformer_engine"}


def _impl(model: Any) -> tuple[str, str | None]:
    impl = getattr(model, "cuda_graph_impl", None) or "none"
    if impl == "none":
        for switch, selected in _LEGACY_SWITCHES.items():
            if getattr(model, switch, False):
                return selected, switch
    return str(impl), None


def _is_hybrid(model: Any) -> bool:
    if getattr(model, "is_hybrid_model", False):
        return True
    return any(getattr(model, name, None) for name in ("hybrid_layer_pattern", "hybrid_override_pattern"))


def graph_setting(model: Any) -> GraphSetting:
    """The CUDA-graph options of ``model`` (a ``TransformerConfig`` or a namespace of flags)."""
    raw_scope = getattr(model, "cuda_graph_scope", None)
    modules = getattr(model, "cuda_graph_modules", None)
    # 0.19 migrates cuda_graph_scope into cuda_graph_modules; a namespace of flags keeps both
    attribute = (
        "cuda_graph_modules" if hasattr(model, "cuda_graph_modules") and raw_scope is None else "cuda_graph_scope"
    )
    names = _names(modules or raw_scope)
    inference = getattr(model, "inference_cuda_graph_scope", None)
    inference_block = str(getattr(inference, "name", inference)) == "block" or _INFERENCE_BLOCK in names
    impl, legacy_switch = _impl(model)
    scope_spelling = _FULL_ITERATION in names
    if scope_spelling and impl in ("none", "local"):
        impl = "full_iteration"
    scopes = tuple(name for name in names if name not in (_FULL, _FULL_ITERATION, _INFERENCE_BLOCK))
    return GraphSetting(impl, scopes, attribute, inference_block, _is_hybrid(model), scope_spelling, legacy_switch)


def router_capture(setting: GraphSetting) -> str | None:
    """Why a training CUDA graph of ``setting`` captures the router, None if none does."""
    if setting.impl == "none":
        return None
    if setting.impl == "full_iteration":
        return "full_iteration"
    if not setting.scopes:
        return None if setting.impl == "local" and setting.inference_block else "whole_layer"
    if any(name in ROUTER_SCOPES for name in setting.scopes):
        return "router_scopes"
    if setting.impl == "local" and "attn" in setting.scopes and not setting.hybrid:
        return "local_attn"
    return None


def captures_moe_preprocess(model: Any) -> bool:
    """Whether a training CUDA graph captures ``MoELayer.preprocess`` (the dispatcher's sizing):
    a whole layer, the whole iteration, or ``moe_preprocess`` (which the local implementation adds
    to ``moe_router``)."""
    setting = graph_setting(model)
    capture = router_capture(setting)
    if capture in ("full_iteration", "whole_layer", "local_attn") or "moe" in setting.scopes:
        return True
    scopes = set(setting.scopes)
    if setting.impl == "local" and "moe_router" in scopes:
        scopes.add("moe_preprocess")  # Megatron's local implementation captures both together
    return "moe_preprocess" in scopes


def fixed_setting(setting: GraphSetting) -> tuple[str, tuple[str, ...]]:
    """``(impl, scopes)`` of the fix: the user's scopes without the router's, ``("attn",)`` where
    none is left (an empty scope would be the whole layer), under the user's per-layer
    implementation, or ``"transformer_engine"`` where that would still capture the router
    (``full_iteration``; ``local`` with ``attn`` in a GPT model)."""
    scopes = tuple(name for name in setting.scopes if name not in ROUTER_SCOPES) or ("attn",)
    impl = setting.impl if setting.impl in ("local", "transformer_engine") else "transformer_engine"
    if impl == "local" and "attn" in scopes and not setting.hybrid:
        impl = "transformer_engine"
    return impl, scopes


def _flag(attribute: str) -> str:
    return "--" + attribute.replace("_", "-")


def describe_capture(setting: GraphSetting, flags: bool) -> str:
    """What captures the router (:func:`router_capture`), as the user spells the options."""
    capture = router_capture(setting)
    spell = _flag if flags else (lambda name: name)
    if capture == "full_iteration":
        if setting.scope_spelling:
            return f"{spell(setting.attribute)} 'full_iteration' captures the whole training iteration"
        impl = "--cuda-graph-impl full_iteration" if flags else "cuda_graph_impl='full_iteration'"
        return f"{impl} captures the whole training iteration"
    if capture == "whole_layer":
        if setting.legacy_switch:
            impl = _flag(setting.legacy_switch) if flags else f"{setting.legacy_switch}=True"
        else:
            impl = f"--cuda-graph-impl {setting.impl}" if flags else f"cuda_graph_impl={setting.impl!r}"
        return f"{impl} with an empty {spell(setting.attribute)} (Megatron's default 'full') captures the whole layer"
    if capture == "router_scopes":
        named = [name for name in setting.scopes if name in ROUTER_SCOPES]
        return f"{', '.join(repr(name) for name in named)} in {spell(setting.attribute)} capture the MoE router"
    hybrid = "--is-hybrid-model" if flags else "is_hybrid_model=True"
    return (
        f"{'--cuda-graph-impl local' if flags else 'cuda_graph_impl=' + repr('local')} with 'attn' graphs a GPT "
        f"TransformerLayer whole, its MoE MLP and router included; a hybrid model, whose MoE layers hold no "
        f"attention, says so with {hybrid}"
    )


def spell_fix(setting: GraphSetting, flags: bool) -> str:
    """The fix of :func:`fixed_setting`, as the user spells the options (the implementation only
    where it changes, or where a deprecated switch selected it: that switch is then removed)."""
    impl, scopes = fixed_setting(setting)
    spell_impl = impl != setting.impl or setting.legacy_switch is not None
    if flags:
        legacy = f"remove {_flag(setting.legacy_switch)}, then " if setting.legacy_switch else ""
        change = f"--cuda-graph-impl {impl} " if spell_impl else ""
        fix = f"{legacy}{change}{_flag(setting.attribute)} {' '.join(scopes)}"
        if not setting.scopes and setting.attribute == "cuda_graph_modules":  # no scope flag written
            fix += f"; --cuda-graph-scope {' '.join(scopes)} before megatron-core 0.19"
        return fix
    legacy = f"{setting.legacy_switch}=False, " if setting.legacy_switch else ""
    change = f"cuda_graph_impl={impl!r}, " if spell_impl else ""
    return f"{legacy}{change}{setting.attribute}={list(scopes)!r}"


__all__ = [
    "ROUTER_SCOPES",
    "GraphSetting",
    "captures_moe_preprocess",
    "describe_capture",
    "fixed_setting",
    "graph_setting",
    "router_capture",
    "spell_fix",
]
