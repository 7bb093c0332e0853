"""Where the covered transformers MoE routers are (:mod:`.family_table`), in the installed
transformers and in a model: loading each family's classes, finding and tagging routers by their
decoder-layer index, refusing a MoE model none of whose routers is covered, and reading a
checkpoint's ``config.json`` before the model is built.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch

from elastic_moe_plugin.core.patching import unwrap
from elastic_moe_plugin.core.router_state import ensure_state, state_of
from elastic_moe_plugin.hf.family_table import FAMILIES, NOT_TOP_K, REFUSED
from elastic_moe_plugin.hf.router_family import RouterFamily

# "...layers.<i>.<site>": the ModuleList index of the decoder layer is its layer_idx.
_ROUTER_NAME = re.compile(
    r"(?:^|\.)(\d+)\.(" + "|".join(sorted({re.escape(site) for f in FAMILIES for site in f.sites})) + r")$"
)


@dataclasses.dataclass(frozen=True)
class LoadedFamily:
    """A family's classes in the installed transformers.

    Attributes:
        router: the router class (or the block class whose routing method is patched).
        decoder_layers: the decoder-layer classes that build it.
        experts: the experts class whose forward the adapter wraps: transformers' implementation
            dispatcher over ``forward(hidden_states, top_k_index, top_k_weights)``, or the family's
            own experts where the table says they sum over slots
            (:attr:`~.router_family.RouterFamily.experts_slot_sum`); None otherwise (then expert
            compute is left stock: all b slots, zero-weighted beyond κ).
        static_routers: ``{router class: why it stays static}`` of the family's
            :attr:`~.router_family.RouterFamily.static_routers` that the installed transformers has.
        own_experts: :attr:`experts` is the family's own class, not transformers' dispatcher.
    """

    module: Any
    router: type
    decoder_layers: tuple[type, ...]
    experts: type | None
    static_routers: dict[type, str] = dataclasses.field(default_factory=dict)
    own_experts: bool = False


def load_family(family: RouterFamily) -> LoadedFamily | str:
    """The family's classes, or a reason why the family cannot be patched."""
    try:
        module = importlib.import_module(family.module_path)
    except ImportError as error:
        return f"{family.module_path} does not import ({error})"
    router_cls = getattr(module, family.router, None)
    if router_cls is None:
        return f"{family.module_path}.{family.router} does not exist"
    layers = []
    for name in family.decoder_layers:
        layer_cls = getattr(module, name, None)
        if layer_cls is None:
            return f"{family.module_path}.{name} does not exist"
        init = layer_cls.__dict__.get("__init__")
        if init is None or "layer_idx" not in inspect.signature(init).parameters:
            return f"{family.module_path}.{name}.__init__ takes no layer_idx"
        layers.append(layer_cls)
    # The generic patcher re-implements exactly `forward(self, hidden_states, *family.forward_args)`
    # (or the routing method's parameters); anything else is a different router and must not be
    # replaced silently.
    method = unwrap(router_cls.__dict__.get(family.patched_method))
    expected = ["self", *family.call_parameters]
    if method is None or list(inspect.signature(method).parameters) != expected:
        name = family.patched_method
        return f"{family.module_path}.{family.router}.{name} is not {name}({', '.join(expected)})"
    if family.merging_block is not None and not isinstance(getattr(module, family.merging_block, None), type):
        return f"{family.module_path}.{family.merging_block} does not exist"
    static: dict[type, str] = {}
    for name, why in family.static_routers:
        static_cls = getattr(module, name, None)
        if isinstance(static_cls, type):
            static[static_cls] = why
    experts_cls, own = _experts_class(module, family)
    return LoadedFamily(module, router_cls, tuple(layers), experts_cls, static, own)


