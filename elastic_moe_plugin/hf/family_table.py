"""The table of transformers MoE families: the covered ones, with the data of their routing, and
the refused ones, with the reason.

Every covered family routes with ``router.forward(hidden_states) -> (router_logits [T, E],
top_k_weights [T, k], top_k_index [T, k])`` (or ids first: Granite-MoE, Aria) and hands ids and
weights unchanged to its ``experts``, an ``@use_experts_implementation`` class. A row of
:data:`FAMILIES` names the classes, where the router sits in the decoder layer (``sites``), and
the data of its routing: the rule kind and the logits of :mod:`.rules`, the selection bias, how it
renormalises, and the dtype of the weights it returns. Families of another shape are in
:data:`REFUSED`, each with the reason it cannot be made elastic (or is not yet) and what it would
take; ``docs/transformers.md`` lists both tables, generated from them
(``make docs``). :mod:`.families` finds them in models.
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
            or ``"selection_fn"`` (Cohere2: softmax mode always, sigmoid mode iff ``norm_topk_prob``).
        renormalization_eps: ε added to the kept sum (DeepSeek-style sigmoid routers: 1e-20).
        masked_group_value: what group-limited selection writes over dropped groups (AXK-2: 0.0).
        group_score_topk: the top selection values summed to score a group (DeepSeek-V2: 1, the max).
        scores_in_fp32: scores and weights in fp32 (False: the logits' dtype, as GPT-OSS and Aria).
        weights_dtype: the dtype of the returned weights: the logits' (``"logits"``), the fp32
            scores' (``"scores"``: Mixtral, DeepSeek-V3), or the hidden states' (``"input"``: ERNIE,
            Granite-MoE, Cohere2, Laguna).
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
    renormalizes: Literal["norm_topk_prob", "always", "never", "selection_fn"] = "norm_topk_prob"
    renormalization_eps: float = 0.0
    masked_group_value: float = float("-inf")
    group_score_topk: int = 2
    scores_in_fp32: bool = True
    weights_dtype: Literal["logits", "scores", "input"] = "logits"
    forward_args: tuple[str, ...] = ()
    bias_argument: str | None = None
    scaling: str | None = "routed_scaling_factor"
    top_k_path: str = "top_k"
    num_experts_path: str = "num_experts"
    first_output: Literal["logits", "probabilities"] = "logits"
    per_expert_scale: str | None = None
    static_routers: tuple[tuple[str, str], ...] = ()
    ranking_layers: tuple[str, str] | None = None
    ids_first: bool = False
    required: bool = False

    @property
    def module_path(self) -> str:
        return f"transformers.models.{self.module}.modeling_{self.module}"

    @property
    def experts(self) -> str:
        """The experts class name (``tests/hf/test_hf_families.py`` checks it against the blocks
        transformers builds)."""
        return self.experts_class or re.sub(r"(TopKRouter|TopkRouter|Gate)$", "Experts", self.router)

    def top_k_of(self, router: Any) -> int:
        """k of one of this family's routers."""
        return int(operator.attrgetter(self.top_k_path)(router))

    def num_experts_of(self, router: Any) -> int:
        """E of one of this family's routers (the ids it ranks)."""
        return int(operator.attrgetter(self.num_experts_path)(router))

    @property
    def renormalises_own_weights(self) -> bool:
        """Whether ``norm_topk_prob`` (or the selection function) decides the family's gate."""
        return self.renormalizes in ("norm_topk_prob", "selection_fn")


def _softmax(name: str, prefix: str, **fields: Any) -> RouterFamily:
    """A softmax → top-k family whose classes are ``<prefix>TopKRouter`` and ``<prefix>DecoderLayer``."""
    module = fields.pop("module", name)
    return RouterFamily(name, module, f"{prefix}TopKRouter", f"{prefix}DecoderLayer", **fields)


def _deepseek(name: str, prefix: str, **fields: Any) -> RouterFamily:
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


def _deepseek_v2(name: str, prefix: str) -> RouterFamily:
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


def _top_k_on_logits(name: str, prefix: str, **fields: Any) -> RouterFamily:
    """A family that ranks by the logits and softmaxes the kept ones (GPT-OSS style)."""
    defaults: dict[str, Any] = {"rule": "logits_topk", "renormalizes": "always", "sites": ("mlp.router",)}
    return RouterFamily(name, name, f"{prefix}TopKRouter", f"{prefix}DecoderLayer", **{**defaults, **fields})


