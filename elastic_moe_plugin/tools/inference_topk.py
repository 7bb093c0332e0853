"""Route a trained MoE to another static top-k at inference, and restore it: one override per framework.

Used by ``elastic-moe eval --topk``, the diagnostics' inference top-k sweep and the demo. Both
context managers set the attributes the framework reads at forward time through
:class:`~elastic_moe_plugin.core.patching.AttributePatches` and restore every one of them, by
identity of the objects touched, when the block exits (also on error).

- :func:`megatron`: megatron-core 0.16-0.19 reads the top-k from ``TopKRouter.topk`` (routing
  and capacity dropping), from the token dispatcher's ``router_topk`` and, for the alltoall
  dispatcher's dropless permutation size ``T·k`` and the drop-and-pad capacity, from
  ``config.moe_router_topk``. All three change, or an alltoall layer would permute ``T·k`` rows
  for ``T·k'`` routed pairs; the allgather dispatcher sizes from the routing map and is
  unaffected by the config.
- :func:`transformers`: in transformers 5.x every MoE router reads ``self.top_k`` in ``forward``
  (``OlmoeTopKRouter`` and ``Qwen3MoeTopKRouter`` call ``torch.topk(router_probs, self.top_k)``;
  about sixty other families set ``self.top_k = config.num_experts_per_tok`` the same way). It
  sets ``top_k`` on every such module, where a family the plugin covers keeps it elsewhere its own
  place (the family table's ``top_k_path``: Gemma 4's routers read ``config.top_k_experts``; DBRX
  routes in its FFN block, whose ``top_k`` it sets), the top-k keys of every config reachable from
  the model, and the ``num_experts_per_tok`` attribute of ``*ForCausalLM`` (read by the auxiliary
  loss only). Gate weights keep the model's own convention (OLMoE: softmax over all experts, not
  renormalised; Qwen3-MoE: renormalised over the chosen k), so top-k k' evaluates exactly what the
  model computes when built with ``num_experts_per_tok=k'``.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from elastic_moe_plugin.core.patching import AttributePatches

logger = logging.getLogger(__name__)

#: Config attributes that hold a MoE's top-k, in the order they are looked for (Gemma 4: ``top_k_experts``).
TOPK_CONFIG_KEYS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "top_k_experts")
#: Config and module attributes that hold the number of routed experts.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_ROUTER_CLASS_HINT = re.compile(r"router|gate|moe|expert", re.IGNORECASE)


class NotAMoEError(ValueError):
    """The model is not a mixture-of-experts model (or its routers cannot be found)."""


@contextlib.contextmanager
def megatron(model: Any, k: int) -> Iterator[int]:
    """Route every MoE layer of a Megatron-core model (a module) to its static top-``k``; eval only.

    Yields the number of MoE layers changed.

    Raises:
        NotAMoEError: the model holds no ``MoELayer``.
        ValueError: ``k`` outside ``1..num_moe_experts``.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = [module for module in model.modules() if isinstance(module, MoELayer)]
    if not layers:
        raise NotAMoEError(
            f"{type(model).__name__} holds no megatron-core MoELayer, so its top-k cannot be overridden."
        )
    for layer in layers:
        experts = int(layer.config.num_moe_experts)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
            raise ValueError(f"top-k {k!r} is invalid: the model has {experts} experts (expected 1 <= k <= {experts}).")
    saved = AttributePatches()
    try:
        configs: dict[int, Any] = {}  # by identity: the layers of a model share one TransformerConfig
        for layer in layers:
            saved.set(layer.router, "topk", k)
            dispatcher = getattr(layer, "token_dispatcher", None)
            if dispatcher is not None and hasattr(dispatcher, "router_topk"):
                saved.set(dispatcher, "router_topk", k)
            for config in (layer.config, layer.router.config):
                configs.setdefault(id(config), config)
        for config in configs.values():
            saved.set(config, "moe_router_topk", k)
        yield len(layers)
    finally:
        saved.restore()