def _experts_class(module: Any, family: RouterFamily) -> tuple[type | None, bool]:
    """The experts class if it is transformers' dispatcher over an eager ``forward(hidden_states,
    top_k_index, top_k_weights)`` (what ``@use_experts_implementation`` installs; it also gives
    every class an ``_apply_gate``), or the family's own experts with that forward where the table
    says they sum over slots (then ``(class, True)``); else ``(None, False)``."""
    experts_cls = getattr(module, family.experts, None)
    dispatcher = unwrap(vars(experts_cls).get("forward")) if isinstance(experts_cls, type) else None
    eager = getattr(dispatcher, "__wrapped__", None)  # functools.wraps in use_experts_implementation
    own = family.experts_slot_sum and eager is None and dispatcher is not None
    if own:
        eager = dispatcher  # the family's own experts, summing over slots as the dispatcher does
    if eager is None or not (own or callable(getattr(experts_cls, "_apply_gate", None))):
        return None, False
    # (hidden_states, top_k_index, top_k_weights), whatever the family names them (GPT-OSS:
    # router_indices, routing_weights): the block passes them by position
    if len(inspect.signature(eager).parameters) != 4:
        return None, False
    return experts_cls, own


def covered_router_classes() -> dict[type, RouterFamily]:
    """{router class: family} for every covered family importable from the installed transformers
    (looked up once per transformers: each call after the first is a dictionary copy)."""
    import transformers

    return dict(_covered_router_classes(transformers.__version__))


@functools.lru_cache(maxsize=2)
def _covered_router_classes(version: str) -> tuple[tuple[type, RouterFamily], ...]:
    found = []
    for family in FAMILIES:
        loaded = load_family(family)
        if not isinstance(loaded, str):
            found.append((loaded.router, installed_family(family, loaded)))
    return tuple(found)


#: (transformers version, family name) -> (router class, family, {static router class: why}) or
#: None, filled as each family's modeling module appears in ``sys.modules``
_IMPORTED: dict[tuple[str, str], tuple[type, RouterFamily, dict[type, str]] | None] = {}
#: router class -> family, of every family :func:`imported_router_classes` has found
_FAMILY_OF: dict[type, RouterFamily] = {}


def _imported_families() -> Iterator[tuple[type, RouterFamily, dict[type, str]]]:
    """``(router class, family, {static router class: why})`` of every covered family whose modeling
    module is imported, each loaded once per transformers version."""
    import transformers

    for family in FAMILIES:
        key = (transformers.__version__, family.name)
        if key not in _IMPORTED:
            if family.module_path not in sys.modules:
                continue
            loaded = load_family(family)
            _IMPORTED[key] = (
                None
                if isinstance(loaded, str)
                else (loaded.router, installed_family(family, loaded), loaded.static_routers)
            )
        entry = _IMPORTED[key]
        if entry is not None:
            yield entry


def imported_router_classes() -> dict[type, RouterFamily]:
    """:func:`covered_router_classes` restricted to the families whose modeling module is imported:
    every router class a built model can hold, without importing the other families' modules (all
    of them: about 6 s of a process's start-up on a CPU core, for the few a run uses)."""
    found = {router: family for router, family, _ in _imported_families()}
    _FAMILY_OF.update(found)
    return found


def model_routers(model: torch.nn.Module) -> Iterator[tuple[str, Any, RouterFamily, str | None]]:
    """``(qualified name, router, family, why it cannot rank)`` of every router of a covered family
    in ``model``, in module order, in one pass: ``why`` is None for a router that ranks, the reason
    for one that cannot (DeepSeek-V4's hash-routed layers, whose layers stay stock top-k)."""
    classes: dict[type, tuple[RouterFamily, str | None]] = {}
    for router, family, static in _imported_families():
        classes[router] = (family, None)
        classes.update({cls: (family, why) for cls, why in static.items()})
    _FAMILY_OF.update({cls: family for cls, (family, why) in classes.items() if why is None})
    for name, module in model.named_modules():
        entry = classes.get(type(module))
        if entry is not None:
            yield name, module, entry[0], entry[1]


def static_routers(model: torch.nn.Module) -> Iterator[tuple[str, Any, RouterFamily, str]]:
    """``(qualified name, router, family, why)`` of every router of ``model`` that belongs to a
    covered family but has no ranking to cut at κ (:func:`model_routers`)."""
    for name, router, family, why in model_routers(model):
        if why is not None:
            yield name, router, family, why