#: why DeepSeek-V4's first layers stay static (the plan line shows it)
HASH_ROUTED = "hash-routed: experts from a token-id table, no ranking to cut at κ"

_GRANITE: dict[str, Any] = {
    "logits": "linear_then_fp32",
    "sites": ("block_sparse_moe.router",),
    "weights_dtype": "input",
}

FAMILIES: tuple[RouterFamily, ...] = (
    # softmax -> top-k by probability -> p (or p / sum of the kept p)
    _softmax("olmoe", "Olmoe", required=True),
    _softmax("qwen3_moe", "Qwen3Moe", required=True),
    _softmax("flex_olmo", "FlexOlmo"),
    _softmax("qwen2_moe", "Qwen2Moe"),
    _softmax("qwen3_next", "Qwen3Next"),
    _softmax("qwen3_5_moe", "Qwen3_5Moe", renormalizes="always"),
    RouterFamily(
        "qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoeTextTopKRouter", "Qwen3VLMoeTextDecoderLayer", renormalizes="always"
    ),
    _softmax("qwen3_omni_moe.thinker", "Qwen3OmniMoeThinkerText", module="qwen3_omni_moe"),
    RouterFamily(
        "qwen3_omni_moe.talker", "qwen3_omni_moe", "Qwen3OmniMoeTalkerTextTopKRouter", "Qwen3OmniMoeTalkerDecoderLayer"
    ),
    RouterFamily("qwen4_exp", "qwen4_exp", "Qwen4ExpTextTopKRouter", "Qwen4ExpTextDecoderLayer"),
    _softmax("mixtral", "Mixtral", renormalizes="always", weights_dtype="scores"),
    _softmax("minimax", "MiniMax", renormalizes="always", weights_dtype="scores"),
    _softmax("mellum", "Mellum"),
    _softmax("lara_mini", "LaraMini", logits="linear_fp32", weights_dtype="input"),  # 5.25+
    RouterFamily(
        "hunyuan_v1_moe",
        "hunyuan_v1_moe",
        "HunYuanMoEV1Gate",
        "HunYuanMoEV1DecoderLayer",
        logits="wg_fp32_if_built_so",
        renormalizes="always",
    ),
    # DeepSeek-V3 style: sigmoid, selection on scores + correction bias, groups, eps 1e-20, x scaling
    _deepseek("deepseek_v3", "DeepseekV3"),
    _deepseek("deepseek_v32", "DeepseekV32"),
    _deepseek("glm4_moe", "Glm4Moe"),
    _deepseek("glm4_moe_lite", "Glm4MoeLite"),
    _deepseek("glm4v_moe", "Glm4vMoeText"),
    _deepseek("glm5_next", "Glm5NextText"),
    _deepseek("glm_moe_dsa", "GlmMoeDsa"),
    _deepseek("dots1", "Dots1"),
    _deepseek("exaone_moe", "ExaoneMoe"),
    _deepseek("solar_open", "SolarOpen"),
    _deepseek("kimi_linear", "KimiLinear"),
    _deepseek("mimo_v2_flash", "MiMoV2Flash"),
    _deepseek("nemotron_h", "NemotronH", sites=("mixer.gate",), decoder_layer="NemotronHBlock"),
    _deepseek("axk1", "AXK1"),
    _deepseek("axk2", "AXK2", masked_group_value=0.0),
    _deepseek("hy_v4", "HYV4"),
    # transformers 5.25 and later
    _deepseek("bailing_hybrid", "BailingHybrid"),
    _deepseek("dots3_note", "Dots3NoteText", experts_class="Dots3NoteExperts"),
    _deepseek("hy_v4_vl", "HYV4VL"),
    _deepseek("minicpm5_moe", "MiniCPM5Moe", logits="linear_fp32_without_autocast"),
    RouterFamily(  # DeepSeek-V3's math, sorted, scaling applied by the block to the experts' output
        "beam",
        "beam",
        "BeamTopKRouter",
        "BeamDecoderLayer",
        rule="sigmoid_bias",
        logits="linear_fp32",
        bias="e_score_correction_bias",
        renormalization_eps=SIGMOID_EPS,
        weights_dtype="scores",
    ),
    RouterFamily(  # sigmoid without a bias or an epsilon
        "flint",
        "flint",
        "FlintTopKRouter",
        "FlintDecoderLayer",
        rule="sigmoid_bias",
        logits="linear_fp32_without_autocast",
        weights_dtype="scores",
    ),
    # MiniMax-M3 / Laguna: sigmoid + bias, always renormalised without eps, scaling on the experts' output
    RouterFamily(
        "minimax_m3_vl",
        "minimax_m3_vl",
        "MiniMaxM3VLTopKRouter",
        "MiniMaxM3VLDecoderLayer",
        rule="sigmoid_bias",
        logits="linear_in_weight_dtype",
        bias="e_score_correction_bias",
        renormalizes="always",
        weights_dtype="scores",
    ),
    RouterFamily(
        "laguna",
        "laguna",
        "LagunaTopKRouter",
        "LagunaDecoderLayer",
        rule="sigmoid_bias",
        logits="linear_then_fp32",
        bias="e_score_correction_bias",
        renormalizes="always",
        weights_dtype="input",
    ),
    # group-limited softmax in the logits' dtype, dropped groups masked with 0.0
    _deepseek_v2("deepseek_v2", "DeepseekV2"),
    _deepseek_v2("deepseek_ocr2", "DeepseekOcr2Text"),
    RouterFamily(  # 5.25+: Mistral-4's router in fp32, always renormalised
        "mistral_large4",
        "mistral_large4",
        "MistralLarge4TextTopkRouter",
        "MistralLarge4TextDecoderLayer",
        rule="softmax_groups",
        logits="linear_fp32",
        renormalizes="always",
        renormalization_eps=SIGMOID_EPS,
        weights_dtype="scores",
    ),
    _deepseek_v2("unlimited_ocr", "UnlimitedOcrText"),  # 5.25+
    RouterFamily(
        "mistral4",
        "mistral4",
        "Mistral4TopkRouter",
        "Mistral4DecoderLayer",
        rule="softmax_groups",
        renormalization_eps=SIGMOID_EPS,
    ),
    # top-k on the logits, then softmax over the kept logits
    _top_k_on_logits("gpt_oss", "GptOss", logits="linear_with_bias", scores_in_fp32=False),
    _top_k_on_logits("granitemoe", "GraniteMoe", **_GRANITE),
    _top_k_on_logits("granitemoeshared", "GraniteMoeShared", **_GRANITE),
    _top_k_on_logits("granitemoehybrid", "GraniteMoeHybrid", **_GRANITE),
    _top_k_on_logits("granitemoe_swa", "GraniteMoeSWA", **_GRANITE),
    RouterFamily(
        "aria",
        "aria",
        "AriaTextTopKRouter",
        "AriaTextDecoderLayer",
        rule="logits_topk",
        sites=("mlp.router",),
        experts_class="AriaExperts",
        renormalizes="always",
        scores_in_fp32=False,
    ),
    _top_k_on_logits(
        "cohere2_moe", "Cohere2Moe", sites=("mlp.gate",), renormalizes="selection_fn", weights_dtype="input"
    ),
    # ERNIE-4.5: softmax, selection on p + bias, p / max(sum of the kept p, moe_norm_min)
    # sigmoid + selection bias, the bias passed in by the block (a buffer of the block, not the router)
    RouterFamily(
        "minimax_m2",
        "minimax_m2",
        "MiniMaxM2TopKRouter",
        "MiniMaxM2DecoderLayer",
        rule="sigmoid_bias",
        logits="linear_in_weight_dtype",
        forward_args=("e_score_correction_bias",),
        bias_argument="e_score_correction_bias",
        renormalizes="always",
        weights_dtype="scores",
    ),
    RouterFamily(
        "hy_v3",
        "hy_v3",
        "HYV3TopKRouter",
        "HYV3DecoderLayer",
        rule="sigmoid_bias",
        logits="linear_fp32",
        forward_args=("e_score_correction_bias",),
        bias_argument="e_score_correction_bias",
        renormalizes="always",
        renormalization_eps=SIGMOID_EPS,
        scaling="router_scaling_factor",
        weights_dtype="scores",
    ),
    RouterFamily(
        "afmoe",
        "afmoe",
        "AfmoeTokenChoiceRouter",
        "AfmoeDecoderLayer",
        rule="sigmoid_bias",
        logits="gate_module_then_fp32",
        sites=("mlp.router",),
        experts_class="AfmoeExperts",
        forward_args=("expert_bias",),
        bias_argument="expert_bias",
        renormalizes="always",
        renormalization_eps=SIGMOID_EPS,
        scaling="route_scale",
        weights_dtype="scores",
    ),
    RouterFamily(  # sigmoid in the logits' dtype; the bias only where the config uses one
        "lfm2_moe",
        "lfm2_moe",
        "Lfm2MoeTopKRouter",
        "Lfm2MoeDecoderLayer",
        rule="sigmoid_bias",
        sites=("feed_forward.gate",),
        forward_args=("expert_bias",),
        bias_argument="expert_bias",
        renormalization_eps=1e-6,
        scores_in_fp32=False,
    ),
    # DeepSeek-V4: s = the router's activation (sqrt-softplus) in z's dtype; hash-routed first layers
    RouterFamily(
        "deepseek_v4",
        "deepseek_v4",
        "DeepseekV4TopKRouter",
        "DeepseekV4DecoderLayer",
        rule="activation_bias",
        bias="e_score_correction_bias",
        scores_in_fp32=False,
        renormalizes="always",
        renormalization_eps=SIGMOID_EPS,
        static_routers=(("DeepseekV4HashRouter", HASH_ROUTED),),
        ranking_layers=("mlp_layer_types", "moe"),
    ),
    # Gemma 4: the router on the decoder layer, fed the normalised residual stream; returns p
    RouterFamily(
        "gemma4",
        "gemma4",
        "Gemma4TextRouter",
        "Gemma4TextDecoderLayer",
        logits="normed_proj",
        sites=("router",),
        experts_class="Gemma4TextExperts",
        renormalizes="always",
        scaling=None,
        top_k_path="config.top_k_experts",
        num_experts_path="config.num_experts",
        first_output="probabilities",
        per_expert_scale="per_expert_scale",
        weights_dtype="scores",
    ),
    RouterFamily(
        "ernie4_5_moe",
        "ernie4_5_moe",
        "Ernie4_5_MoeTopKRouter",
        "Ernie4_5_MoeDecoderLayer",
        rule="softmax_bias_floor",
        logits="linear_fp32_without_autocast",
        bias="moe_statics.e_score_correction_bias",
        renormalizes="always",
        weights_dtype="input",
    ),
)

