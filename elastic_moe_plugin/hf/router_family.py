"""One transformers MoE router family as data (:class:`RouterFamily`), and the builders of the rows
that share a shape (:mod:`.family_table` holds the rows).

A family names its classes, where the router sits, and the data of its routing: the rule kind and
the logits of :mod:`.rules`, the selection bias, how it renormalises, and the dtype of the weights
it returns; and, for the shapes beyond a router module with ``forward(hidden_states) ->
(logits, weights, ids)``, how its call differs: arguments the block passes in (MiniMax-M2's bias),
a router on the decoder layer (Gemma 4), routing in a method of the block (DBRX), several routers
in a layer (ERNIE-4.5-VL), shared experts normalised with the kept ones (Inkling), routers that
cannot rank in some layers (DeepSeek-V4's hash layers), experts of the family's own.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any, Literal

from elastic_moe_plugin.core.routing import SIGMOID_EPS


@dataclasses.dataclass(frozen=True)
class RouterFamily:
    """One covered router class and the decoder layer that owns it.

    Attributes:
        name: a label, e.g. ``"olmoe"`` or ``"qwen3_omni_moe.talker"``.
        module: the transformers model folder, ``transformers.models.<module>.modeling_<module>``.
        router: the router class name; the experts class is :attr:`experts`.
        decoder_layer: the decoder-layer class whose ``__init__(config, layer_idx)`` builds it.
        rule: the rule kind (:data:`.rules.RULES`).
        logits: how the router computes z (:data:`.rules.LOGITS`).
        sites: where the router sits, relative to the decoder layer (``mlp.gate``, ``mlp.router``, ...).
        experts_class: the experts class name where it is not the router's with ``Experts`` for
            ``TopKRouter``/``TopkRouter``/``Gate``.
        bias: the selection-only bias, as an attribute path of the router (None: no bias).
        forward_args: the router forward's parameters after ``hidden_states`` (MiniMax-M2:
            ``("e_score_correction_bias",)``: the block passes its own buffer), in order.
        bias_argument: the one of :attr:`forward_args` that holds the selection-only bias, where
            the block passes it in instead of the router holding it (None: :attr:`bias` or none).
        scaling: the router attribute holding the factor its weights are multiplied by
            (``routed_scaling_factor``, HY-V3's ``router_scaling_factor``, AFMoE's ``route_scale``);
            read where the rule scales (an attribute the router lacks, or 1.0, scales by nothing).
        top_k_path / num_experts_path: where the router holds k and E, as attribute paths
            (``top_k`` / ``num_experts``; Gemma 4's router reads ``config.top_k_experts``).
        first_output: what the router returns first, ``"logits"`` z or the ``"probabilities"``
            softmax(z) in fp32 (Gemma 4); transformers' output recorder collects it.
        per_expert_scale: a router parameter [E] the kept weights are multiplied by, per expert id,
            after the renormalisation (Gemma 4's ``per_expert_scale``; None: none).
        static_routers: ``(class name, why)`` of router classes in the same blocks that have no
            ranking to cut at κ (DeepSeek-V4's hash-routed layers): their layers stay stock top-k,
            and the plan line says why.
        ranking_layers: ``(config attribute, kind)``: the layers whose router ranks are those whose
            entry of the config's per-layer list is ``kind`` (DeepSeek-V4: ``("mlp_layer_types",
            "moe")``); a ``layers`` selection naming none of them is refused at model build.
        renormalizes: ``"norm_topk_prob"`` (the router's flag decides), ``"always"``, ``"never"``,
            ``"selection_fn"`` (Cohere2: softmax mode always, sigmoid mode iff ``norm_topk_prob``),
            or ``"p_norm"`` (DBRX: by a p-norm, unless ``moe_normalize_expert_weights`` is None).
        renormalization_eps: ε added to the kept sum (DeepSeek-style sigmoid routers: 1e-20).
        masked_group_value: what group-limited selection writes over dropped groups (AXK-2: 0.0).
        group_score_topk: the top selection values summed to score a group (DeepSeek-V2: 1, the max).
        scores_in_fp32: scores and weights in fp32 (False: the logits' dtype, as GPT-OSS and Aria).
        weights_dtype: the dtype of the returned weights: the logits' (``"logits"``), the fp32
            scores' (``"scores"``: Mixtral, DeepSeek-V3), or the hidden states' (``"input"``: ERNIE,
            Granite-MoE, Cohere2, Laguna), or the hidden states' then fp32 (``"input_then_fp32"``:
            Ergo rounds them to the hidden dtype and returns fp32).
        routing_method: where the family routes in a method of its MoE block instead of a router
            module (DBRX's and Jamba 5.19's ``route_tokens_to_experts``): its name. :attr:`router` then
            names the block class, :attr:`sites` the block, :attr:`forward_args` the method's
            parameters (``router_logits``: the block's Linear computed them), and
            :attr:`method_outputs` what it returns.
        method_outputs: the routing method's outputs, in order (DBRX: weights first).
        other_decoder_layers: further decoder-layer classes that build the same router (Jamba
            5.25: attention and Mamba layers).
        merging_block: the MoE block class whose second output merges its routers' logits by token
            type, which transformers' loss reads (ERNIE-4.5-VL's text and vision routers:
            :func:`.routing.merging_block_forward`).
        shared_sink: the kept routed weights are normalised together with the family's shared
            experts (Inkling: w_i = σ(z_i) / (Σ_kept σ(z_j) + Σ_shared σ(z_s)) × scales); the
            router's logits [T, E + S] end with the shared experts', and it returns their weights
            fourth (:func:`.routing.shared_sink_weights`).
        experts_slot_sum: the family's experts are not transformers' dispatcher, but compute
            Σ_j w_tj · f_{e_tj}(x_t) over a token's slots (DBRX, Step-3.7 in 5.19, Ergo): they run
            on the kept pairs as one-slot tokens (:mod:`.experts`), so their compute follows κ too.
        ids_first: the router returns ``(ids, weights, logits)``. Not set in the table: read from the
            installed transformers where the family's output recorder says where the logits are
            (Granite-MoE and Aria return ids first in 5.19, logits first from 5.25;
            :func:`.families.covered_router_classes`).
        required: apply() fails if the installed transformers lacks it (OLMoE and Qwen3-MoE, the
            paper's SFT backbones).
    """

    name: str
    module: str
    router: str
    decoder_layer: str
    rule: str = "softmax_topk"
    logits: str = "linear"
    sites: tuple[str, ...] = ("mlp.gate",)
    experts_class: str | None = None
    bias: str | None = None
    renormalizes: Literal["norm_topk_prob", "always", "never", "selection_fn", "p_norm"] = "norm_topk_prob"
    renormalization_eps: float = 0.0
    masked_group_value: float = float("-inf")
    group_score_topk: int = 2
    scores_in_fp32: bool = True
    weights_dtype: Literal["logits", "scores", "input", "input_then_fp32"] = "logits"
    forward_args: tuple[str, ...] = ()
    bias_argument: str | None = None
    scaling: str | None = "routed_scaling_factor"
    top_k_path: str = "top_k"
    num_experts_path: str = "num_experts"
    first_output: Literal["logits", "probabilities"] = "logits"
    per_expert_scale: str | None = None
    static_routers: tuple[tuple[str, str], ...] = ()
    ranking_layers: tuple[str, str] | None = None
    routing_method: str | None = None
    method_outputs: tuple[str, ...] = ("weights", "ids")
    other_decoder_layers: tuple[str, ...] = ()
    merging_block: str | None = None
    shared_sink: bool = False
    experts_slot_sum: bool = False
    ids_first: bool = False
    required: bool = False
    #: what the patched method returns, in order (``logits``, ``weights``, ``ids``, ``shared_weights``),
    #: and its parameters after ``self``: fields set once, because every training forward reads them
    outputs: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False)
    call_parameters: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.routing_method:
            outputs = self.method_outputs
        elif self.shared_sink:
            outputs = ("logits", "weights", "ids", "shared_weights")
        else:
            outputs = ("ids", "weights", "logits") if self.ids_first else ("logits", "weights", "ids")
        object.__setattr__(self, "outputs", outputs)
        parameters = self.forward_args if self.routing_method else ("hidden_states", *self.forward_args)
        object.__setattr__(self, "call_parameters", parameters)

    @property
    def module_path(self) -> str:
        return f"transformers.models.{self.module}.modeling_{self.module}"

    @property
    def experts(self) -> str:
        """The experts class name (``tests/hf/test_hf_families.py`` checks it against the blocks
        transformers builds)."""
        return self.experts_class or re.sub(r"(TopKRouter|TopkRouter|Gate)$", "Experts", self.router)

    @property
    def patched_method(self) -> str:
        """The method the adapter replaces: the router's ``forward``, or the block's routing method."""
        return self.routing_method or "forward"

    @property
    def decoder_layers(self) -> tuple[str, ...]:
        """Every decoder-layer class that builds this router."""
        return (self.decoder_layer, *self.other_decoder_layers)

    def top_k_of(self, router: Any) -> int:
        """k of one of this family's routers."""
        return int(operator.attrgetter(self.top_k_path)(router))

    def num_experts_of(self, router: Any) -> int:
        """E of one of this family's routers (the ids it ranks)."""
        return int(operator.attrgetter(self.num_experts_path)(router))


def softmax_family(name: str, prefix: str, **fields: Any) -> RouterFamily:
    """A softmax → top-k family whose classes are ``<prefix>TopKRouter`` and ``<prefix>DecoderLayer``."""
    module = fields.pop("module", name)
    return RouterFamily(name, module, f"{prefix}TopKRouter", f"{prefix}DecoderLayer", **fields)


def deepseek_family(name: str, prefix: str, **fields: Any) -> RouterFamily:
    """A DeepSeek-V3-style family (sigmoid, correction bias, groups, ε = 1e-20, fp32 logits and
    weights, × ``routed_scaling_factor``): ``<prefix>TopkRouter`` in ``<prefix>DecoderLayer``."""
    defaults: dict[str, Any] = {
        "rule": "sigmoid_bias",
        "logits": "linear_fp32",
        "bias": "e_score_correction_bias",
        "renormalization_eps": SIGMOID_EPS,
        "weights_dtype": "scores",
    }
    layer = fields.pop("decoder_layer", f"{prefix}DecoderLayer")
    return RouterFamily(name, name, f"{prefix}TopkRouter", layer, **{**defaults, **fields})


def deepseek_v2_family(name: str, prefix: str) -> RouterFamily:
    """A DeepSeek-V2-style family (softmax of fp32 logits, group-limited by each group's max with
    dropped groups at 0.0, never renormalised, × ``routed_scaling_factor``): ``<prefix>TopkRouter``
    in ``<prefix>DecoderLayer``."""
    return RouterFamily(
        name,
        name,
        f"{prefix}TopkRouter",
        f"{prefix}DecoderLayer",
        rule="softmax_groups",
        logits="linear_fp32",
        renormalizes="never",
        group_score_topk=1,
        weights_dtype="scores",
    )


def sigmoid_family(name: str, router: str, decoder_layer: str, **fields: Any) -> RouterFamily:
    """A sigmoid family with a selection-only correction bias, always renormalised over the kept,
    fp32 weights (MiniMax-M3, Laguna, Step-3.7, Ergo, Muse-Spark): ``router`` in ``decoder_layer``."""
    defaults: dict[str, Any] = {
        "rule": "sigmoid_bias",
        "bias": "e_score_correction_bias",
        "renormalizes": "always",
        "weights_dtype": "scores",
    }
    return RouterFamily(name, name, router, decoder_layer, **{**defaults, **fields})


def logits_topk_family(name: str, prefix: str, **fields: Any) -> RouterFamily:
    """A family that ranks by the logits and softmaxes the kept ones (GPT-OSS style)."""
    defaults: dict[str, Any] = {"rule": "logits_topk", "renormalizes": "always", "sites": ("mlp.router",)}
    return RouterFamily(name, name, f"{prefix}TopKRouter", f"{prefix}DecoderLayer", **{**defaults, **fields})


__all__ = [
    "RouterFamily",
    "deepseek_family",
    "deepseek_v2_family",
    "logits_topk_family",
    "sigmoid_family",
    "softmax_family",
]
