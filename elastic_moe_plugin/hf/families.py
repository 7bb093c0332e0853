"""The covered transformers MoE router families, and where their routers sit in a model.

Every covered family routes at ``model.layers.<i>.mlp.gate`` with ``forward(hidden_states) ->
(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])``: a softmax in fp32, a top-k on
the probabilities and, where the family does, a renormalisation. The block hands the router's
``top_k_index`` and ``top_k_weights`` unchanged to ``mlp.experts``, an ``@use_experts_implementation``
class named like the router with ``Experts`` for ``TopKRouter``. The table records the class
names and the two ways the families differ (whether ``norm_topk_prob`` decides the gate, and
whether the weights are cast back to the logits' dtype). Routers of another shape (sigmoid scores
with a correction bias, top-k on the logits, jitter inside the router, hash routing: DeepSeek-V4,
GPT-OSS, Granite-MoE, Phi-MoE, ...) are not covered; ``docs/transformers.md`` lists them.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import torch

from elastic_moe_plugin.core.patching import unwrap
from elastic_moe_plugin.core.router_state import ensure_state, state_of

# "...layers.<i>.mlp.gate": the ModuleList index of the decoder layer is its layer_idx.
_ROUTER_NAME = re.compile(r"(?:^|\.)(\d+)\.mlp\.gate$")


@dataclasses.dataclass(frozen=True)
class RouterFamily:
    """One covered router class and the decoder layer that owns it.

    Attributes:
        name: a label, e.g. ``"olmoe"`` or ``"qwen3_omni_moe.talker"``.
        module: the transformers model folder, ``transformers.models.<module>.modeling_<module>``.
        router: the router class name (``mlp.gate``); the experts class (``mlp.experts``) is
            :attr:`experts`.
        decoder_layer: the decoder-layer class whose ``__init__(config, layer_idx)`` builds it.
        reads_norm_topk_prob: the stock router renormalises iff ``router.norm_topk_prob``; False
            means it always renormalises (Mixtral, MiniMax, Qwen3.5/VL text).
        casts_weights: the stock router casts the top-k weights to the logits' dtype (False:
            they stay fp32, as in Mixtral and MiniMax).
        required: apply() fails if the installed transformers lacks it (OLMoE and Qwen3-MoE, the
            paper's SFT backbones).
    """

    name: str
    module: str
    router: str
    decoder_layer: str
    reads_norm_topk_prob: bool = True
    casts_weights: bool = True
    required: bool = False

    @property
    def module_path(self) -> str:
        return f"transformers.models.{self.module}.modeling_{self.module}"

    @property
    def experts(self) -> str:
        """The experts class name: ``<Prefix>TopKRouter`` → ``<Prefix>Experts`` in every covered family
        (``tests/hf/test_hf_families.py`` checks it against the blocks transformers builds)."""
        return self.router.replace("TopKRouter", "Experts")


FAMILIES: tuple[RouterFamily, ...] = (
    RouterFamily("olmoe", "olmoe", "OlmoeTopKRouter", "OlmoeDecoderLayer", required=True),
    RouterFamily("qwen3_moe", "qwen3_moe", "Qwen3MoeTopKRouter", "Qwen3MoeDecoderLayer", required=True),
    RouterFamily("flex_olmo", "flex_olmo", "FlexOlmoTopKRouter", "FlexOlmoDecoderLayer"),
    RouterFamily("qwen2_moe", "qwen2_moe", "Qwen2MoeTopKRouter", "Qwen2MoeDecoderLayer"),
    RouterFamily("qwen3_next", "qwen3_next", "Qwen3NextTopKRouter", "Qwen3NextDecoderLayer"),
    RouterFamily(
        "qwen3_5_moe", "qwen3_5_moe", "Qwen3_5MoeTopKRouter", "Qwen3_5MoeDecoderLayer", reads_norm_topk_prob=False
    ),
    RouterFamily(
        "qwen3_vl_moe",
        "qwen3_vl_moe",
        "Qwen3VLMoeTextTopKRouter",
        "Qwen3VLMoeTextDecoderLayer",
        reads_norm_topk_prob=False,
    ),
    RouterFamily(
        "qwen3_omni_moe.thinker",
        "qwen3_omni_moe",
        "Qwen3OmniMoeThinkerTextTopKRouter",
        "Qwen3OmniMoeThinkerTextDecoderLayer",
    ),
    RouterFamily(
        "qwen3_omni_moe.talker", "qwen3_omni_moe", "Qwen3OmniMoeTalkerTextTopKRouter", "Qwen3OmniMoeTalkerDecoderLayer"
    ),
    RouterFamily("qwen4_exp", "qwen4_exp", "Qwen4ExpTextTopKRouter", "Qwen4ExpTextDecoderLayer"),
    RouterFamily(
        "mixtral",
        "mixtral",
        "MixtralTopKRouter",
        "MixtralDecoderLayer",
        reads_norm_topk_prob=False,
        casts_weights=False,
    ),
    RouterFamily(
        "minimax",
        "minimax",
        "MiniMaxTopKRouter",
        "MiniMaxDecoderLayer",
        reads_norm_topk_prob=False,
        casts_weights=False,
    ),
    RouterFamily("mellum", "mellum", "MellumTopKRouter", "MellumDecoderLayer"),
)


@dataclasses.dataclass(frozen=True)
class LoadedFamily:
    """A family's classes in the installed transformers.

    Attributes:
        experts: the experts class, or None where it is not transformers' implementation
            dispatcher over ``forward(hidden_states, top_k_index, top_k_weights)`` (then expert
            compute is left stock: all b slots, zero-weighted beyond κ).
    """

    module: Any
    router: type
    decoder_layer: type
    experts: type | None


def load_family(family: RouterFamily) -> LoadedFamily | str:
    """The family's classes, or a reason why the family cannot be patched."""
    try:
        module = importlib.import_module(family.module_path)
    except ImportError as error:
        return f"{family.module_path} does not import ({error})"
    router_cls = getattr(module, family.router, None)
    layer_cls = getattr(module, family.decoder_layer, None)
    if router_cls is None or layer_cls is None:
        missing = family.router if router_cls is None else family.decoder_layer
        return f"{family.module_path}.{missing} does not exist"
    # The generic patcher re-implements exactly `forward(self, hidden_states)`; anything else is a
    # different router and must not be replaced silently.
    forward = unwrap(router_cls.__dict__.get("forward"))
    if forward is None or list(inspect.signature(forward).parameters) != ["self", "hidden_states"]:
        return f"{family.module_path}.{family.router}.forward is not forward(self, hidden_states)"
    init = layer_cls.__dict__.get("__init__")
    if init is None or "layer_idx" not in inspect.signature(init).parameters:
        return f"{family.module_path}.{family.decoder_layer}.__init__ takes no layer_idx"
    return LoadedFamily(module, router_cls, layer_cls, _experts_class(module, family))


def _experts_class(module: Any, family: RouterFamily) -> type | None:
    """The experts class if it is transformers' dispatcher over the eager ``forward(hidden_states,
    top_k_index, top_k_weights)`` (what ``@use_experts_implementation`` installs), else None."""
    experts_cls = getattr(module, family.experts, None)
    dispatcher = unwrap(vars(experts_cls).get("forward")) if isinstance(experts_cls, type) else None
    eager = getattr(dispatcher, "__wrapped__", None)  # functools.wraps in use_experts_implementation
    if not callable(getattr(experts_cls, "_apply_gate", None)) or eager is None:
        return None
    if list(inspect.signature(eager).parameters) != ["self", "hidden_states", "top_k_index", "top_k_weights"]:
        return None
    return experts_cls


def covered_router_classes() -> dict[type, RouterFamily]:
    """{router class: family} for every covered family importable from the installed transformers."""
    classes = {}
    for family in FAMILIES:
        loaded = load_family(family)
        if not isinstance(loaded, str):
            classes[loaded.router] = family
    return classes


def covered_routers(model: torch.nn.Module) -> Iterator[tuple[str, Any, RouterFamily]]:
    """``(qualified name, router, family)`` of every covered router in ``model``, in module order (the
    router typed ``Any``: its attributes are its family's, ``top_k``, ``num_experts``, ...)."""
    classes = covered_router_classes()
    for name, module in model.named_modules():
        family = classes.get(type(module))
        if family is not None:
            yield name, module, family


def layer_index_from_name(name: str) -> int | None:
    """The decoder-layer index in a router's qualified name (``...layers.<i>.mlp.gate``), or None."""
    match = _ROUTER_NAME.search(name)
    return int(match.group(1)) if match else None


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


# ---------------------------------------------------------------------------------- config.json
#: config keys that hold a MoE's top-k, and its routed-expert count (transformers' names across families)
TOPK_CONFIG_KEYS = ("num_experts_per_tok", "moe_topk", "moe_top_k")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


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