#: model folder → why its routers are not made elastic, and what to do instead. Every folder of
#: the installed transformers whose config declares routed experts is in FAMILIES or here
#: (tests/hf/test_hf_every_family.py).
REFUSED: dict[str, str] = {
    "phimoe": "its router samples its two experts inside the forward (sparsemixer, Gumbel noise in training) "
    "with top-2 hard-coded: there is no ranking to cut at κ",
    "nllb_moe": "top-2 routing by argmax with expert capacity and a random second expert: not top-k routing",
    "switch_transformers": "top-1 routing with expert capacity: no symmetric elastic range exists around k = 1",
    "llama4": "top-1 by default (no symmetric elastic range around k = 1), and its experts run every token "
    "through every expert, so κ could not change the compute",
    "doge": "product-key experts retrieved inside the block: no router module to patch",
    "jetmoe": "the same gating drives its mixture-of-attention heads, which reshape by a fixed top-k",
    "dbrx": "not yet covered: the routing is a method of the block (p-norm weights, softmax in the logits' dtype) "
    "and its experts are not transformers' experts dispatcher",
    "zaya": "not yet covered: its router carries state between layers and ranks a skip class with the experts",
    "diffusion_gemma": "not yet covered: the router is Gemma-4's (see gemma4)",
    "jamba": "not yet covered: in 5.19 the routing is a method of the block (`route_tokens_to_experts`) and "
    "the router a plain Linear; from 5.25 its router sits in two decoder-layer classes",
    "step3p7": "not yet covered: its experts are not transformers' experts dispatcher",
    "longcat_flash": "not yet covered: identity 'zero experts' share the id space and its experts are not "
    "transformers' experts dispatcher",
    "inkling": "not yet covered: its weights normalise the kept routed experts together with the shared experts",
    "openai_privacy_filter": "an encoder whose layers have no layer index, and whose block multiplies by the "
    "static top-k",
    "ergo": "not yet covered (5.25): its router's logits come from a Linear submodule and its weights round-trip "
    "through the hidden dtype; its experts normalise each expert's output and are not transformers' experts "
    "dispatcher",
    "inkling2": "not yet covered (5.25): its routers sit in two decoder-layer classes (sliding and full attention) "
    "and score with the config's `scoring_func`",
    "inkling2_loop": "not yet covered (5.25): its looped layers run each router several times per forward",
    "kolibri1": "not yet covered (5.25): it ranks the logits plus the correction bias and weighs the sigmoid of the "
    "kept logits",
    "kolibri1_1": "not yet covered (5.25): its router is Kolibri-1's (see kolibri1)",
    "muse_spark": "not yet covered (5.25): its router scales the logits by `output_multiplier` before the sigmoid, "
    "and its experts normalise each expert's output",
    "ernie4_5_vl_moe": "not yet covered: two routers (text and vision experts) in one decoder layer, while "
    "plans and records hold one router per layer",
}
#: folders whose config may name several experts without routing top-k: never refused at build
NOT_TOP_K: dict[str, str] = {
    "vitpose_backbone": "its expert is chosen by the dataset index",
    "bamba": "one expert",
}
#: the model folder of configs that wrap another folder's text model
TEXT_MODEL_FOLDERS: dict[str, str] = {
    "kimi_k25": "deepseek_v3",
    "step3p5": "step3p7",
    "inkling_mm_model": "inkling",
    "inkling_text": "inkling",
    "param2moe": "glm4_moe",  # 5.25: configs built with another folder's classes
    "sarvam_moe": "glm4_moe",
    "sarvam_mla": "deepseek_v3",
}


