"""The table of transformers MoE families: the covered ones (:data:`FAMILIES`, each a
:class:`~.router_family.RouterFamily`), and the refused ones (:data:`REFUSED`), each with the reason
it has no ranking to cut at κ. ``docs/transformers.md`` lists both, generated from them
(:mod:`.family_docs`, ``make docs``); :mod:`.families` finds them in the installed transformers
and in models.
"""

from __future__ import annotations

from typing import Any

from elastic_moe_plugin.core.routing import SIGMOID_EPS
from elastic_moe_plugin.hf.router_family import (
    RouterFamily,
    deepseek_family,
    deepseek_v2_family,
    logits_topk_family,
    sigmoid_family,
    softmax_family,
)

#: why DeepSeek-V4's first layers stay static (the plan line shows it)
HASH_ROUTED = "hash-routed: experts from a token-id table, no ranking to cut at κ"

#: Gemma 4's router (DiffusionGemma's is the same): on the decoder layer, of the normalised input,
#: probabilities first, k and E in its config, × per_expert_scale[id] after the renormalisation
_GEMMA4: dict[str, Any] = {
    "logits": "normed_proj",
    "sites": ("router",),
    "experts_class": "Gemma4TextExperts",
    "renormalizes": "always",
    "scaling": None,
    "top_k_path": "config.top_k_experts",
    "num_experts_path": "config.num_experts",
    "first_output": "probabilities",
    "per_expert_scale": "per_expert_scale",
    "weights_dtype": "scores",
}
#: Kolibri-1 (and 1.1): the bias ranks the fp32 logits themselves, the kept logits' sigmoid weighs
_KOLIBRI: dict[str, Any] = {
    "rule": "logits_bias_sigmoid",
    "logits": "linear_fp32",
    "bias": "e_score_correction_bias",
    "weights_dtype": "scores",
}

_GRANITE: dict[str, Any] = {
    "logits": "linear_then_fp32",
    "sites": ("block_sparse_moe.router",),
    "weights_dtype": "input",
}