def _int_attr(obj: Any, keys: Sequence[str]) -> int | None:
    for key in keys:
        value = getattr(obj, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def config_topk(config: Any) -> tuple[str, int] | None:
    """``(attribute, top-k)`` of a MoE config (its text config for multimodal ones), else None."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        for key in TOPK_CONFIG_KEYS:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return key, value
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
                return key, max(value)
    return None


def config_num_experts(config: Any) -> int | None:
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and (count := _int_attr(cfg, EXPERT_COUNT_KEYS)) is not None:
            return count
    return None


def _covered_top_k_owners(model: Any) -> list[tuple[str, Any, str]]:
    """``(router name, the object that holds its k, the attribute)`` of every router of a family
    the plugin's transformers door covers (its ``top_k_path``), for the families whose modeling
    module is imported (a built model's are)."""
    if "transformers" not in type(model).__module__:
        return []
    from elastic_moe_plugin.hf.families import covered_routers

    owners = []
    for name, router, family in covered_routers(model):
        owner_path, _, attribute = family.top_k_path.rpartition(".")
        owners.append((name, operator.attrgetter(owner_path)(router) if owner_path else router, attribute))
    return owners


def find_routers(model: Any) -> list[tuple[str, Any]]:
    """Modules whose ``top_k`` decides routing at forward time: an int ``top_k`` attribute on a
    module that also holds an expert count (``num_experts``, ``num_local_experts``,
    ``n_routed_experts``) or whose class name says router/gate/MoE/expert.

    Returns ``(qualified name, module)`` pairs in ``named_modules`` order.
    """
    routers = []
    for name, module in model.named_modules():
        top_k = getattr(module, "top_k", None)
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            continue
        if _int_attr(module, EXPERT_COUNT_KEYS) is not None or _ROUTER_CLASS_HINT.search(type(module).__name__):
            routers.append((name, module))
    return routers


@contextlib.contextmanager
def transformers(model: Any, k: int) -> Iterator[list[str]]:
    """Route every token of every MoE layer to its top ``k`` experts inside the block.

    Sets ``top_k`` on each router from :func:`find_routers` (and where a covered family keeps its
    k, the family table's ``top_k_path``), the top-k attribute of every config reachable from the
    model's modules (:data:`TOPK_CONFIG_KEYS`), and any ``num_experts_per_tok`` module attribute;
    restores them all, by identity of the objects touched, when the block exits (also on error).

    Yields the qualified names of the routers changed.

    Raises:
        NotAMoEError: no router found.
        ValueError: ``k`` outside ``1..num_experts`` of some router.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"--topk {k!r} is invalid: expected an integer >= 1.")
    # (name, the object that holds its k, the attribute): the modules with an integer top_k, and
    # where a covered family keeps k elsewhere (Gemma 4's router config, DBRX's FFN block)
    targets = [(name, module, "top_k") for name, module in find_routers(model)]
    known = {id(owner) for _, owner, _ in targets}
    targets += [target for target in _covered_top_k_owners(model) if id(target[1]) not in known]
    if not targets:
        raise NotAMoEError(
            f"{type(model).__name__} has no router with an integer `top_k` attribute, so the inference "
            "top-k cannot be overridden. Supported: transformers 5.x MoE models whose routers read "
            "self.top_k in forward (OLMoE, Qwen3-MoE, Mixtral, DeepSeek-V3, ...)."
        )
    config_experts = config_num_experts(getattr(model, "config", None))
    for name, module, _ in targets:
        experts = _int_attr(module, EXPERT_COUNT_KEYS) or config_experts
        if experts is not None and k > experts:
            raise ValueError(
                f"--topk {k} is invalid for router {name!r}: it has {experts} experts (expected 1 <= k <= {experts})."
            )

    saved = AttributePatches()
    try:
        router_ids = {id(owner) for _, owner, _ in targets}
        configs: dict[int, Any] = {}  # by identity: the model and its submodules share one config
        for module in model.modules():
            cfg = getattr(module, "config", None)
            for candidate in (cfg, getattr(cfg, "text_config", None)):
                if candidate is not None and not isinstance(candidate, Mapping):
                    configs.setdefault(id(candidate), candidate)
            if id(module) not in router_ids and isinstance(getattr(module, "num_experts_per_tok", None), int):
                saved.set(module, "num_experts_per_tok", k)
        for cfg in configs.values():
            for key in TOPK_CONFIG_KEYS:
                if isinstance(getattr(cfg, key, None), int):
                    saved.set(cfg, key, k)
        for _, owner, attribute in targets:  # a config shared by every router is set once
            if getattr(owner, attribute) != k:
                saved.set(owner, attribute, k)
        logger.info("top-k override: %d routers set to top_k=%d", len(targets), k)
        yield [name for name, _, _ in targets]
    finally:
        saved.restore()


__all__ = [
    "EXPERT_COUNT_KEYS",
    "TOPK_CONFIG_KEYS",
    "NotAMoEError",
    "config_num_experts",
    "config_topk",
    "find_routers",
    "megatron",
    "transformers",
]