# ---------------------------------------------------------------------------------- docs
#: rule kind → its formula, for the docs table (the readers are :data:`.rules.RULES`)
RULE_SUMMARIES: dict[str, str] = {
    "softmax_topk": "p = softmax(z) (fp32); top-k by p; w = p, or p / Σ_kept p (+ ε)",
    "sigmoid_bias": "s = sigmoid(z) (fp32, or z's dtype: LFM2-MoE); top-k by s + b (inside the kept groups); "
    "w = s, or s / (Σ_kept s + ε); × scale",
    "activation_bias": "s = the router's activation of z (`score_fn`: sqrt(softplus(z)) or sigmoid(z)), in z's "
    "dtype; top-k by s + b; w = s / (Σ_kept s + ε); × scale",
    "softmax_groups": "p = softmax(z) (z's dtype); group-limited top-k by p (dropped groups 0.0); "
    "w = p, or p / (Σ_kept p + ε); × scale",
    "logits_topk": "top-k by z; w = softmax over the kept z "
    "(Cohere2's sigmoid mode: sigmoid(z_kept), renormalised iff asked)",
    "softmax_bias_floor": "p = softmax(z) (fp32); top-k by p + b; w = p / max(Σ_kept p, moe_norm_min)",
}

DOCS_BEGIN = "<!-- families: generated from elastic_moe_plugin/hf/family_table.py by `make docs`; do not edit -->"
DOCS_END = "<!-- end of families -->"