def ranking_layers(family: RouterFamily, config: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(the 0-based decoder layers whose router ranks, the others)``, where the family mixes
    ranking and static routers (:attr:`~.router_family.RouterFamily.ranking_layers`, read from the
    model's config: DeepSeek-V4's ``mlp_layer_types``); None where every MoE layer ranks."""
    if family.ranking_layers is None or config is None:
        return None
    attribute, kind = family.ranking_layers
    kinds = getattr(config, attribute, None)
    if kinds is None:
        return None
    ranking = tuple(index for index, entry in enumerate(kinds) if entry == kind)
    return ranking, tuple(index for index in range(len(kinds)) if index not in ranking)


def family_of(router_cls: type) -> RouterFamily:
    """The family of a covered router class (the elastic forward's lookup: one dictionary read
    once the class's module has been seen, instead of a pass over every family).

    Raises:
        KeyError: ``router_cls`` is no covered router class.
    """
    family = _FAMILY_OF.get(router_cls)
    return family if family is not None else imported_router_classes()[router_cls]


def installed_family(family: RouterFamily, loaded: LoadedFamily) -> RouterFamily:
    """``family`` with what only the installed transformers can tell: the order its router returns."""
    return dataclasses.replace(family, ids_first=_logits_last(loaded))


def _logits_last(loaded: LoadedFamily) -> bool:
    """Whether the router returns ``(ids, weights, logits)``: the family's ``router_logits`` output
    recorder (``_can_record_outputs``, what transformers reads the logits with) says index 2."""
    for owner in vars(loaded.module).values():
        recorders = getattr(owner, "_can_record_outputs", None) if isinstance(owner, type) else None
        recorder = recorders.get("router_logits") if isinstance(recorders, dict) else None
        if getattr(recorder, "target_class", None) is loaded.router:
            return getattr(recorder, "index", 0) == 2
    return False


def covered_routers(model: torch.nn.Module) -> Iterator[tuple[str, Any, RouterFamily]]:
    """``(qualified name, router, family)`` of every covered router in ``model``, in module order (the
    router typed ``Any``: its attributes are its family's, ``top_k``, ``num_experts``, ...)."""
    for name, router, family, why in model_routers(model):
        if why is None:
            yield name, router, family


def layer_index_from_name(name: str) -> int | None:
    """The decoder-layer index in a router's qualified name (``...layers.<i>.<site>``, a site of
    any covered family: ``mlp.gate``, ``mlp.router``, ``mixer.gate``, ...), or None."""
    match = _ROUTER_NAME.search(name)
    return int(match.group(1)) if match else None


def router_stack(name: str) -> str | None:
    """The part of a router's qualified name before its layer index, the stack it belongs to
    (``model.layers`` in ``model.layers.3.mlp.gate``, ``thinker.model.layers`` in Qwen3-Omni's), or None."""
    match = _ROUTER_NAME.search(name)
    return name[: match.start(1)].rstrip(".") if match else None


def router_site(name: str) -> str | None:
    """The site part of a router's qualified name (``mlp.gate`` in ``model.layers.3.mlp.gate``), or None."""
    match = _ROUTER_NAME.search(name)
    return match.group(2) if match else None


def set_layer_index(router: torch.nn.Module, index: int) -> None:
    """Tag ``router`` with its 0-based decoder-layer index (what the patched decoder layer does at
    construction, and :func:`~.patch.tag_layers` for a model built before ``apply``); its plan is
    resolved again at its next training forward."""
    state = ensure_state(router)
    if state.layer_index != index:
        state.layer_index, state.generation = index, None


def router_layer_index(name: str, router: torch.nn.Module) -> int | None:
    """The 0-based layer index of a router: the tag set at construction, else its module path."""
    state = state_of(router)
    index = None if state is None else state.layer_index
    return index if index is not None else layer_index_from_name(name)


# ---------------------------------------------------------------------------------- uncovered models
def model_folder(model_class: type) -> str | None:
    """The transformers model folder a model class comes from (``modeling_<folder>``), or None."""
    match = re.match(r"transformers\.models\.(\w+)\.modeling_\w+$", model_class.__module__)
    return match.group(1) if match else None


def routes_to_experts(config: Any) -> bool:
    """Whether a config (a ``PretrainedConfig`` or its dict, nested configs included) routes to
    more than one expert: an expert count above 1 under any of transformers' names."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, dict):
        counts = (value for key, value in config.items() if key in EXPERT_COUNT_KEYS)
        return any(_positive_int(value) and value > 1 for value in counts) or any(
            routes_to_experts(value) for value in config.values()
        )
    if isinstance(config, list):
        return any(routes_to_experts(value) for value in config)
    return False


def uncovered_moe(model: torch.nn.Module) -> str | None:
    """Why ``model``, a mixture-of-experts model, has no router this adapter can make elastic;
    None when it has a covered router or routes to no experts. Names the family, its router
    classes and the reason from :data:`REFUSED`."""
    config = getattr(model, "config", None)
    if config is None or model_folder(type(model)) in NOT_TOP_K or not routes_to_experts(config):
        return None
    classes = imported_router_classes()
    if any(type(module) in classes for module in model.modules()):
        return None
    folder = model_folder(type(model))
    routers = sorted(
        {type(m).__name__ for m in model.modules() if re.search(r"(Router|Gate|Gating)$", type(m).__name__)}
    )
    static = next((why for _, _, _, why in static_routers(model)), None)
    reason = (
        f"every MoE layer of it is {static}"
        if static is not None
        else REFUSED.get(folder or "", "its routers are not among the covered families")
    )
    where = f" ({', '.join(routers)})" if routers else ""
    return f"{type(model).__name__} is a {folder or 'transformers'} mixture-of-experts model{where}, and {reason}"


# ---------------------------------------------------------------------------------- config.json
#: config keys that hold a MoE's top-k, and its routed-expert count (transformers' names across families)
TOPK_CONFIG_KEYS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k", "num_experts_per_token", "top_k_experts")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclasses.dataclass(frozen=True)
class ConfigRouters:
    """What a checkpoint's ``config.json`` says about its routers, read before the model is built.

    Attributes:
        model_type: the config's ``model_type`` (None if it has none).
        shape: top-k, routed experts and decoder layers where the config (or its ``text_config``)
            holds them as plain integers, else None.
        declares_experts: some top-k or expert count appears anywhere in the config, nested
            configs included; False means a dense model.
        covered: ``model_type`` is the model folder of a covered family (:data:`FAMILIES`).
    """

    model_type: str | None
    shape: Any
    declares_experts: bool
    covered: bool


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _declares_experts(config: Any) -> bool:
    if isinstance(config, dict):
        return any(
            key in TOPK_CONFIG_KEYS + EXPERT_COUNT_KEYS and _positive_int(value) for key, value in config.items()
        ) or any(_declares_experts(value) for value in config.values())
    if isinstance(config, list):
        return any(_declares_experts(value) for value in config)
    return False


def config_routers(config: dict) -> ConfigRouters:
    """:class:`ConfigRouters` of a parsed ``config.json``."""
    from elastic_moe_plugin.core.config import ModelShape

    shape = None
    for part in (config, config.get("text_config")):
        if not isinstance(part, dict):
            continue
        topk = next((part[key] for key in TOPK_CONFIG_KEYS if _positive_int(part.get(key))), None)
        experts = next((part[key] for key in EXPERT_COUNT_KEYS if _positive_int(part.get(key))), None)
        if topk is not None and experts is not None:
            layers = part.get("num_hidden_layers")
            shape = ModelShape(topk, experts, layers if _positive_int(layers) else None)
            break
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    return ConfigRouters(
        model_type, shape, _declares_experts(config), covered=model_type in {family.module for family in FAMILIES}
    )


def family_names() -> str:
    """The covered router families, for messages: ``olmoe, qwen3_moe, ...``."""
    return ", ".join(dict.fromkeys(family.module for family in FAMILIES))