FAMILIES: tuple[RouterFamily, ...] = (
    # softmax -> top-k by probability -> p (or p / sum of the kept p)
    softmax_family("olmoe", "Olmoe", required=True),
    softmax_family("qwen3_moe", "Qwen3Moe", required=True),
    softmax_family("flex_olmo", "FlexOlmo"),
    softmax_family("qwen2_moe", "Qwen2Moe"),
    softmax_family("qwen3_next", "Qwen3Next"),
    softmax_family("qwen3_5_moe", "Qwen3_5Moe", renormalizes="always"),
    RouterFamily(
        "qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoeTextTopKRouter", "Qwen3VLMoeTextDecoderLayer", renormalizes="always"
    ),
    softmax_family("qwen3_omni_moe.thinker", "Qwen3OmniMoeThinkerText", module="qwen3_omni_moe"),
    RouterFamily(
        "qwen3_omni_moe.talker", "qwen3_omni_moe", "Qwen3OmniMoeTalkerTextTopKRouter", "Qwen3OmniMoeTalkerDecoderLayer"
    ),
    RouterFamily("qwen4_exp", "qwen4_exp", "Qwen4ExpTextTopKRouter", "Qwen4ExpTextDecoderLayer"),
    softmax_family("mixtral", "Mixtral", renormalizes="always", weights_dtype="scores"),
    softmax_family("minimax", "MiniMax", renormalizes="always", weights_dtype="scores"),
    softmax_family("mellum", "Mellum"),
    softmax_family("lara_mini", "LaraMini", logits="linear_fp32", weights_dtype="input"),  # 5.25+
    RouterFamily(
        "hunyuan_v1_moe",
        "hunyuan_v1_moe",
        "HunYuanMoEV1Gate",
        "HunYuanMoEV1DecoderLayer",
        logits="wg_fp32_if_built_so",
        renormalizes="always",
    ),
    # DeepSeek-V3 style: sigmoid, selection on scores + correction bias, groups, eps 1e-20, x scaling
    deepseek_family("deepseek_v3", "DeepseekV3"),
    deepseek_family("deepseek_v32", "DeepseekV32"),
    deepseek_family("glm4_moe", "Glm4Moe"),
    deepseek_family("glm4_moe_lite", "Glm4MoeLite"),
    deepseek_family("glm4v_moe", "Glm4vMoeText"),
    deepseek_family("glm5_next", "Glm5NextText"),
    deepseek_family("glm_moe_dsa", "GlmMoeDsa"),
    deepseek_family("dots1", "Dots1"),
    deepseek_family("exaone_moe", "ExaoneMoe"),
    deepseek_family("solar_open", "SolarOpen"),
    deepseek_family("kimi_linear", "KimiLinear"),
    deepseek_family("mimo_v2_flash", "MiMoV2Flash"),
    deepseek_family("nemotron_h", "NemotronH", sites=("mixer.gate",), decoder_layer="NemotronHBlock"),
    deepseek_family("axk1", "AXK1"),
    deepseek_family("axk2", "AXK2", masked_group_value=0.0),
    deepseek_family("hy_v4", "HYV4"),
    # transformers 5.25 and later
    deepseek_family("bailing_hybrid", "BailingHybrid"),
    deepseek_family("dots3_note", "Dots3NoteText", experts_class="Dots3NoteExperts"),
    deepseek_family("hy_v4_vl", "HYV4VL"),
    deepseek_family("minicpm5_moe", "MiniCPM5Moe", logits="linear_fp32_without_autocast"),
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
    sigmoid_family(
        "minimax_m3_vl", "MiniMaxM3VLTopKRouter", "MiniMaxM3VLDecoderLayer", logits="linear_in_weight_dtype"
    ),
    sigmoid_family(
        "laguna", "LagunaTopKRouter", "LagunaDecoderLayer", logits="linear_then_fp32", weights_dtype="input"
    ),
    # group-limited softmax in the logits' dtype, dropped groups masked with 0.0
    deepseek_v2_family("deepseek_v2", "DeepseekV2"),
    deepseek_v2_family("deepseek_ocr2", "DeepseekOcr2Text"),
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
    deepseek_v2_family("unlimited_ocr", "UnlimitedOcrText"),  # 5.25+
    RouterFamily(
        "mistral4",
        "mistral4",
        "Mistral4TopkRouter",
        "Mistral4DecoderLayer",
        rule="softmax_groups",
        renormalization_eps=SIGMOID_EPS,
    ),
    # top-k on the logits, then softmax over the kept logits
    logits_topk_family("gpt_oss", "GptOss", logits="linear_with_bias", scores_in_fp32=False),
    logits_topk_family("granitemoe", "GraniteMoe", **_GRANITE),
    logits_topk_family("granitemoeshared", "GraniteMoeShared", **_GRANITE),
    logits_topk_family("granitemoehybrid", "GraniteMoeHybrid", **_GRANITE),
    logits_topk_family("granitemoe_swa", "GraniteMoeSWA", **_GRANITE),
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
    logits_topk_family(
        "cohere2_moe", "Cohere2Moe", sites=("mlp.gate",), renormalizes="selection_fn", weights_dtype="input"
    ),
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
    RouterFamily("gemma4", "gemma4", "Gemma4TextRouter", "Gemma4TextDecoderLayer", **_GEMMA4),
    # Kolibri-1: rank z + b, weigh sigmoid(z_kept), renormalised iff norm_topk_prob
    RouterFamily("kolibri1", "kolibri1", "Kolibri1TopKRouter", "Kolibri1DecoderLayer", **_KOLIBRI),
    RouterFamily("kolibri1_1", "kolibri1_1", "Kolibri1_1TopKRouter", "Kolibri1_1DecoderLayer", **_KOLIBRI),
    # sigmoid + bias families whose logits, weights or experts have a shape of their own
    sigmoid_family(  # logits × output_multiplier; its experts normalise each output (a dispatcher option)
        "muse_spark",
        "MuseSparkTopkRouter",
        "MuseSparkTextDecoderLayer",
        logits="linear_fp32_times_multiplier",
        experts_class="MuseSparkExperts",
        renormalization_eps=1e-15,
    ),
    sigmoid_family(  # logits from its fp32-output Linear; weights rounded to the hidden dtype; per-expert norms
        "ergo",
        "ErgoTopkRouter",
        "ErgoDecoderLayer",
        logits="linear_module",
        experts_class="ErgoExperts",
        renormalization_eps=SIGMOID_EPS,
        weights_dtype="input_then_fp32",
        num_experts_path="linear.out_features",
        experts_slot_sum=True,
    ),
    sigmoid_family(  # the block scales the experts' output; 5.19's experts are its own loop
        "step3p7", "Step3p7TopKRouter", "Step3p7DecoderLayer", logits="linear_in_weight_dtype", experts_slot_sum=True
    ),
    # LongCat-Flash: softmax over the real and the identity ("zero") experts alike, + bias, never
    # renormalised, × routed_scaling_factor; κ counts slots of either kind (docs/gates.md)
    RouterFamily(
        "longcat_flash",
        "longcat_flash",
        "LongcatFlashTopkRouter",
        "LongcatFlashDecoderLayer",
        logits="classifier_fp32",
        sites=("mlp.router",),
        experts_class="LongcatFlashExperts",
        bias="e_score_correction_bias",
        renormalizes="never",
        weights_dtype="scores",
        num_experts_path="n_routed_experts",
    ),
    # Jamba: softmax in fp32, never renormalised, weights in the hidden dtype; a router module in
    # attention and Mamba layers from 5.25, a method of the block (its router a Linear) before
    RouterFamily(
        "jamba",
        "jamba",
        "JambaTopKRouter",
        "JambaAttentionDecoderLayer",
        other_decoder_layers=("JambaMambaDecoderLayer",),
        sites=("feed_forward.router",),
        experts_class="JambaExperts",
        renormalizes="never",
        weights_dtype="input",
    ),
    RouterFamily(
        "jamba.block",
        "jamba",
        "JambaSparseMoeBlock",
        "JambaAttentionDecoderLayer",
        other_decoder_layers=("JambaMambaDecoderLayer",),
        sites=("feed_forward",),
        experts_class="JambaExperts",
        routing_method="route_tokens_to_experts",
        forward_args=("hidden_states", "router_logits"),
        method_outputs=("ids", "weights"),
        renormalizes="never",
        weights_dtype="input",
    ),
    # DBRX: routes in a method of its FFN; softmax in the logits' dtype; w = p / ||p_S||_q
    RouterFamily(
        "dbrx",
        "dbrx",
        "DbrxFFN",
        "DbrxBlock",
        rule="softmax_pnorm",
        sites=("ffn",),
        experts_class="DbrxExperts",
        routing_method="route_tokens_to_experts",
        forward_args=("router_logits",),
        renormalizes="p_norm",
        num_experts_path="experts.num_experts",
        experts_slot_sum=True,
    ),
    # Inkling: sigmoid + bias ranks the routed experts; the kept ones and the shared experts are
    # normalised together (a log-space softmax of their log-sigmoids), × route_scale × global_scale
    RouterFamily(
        "inkling",
        "inkling",
        "InklingTopkRouter",
        "InklingDecoderLayer",
        rule="sigmoid_shared_sink",
        logits="routed_and_shared",
        bias="e_score_correction_bias",
        renormalizes="always",
        weights_dtype="input",
        shared_sink=True,
    ),
    # Inkling-2 (5.25+): DeepSeek-V4's rule (the router's activation, fp32), in sliding- and
    # full-attention layers; Inkling-2-Loop runs its looped layers' routers once per pass
    RouterFamily(
        "inkling2",
        "inkling2",
        "Inkling2TopKRouter",
        "Inkling2SlidingDecoderLayer",
        other_decoder_layers=("Inkling2FullDecoderLayer",),
        rule="activation_bias",
        logits="linear_fp32",
        bias="e_score_correction_bias",
        renormalizes="always",
        renormalization_eps=SIGMOID_EPS,
        scores_in_fp32=False,
    ),
    RouterFamily(
        "inkling2_loop",
        "inkling2_loop",
        "Inkling2LoopTopKRouter",
        "Inkling2LoopSlidingDecoderLayer",
        other_decoder_layers=(
            "Inkling2LoopFullDecoderLayer",
            "Inkling2LoopSlidingLoopDecoderLayer",
            "Inkling2LoopFullLoopDecoderLayer",
        ),
        rule="activation_bias",
        logits="linear_fp32",
        bias="e_score_correction_bias",
        renormalizes="always",
        renormalization_eps=SIGMOID_EPS,
        scores_in_fp32=False,
    ),
    # DiffusionGemma: Gemma 4's router in its encoder and its decoder layers
    RouterFamily(
        "diffusion_gemma",
        "diffusion_gemma",
        "DiffusionGemmaTextRouter",
        "DiffusionGemmaEncoderTextLayer",
        other_decoder_layers=("DiffusionGemmaDecoderTextLayer",),
        **{**_GEMMA4, "experts_class": "DiffusionGemmaTextExperts"},
    ),
    # ERNIE-4.5-VL: ERNIE-4.5's rule in a text and a vision router of one layer (keyed (layer, part))
    RouterFamily(
        "ernie4_5_vl_moe",
        "ernie4_5_vl_moe",
        "Ernie4_5_VLMoeMoeTopKRouter",
        "Ernie4_5_VLMoeDecoderLayer",
        rule="softmax_bias_floor",
        logits="linear_fp32_without_autocast",
        sites=("mlp.text_moe.gate", "mlp.vision_moe.gate"),
        bias="moe_statics.e_score_correction_bias",
        renormalizes="always",
        weights_dtype="input",
        merging_block="Ernie4_5_VLMoeMoeBlock",
    ),
    # ERNIE-4.5: softmax, selection on p + bias, p / max(sum of the kept p, moe_norm_min)
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
    "zaya": "top-1 only (its config refuses any other num_experts_per_tok): no symmetric elastic range exists "
    "around k = 1",
    "openai_privacy_filter": "an encoder whose layers have no layer index, and whose block multiplies by the "
    "static top-k",
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