def _bias_text(family: RouterFamily) -> str:
    if family.bias_argument:
        return f"`{family.bias_argument}` (passed in by the block)"
    return f"`{family.bias}`" if family.bias else "—"


def markdown_tables() -> str:
    """The covered and refused families as markdown, between :data:`DOCS_BEGIN` and :data:`DOCS_END`
    (``docs/transformers.md`` holds this text; ``tests/hf/test_hf_every_family.py`` checks it)."""
    covered = [
        "| family | router (site) | rule kind | logits | selection bias | renormalises | weights |",
        "|---|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        covered.append(
            f"| `{family.name}` | `{family.router}` (`{'`, `'.join(family.sites)}`) | `{family.rule}` | "
            f"`{family.logits}` | {_bias_text(family)} | {family.renormalizes} | "
            f"{family.weights_dtype} |"
        )
    kinds = ["| rule kind | routing |", "|---|---|"] + [
        f"| `{kind}` | {text} |" for kind, text in RULE_SUMMARIES.items()
    ]
    refused = ["| family | why it is not elastic |", "|---|---|"] + [
        f"| `{folder}` | {reason} |" for folder, reason in sorted(REFUSED.items())
    ]
    parts = [
        DOCS_BEGIN,
        "",
        *kinds,
        "",
        *covered,
        "",
        "Refused at model build (`allow_uncovered_routers` keeps them static):",
        "",
        *refused,
        "",
        DOCS_END,
    ]
    return "\n".join(parts)


def with_tables(text: str) -> str:
    """``text`` (``docs/transformers.md``) with its generated section replaced by :func:`markdown_tables`."""
    start, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    return text[:start] + markdown_tables() + text[end:]
