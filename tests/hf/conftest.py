"""Shared fixtures of the transformers adapter tests: tiny MoE models built from configs, on CPU.

- ``hf_clean`` (function scope; every module here applies it through ``pytestmark``) guarantees
  ``hf.remove()`` before and after each test, so no test sees another's patch.
- every test runs with one torch intra-op thread (restored afterwards).
- ``tiny`` returns :class:`TinyModels`: ``tiny.config(family, **overrides)`` and
  ``tiny.model(family, experts_implementation=..., **overrides)`` build a 2-layer, 8-expert,
  top-2, hidden-64 model of any covered family (:data:`elastic_moe_plugin.hf.FAMILIES`), in
  training mode, where every decoder layer is a MoE layer, and ``tiny.inputs(family)`` the
  matching keyword arguments (labels too for a ``*ForCausalLM``). :data:`FAMILY_MODELS` holds one
  entry per covered family (the text model of a multimodal one; ``axk2.no_groups`` is AXK2 with
  its router's grouping off). Nothing is downloaded.
- ``expert_rows`` (``counters.ExpertRows``) counts the rows each experts module multiplies,
  read from the GEMMs that really run (``with expert_rows(model) as rows: ...``).

Without transformers installed, every test module in this folder is skipped at collection.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch
from counters import ExpertRows

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

if not HAVE_TRANSFORMERS:
    collect_ignore_glob = ["test_*.py"]

NUM_EXPERTS, TOP_K, HIDDEN, LAYERS, VOCAB = 8, 2, 64, 2, 128
BATCH, SEQ = 2, 8

_COMMON = {
    "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64, "num_experts_per_tok": TOP_K,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "router_aux_loss_coef": 0.01,
}
_QWEN = {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "head_dim": 16}
_SHARED = {"shared_expert_intermediate_size": 32}
# Hybrid models: one linear-attention and one full-attention layer, tiny linear heads.
_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
_HYBRID = {**_LINEAR, "layer_types": ["linear_attention", "full_attention"]}
# Families that choose MoE layers per layer: every layer sparse (their defaults keep the first dense).
_ALL_SPARSE = ["sparse"] * LAYERS
# DeepSeek-style MoE: 8 routed experts and one shared. first_k_dense_replace=0 makes every layer MoE
# in the families that read it (the others take mlp_layer_types, and keep it as an unused attribute).
_DEEPSEEK = {"n_routed_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "n_shared_experts": 1,
             "first_k_dense_replace": 0}
# MLA expands its latent to one key/value per query head: no grouped keys (sdpa would repeat them).
_MLA = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_key_value_heads": 4}
# Group-limited routers: 8 experts in 4 groups, the best 2 groups kept, so the grouping really selects.
# The other DeepSeek-style routers run ungrouped (one group), as their checkpoints do.
_GROUPED = {"n_group": 4, "topk_group": 2}
_UNGROUPED = {"n_group": 1, "topk_group": 1}
# DeepSeek sparse attention's indexer, tiny; its top-k below SEQ, so it really drops keys.
_INDEXER = {"index_topk": 4, "index_head_dim": 16, "index_n_heads": 2}

_INKLING2 = {"unpadded_vocab_size": VOCAB, "head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
             "swa_head_dim": 16, "sliding_window_size": 8, "d_rel": 4, "rel_extent": 16, "log_scaling_n_floor": 4,
             "moe_intermediate_size": 32, "n_routed_experts": NUM_EXPERTS, "layer_types": ["hybrid_sliding", "hybrid"]}

#: family name -> (config module.class, model module.class, config overrides, model input)
FAMILY_MODELS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "olmoe": ("olmoe.OlmoeConfig", "olmoe.OlmoeForCausalLM", {"num_experts": NUM_EXPERTS}, "ids"),
    "qwen3_moe": ("qwen3_moe.Qwen3MoeConfig", "qwen3_moe.Qwen3MoeForCausalLM", _QWEN, "ids"),
    "flex_olmo": ("flex_olmo.FlexOlmoConfig", "flex_olmo.FlexOlmoForCausalLM", {"num_experts": NUM_EXPERTS}, "ids"),
    "qwen2_moe": ("qwen2_moe.Qwen2MoeConfig", "qwen2_moe.Qwen2MoeForCausalLM", {**_QWEN, **_SHARED}, "ids"),
    "qwen3_next": ("qwen3_next.Qwen3NextConfig", "qwen3_next.Qwen3NextForCausalLM",
                   {**_QWEN, **_SHARED, **_HYBRID}, "ids"),
    "qwen3_5_moe": ("qwen3_5_moe.Qwen3_5MoeTextConfig", "qwen3_5_moe.Qwen3_5MoeForCausalLM",
                    {**_QWEN, **_SHARED, **_HYBRID}, "ids"),
    "qwen3_vl_moe": ("qwen3_vl_moe.Qwen3VLMoeTextConfig", "qwen3_vl_moe.Qwen3VLMoeTextModel", _QWEN, "ids"),
    "qwen3_omni_moe.thinker": ("qwen3_omni_moe.Qwen3OmniMoeTextConfig", "qwen3_omni_moe.Qwen3OmniMoeThinkerTextModel",
                               _QWEN, "embeds"),
    "qwen3_omni_moe.talker": ("qwen3_omni_moe.Qwen3OmniMoeTalkerTextConfig", "qwen3_omni_moe.Qwen3OmniMoeTalkerModel",
                              {**_QWEN, **_SHARED}, "embeds"),
    # Qwen4-Exp's full-attention layers need its QSA indexer; linear attention alone keeps it tiny.
    "qwen4_exp": ("qwen4_exp.Qwen4ExpTextConfig", "qwen4_exp.Qwen4ExpForCausalLM",
                  {**_QWEN, **_LINEAR, "hc_lowrank": 8, "use_cache": False,
                   "layer_types": ["linear_attention", "linear_attention"]}, "ids"),
    "mixtral": ("mixtral.MixtralConfig", "mixtral.MixtralForCausalLM", {"num_local_experts": NUM_EXPERTS}, "ids"),
    "minimax": ("minimax.MiniMaxConfig", "minimax.MiniMaxForCausalLM", {"num_local_experts": NUM_EXPERTS}, "ids"),
    "mellum": ("mellum.MellumConfig", "mellum.MellumForCausalLM",
               {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32}, "ids"),
    "hunyuan_v1_moe": ("hunyuan_v1_moe.HunYuanMoEV1Config", "hunyuan_v1_moe.HunYuanMoEV1ForCausalLM",
                       {"num_experts": NUM_EXPERTS, "moe_topk": TOP_K, "head_dim": 16}, "ids"),
    "deepseek_v3": ("deepseek_v3.DeepseekV3Config", "deepseek_v3.DeepseekV3ForCausalLM",
                    {**_DEEPSEEK, **_MLA, **_GROUPED}, "ids"),
    "deepseek_v32": ("deepseek_v32.DeepseekV32Config", "deepseek_v32.DeepseekV32ForCausalLM",
                     {**_DEEPSEEK, **_MLA, **_GROUPED, **_INDEXER}, "ids"),
    "glm4_moe": ("glm4_moe.Glm4MoeConfig", "glm4_moe.Glm4MoeForCausalLM",
                 {**_DEEPSEEK, **_UNGROUPED, "head_dim": 16}, "ids"),
    "glm4_moe_lite": ("glm4_moe_lite.Glm4MoeLiteConfig", "glm4_moe_lite.Glm4MoeLiteForCausalLM",
                      {**_DEEPSEEK, **_MLA, **_UNGROUPED, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    # M-RoPE over half of head_dim 16: the (t, h, w) sections must add up to its 4 frequencies.
    "glm4v_moe": ("glm4v_moe.Glm4vMoeTextConfig", "glm4v_moe.Glm4vMoeTextModel",
                  {**_DEEPSEEK, **_UNGROUPED, "head_dim": 16,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                       "mrope_section": [2, 1, 1]}}, "ids"),
    # GLM-5-Next: one KDA linear-attention and one DSA layer (NoPE: its validator wants no RoPE dims);
    # the indexer pools keys by index_kpool, which must divide index_topk.
    "glm5_next": ("glm5_next.Glm5NextTextConfig", "glm5_next.Glm5NextTextModel",
                  {**_DEEPSEEK, **_MLA, **_UNGROUPED, **_INDEXER, "qk_rope_head_dim": 0, "index_kpool": 2,
                   "linear_head_dim": 16, "linear_num_heads": 2, "mlp_layer_types": _ALL_SPARSE,
                   "layer_types": ["linear_attention", "indexed_attention"]}, "ids"),
    "glm_moe_dsa": ("glm_moe_dsa.GlmMoeDsaConfig", "glm_moe_dsa.GlmMoeDsaForCausalLM",
                    {**_DEEPSEEK, **_MLA, **_UNGROUPED, **_INDEXER}, "ids"),
    "dots1": ("dots1.Dots1Config", "dots1.Dots1ForCausalLM", {**_DEEPSEEK, **_UNGROUPED, "head_dim": 16}, "ids"),
    "exaone_moe": ("exaone_moe.ExaoneMoeConfig", "exaone_moe.ExaoneMoeForCausalLM",
                   {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, **_UNGROUPED, "head_dim": 16,
                    "first_k_dense_replace": 0}, "ids"),
    "solar_open": ("solar_open.SolarOpenConfig", "solar_open.SolarOpenForCausalLM",
                   {**_DEEPSEEK, **_UNGROUPED, "head_dim": 16}, "ids"),
    # Kimi-Linear: one KDA linear-attention layer (its torch fallback runs on CPU) and one MLA layer.
    "kimi_linear": ("kimi_linear.KimiLinearConfig", "kimi_linear.KimiLinearForCausalLM",
                    {"num_local_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "n_shared_experts": 1,
                     **_MLA, **_UNGROUPED, "mlp_layer_types": _ALL_SPARSE, "linear_head_dim": 16,
                     "linear_num_heads": 2, "layer_types": ["linear_attention", "full_attention"]}, "ids"),
    # MiMo-V2-Flash: head_dim is its query/key width, v_head_dim the value's.
    "mimo_v2_flash": ("mimo_v2_flash.MiMoV2FlashConfig", "mimo_v2_flash.MiMoV2FlashForCausalLM",
                      {**_DEEPSEEK, **_UNGROUPED, "head_dim": 16, "v_head_dim": 16, "mlp_layer_types": _ALL_SPARSE},
                      "ids"),
    # Nemotron-H: a layer is one block (Mamba, attention, MLP or MoE); two MoE blocks keep every
    # layer MoE, and no Mamba block (it wants the mamba-ssm kernels for speed).
    "nemotron_h": ("nemotron_h.NemotronHConfig", "nemotron_h.NemotronHForCausalLM",
                   {**_DEEPSEEK, **_UNGROUPED, "head_dim": 16, "moe_shared_expert_intermediate_size": 32,
                    "layers_block_type": ["moe", "moe"]}, "ids"),
    "axk1": ("axk1.AXK1Config", "axk1.AXK1ForCausalLM", {**_DEEPSEEK, **_MLA, **_GROUPED}, "ids"),
    "axk2": ("axk2.AXK2Config", "axk2.AXK2ForCausalLM", {**_DEEPSEEK, **_MLA, **_GROUPED, **_INDEXER}, "ids"),
    # AXK2 ships with n_group=None (no grouping): its router's ungrouped path.
    "axk2.no_groups": ("axk2.AXK2Config", "axk2.AXK2ForCausalLM",
                       {**_DEEPSEEK, **_MLA, **_INDEXER, "n_group": None, "topk_group": None}, "ids"),
    "hy_v4": ("hy_v4.HYV4Config", "hy_v4.HYV4ForCausalLM",
              {**_DEEPSEEK, **_MLA, **_UNGROUPED, **_INDEXER, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    # DeepSeek-V2's default topk_method is "greedy" (no groups); V2.5-style group-limited routing here.
    "deepseek_v2": ("deepseek_v2.DeepseekV2Config", "deepseek_v2.DeepseekV2ForCausalLM",
                    {**_DEEPSEEK, **_MLA, **_GROUPED, "topk_method": "group_limited_greedy"}, "ids"),
    "deepseek_ocr2": ("deepseek_ocr2.DeepseekOcr2TextConfig", "deepseek_ocr2.DeepseekOcr2TextModel",
                      {**_DEEPSEEK, **_UNGROUPED, "head_dim": 16, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    "mistral4": ("mistral4.Mistral4Config", "mistral4.Mistral4ForCausalLM", {**_DEEPSEEK, **_MLA, **_GROUPED}, "ids"),
    "gpt_oss": ("gpt_oss.GptOssConfig", "gpt_oss.GptOssForCausalLM",
                {"num_local_experts": NUM_EXPERTS, "head_dim": 16}, "ids"),
    "granitemoe": ("granitemoe.GraniteMoeConfig", "granitemoe.GraniteMoeForCausalLM",
                   {"num_local_experts": NUM_EXPERTS}, "ids"),
    "granitemoeshared": ("granitemoeshared.GraniteMoeSharedConfig", "granitemoeshared.GraniteMoeSharedForCausalLM",
                         {"num_local_experts": NUM_EXPERTS, "shared_intermediate_size": 32}, "ids"),
    # Granite-MoE-Hybrid: attention in both layers (no Mamba), each with its MoE.
    "granitemoehybrid": ("granitemoehybrid.GraniteMoeHybridConfig", "granitemoehybrid.GraniteMoeHybridForCausalLM",
                         {"num_local_experts": NUM_EXPERTS, "shared_intermediate_size": 32,
                          "layer_types": ["attention", "attention"]}, "ids"),
    "granitemoe_swa": ("granitemoe_swa.GraniteMoeSWAConfig", "granitemoe_swa.GraniteMoeSWAForCausalLM",
                       {"num_local_experts": NUM_EXPERTS}, "ids"),
    "aria": ("aria.AriaTextConfig", "aria.AriaTextForCausalLM",
             {"moe_num_experts": NUM_EXPERTS, "moe_topk": TOP_K, "moe_num_shared_experts": 1, "head_dim": 16}, "ids"),
    "cohere2_moe": ("cohere2_moe.Cohere2MoeConfig", "cohere2_moe.Cohere2MoeForCausalLM",
                    {"num_experts": NUM_EXPERTS, "head_dim": 16, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    # ERNIE-4.5-MoE places MoE layers from moe_layer_start_index (1 by default) on.
    "ernie4_5_moe": ("ernie4_5_moe.Ernie4_5_MoeConfig", "ernie4_5_moe.Ernie4_5_MoeForCausalLM",
                     {"moe_num_experts": NUM_EXPERTS, "moe_k": TOP_K, "moe_intermediate_size": 32,
                      "moe_num_shared_experts": 1, "moe_layer_start_index": 0}, "ids"),
    # MiniMax-M3's text model: RoPE over half of head_dim (rotary_dim), every layer sparse.
    "minimax_m3_vl": ("minimax_m3_vl.MiniMaxM3VLTextConfig", "minimax_m3_vl.MiniMaxM3VLForCausalLM",
                      {"num_local_experts": NUM_EXPERTS, "head_dim": 16, "rotary_dim": 8,
                       "shared_intermediate_size": 32, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    "laguna": ("laguna.LagunaConfig", "laguna.LagunaForCausalLM",
               {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                "head_dim": 16, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    # Routers whose block passes the selection bias in as a forward argument.
    "minimax_m2": ("minimax_m2.MiniMaxM2Config", "minimax_m2.MiniMaxM2ForCausalLM",
                   {"num_local_experts": NUM_EXPERTS, "head_dim": 16}, "ids"),
    "hy_v3": ("hy_v3.HYV3Config", "hy_v3.HYV3ForCausalLM",
              {"num_experts": NUM_EXPERTS, "num_local_experts": NUM_EXPERTS, "moe_intermediate_size": 32,
               "head_dim": 16, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    "afmoe": ("afmoe.AfmoeConfig", "afmoe.AfmoeForCausalLM",
              {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "head_dim": 16, "num_dense_layers": 0}, "ids"),
    # LFM2-MoE: one short-convolution and one attention layer, both sparse.
    "lfm2_moe": ("lfm2_moe.Lfm2MoeConfig", "lfm2_moe.Lfm2MoeForCausalLM",
                 {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "num_dense_layers": 0,
                  "layer_types": ["conv", "full_attention"]}, "ids"),
    # DeepSeek-V4: a hash-routed first layer (static by construction), then two top-k layers;
    # hyper-connections over 2 streams, MLA-style attention with a sliding window, tiny indexer.
    "deepseek_v4": ("deepseek_v4.DeepseekV4Config", "deepseek_v4.DeepseekV4ForCausalLM",
                    {"num_local_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "num_hidden_layers": 3,
                     "mlp_layer_types": ["hash_moe", "moe", "moe"], "layer_types": ["sliding_attention"] * 3,
                     "hc_mult": 2, "head_dim": 16, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 16,
                     "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "sliding_window": 8,
                     "num_nextn_predict_layers": 0, "num_key_value_heads": 1}, "ids"),
    # Gemma 4's text model: the MoE block beside the dense MLP of every layer, no per-layer inputs.
    "gemma4": ("gemma4.Gemma4TextConfig", "gemma4.Gemma4ForCausalLM",
               {"num_experts": NUM_EXPERTS, "top_k_experts": TOP_K, "enable_moe_block": True,
                "moe_intermediate_size": 32, "head_dim": 16, "global_head_dim": 16, "hidden_size_per_layer_input": 0,
                "vocab_size_per_layer_input": VOCAB, "layer_types": ["sliding_attention", "full_attention"],
                "sliding_window": 4}, "ids"),
    # Step-3.7's text model (its only causal LM is multimodal): every layer sparse; a shared expert.
    "step3p7": ("step3p7.Step3p7TextConfig", "step3p7.Step3p7TextModel",
                {"n_routed_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "share_expert_dim": 32, "head_dim": 16,
                 "mlp_layer_types": _ALL_SPARSE, "sliding_window": 16}, "ids"),
    # LongCat-Flash: MLA attention (RoPE over head_dim), 8 real and 2 identity ("zero") experts.
    "longcat_flash": ("longcat_flash.LongcatFlashConfig", "longcat_flash.LongcatFlashForCausalLM",
                      {"num_layers": LAYERS, "num_hidden_layers": 2 * LAYERS, "n_routed_experts": NUM_EXPERTS,
                       "moe_topk": TOP_K, "zero_expert_num": 2, "ffn_hidden_size": 64, "expert_ffn_hidden_size": 32, "q_lora_rank": 32, "kv_lora_rank": 32,
                       "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "head_dim": 16, "v_head_dim": 16,
                       "num_key_value_heads": 4}, "ids"),
    # Jamba: a Mamba and an attention layer, both MoE (5.19: routed in the block; 5.25: a router module).
    "jamba": ("jamba.JambaConfig", "jamba.JambaForCausalLM",
              {"num_experts": NUM_EXPERTS, "expert_layer_period": 1, "expert_layer_offset": 0, "attn_layer_period": 2,
               "attn_layer_offset": 1}, "ids"),
    # DBRX: routed in a method of its FFN; its config nests the attention and the MoE settings.
    "dbrx": ("dbrx.DbrxConfig", "dbrx.DbrxForCausalLM",
             {"d_model": HIDDEN, "n_heads": 4, "n_layers": LAYERS, "max_seq_len": 64,
              "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
              "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": NUM_EXPERTS, "moe_top_k": TOP_K}}, "ids"),
    # Inkling: one shared expert normalised with the kept routed ones; sliding-window and relative attention.
    "inkling": ("inkling.InklingTextConfig", "inkling.InklingForCausalLM",
                {"head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
                 "sliding_window_size": 8, "d_rel": 4, "rel_extent": 16, "moe_intermediate_size": 32,
                 "n_routed_experts": NUM_EXPERTS, "n_shared_experts": 1, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    # DiffusionGemma's encoder text stack: Gemma 4's router in every layer.
    "diffusion_gemma": ("diffusion_gemma.DiffusionGemmaTextConfig", "diffusion_gemma.DiffusionGemmaEncoderTextModel",
                        {"num_experts": NUM_EXPERTS, "top_k_experts": TOP_K, "moe_intermediate_size": 32,
                         "head_dim": 16, "global_head_dim": 16, "sliding_window": 8,
                         "layer_types": ["sliding_attention", "full_attention"]}, "ids"),
    # ERNIE-4.5-VL's text model: a text and a vision router in every (sparse) layer, M-RoPE sections
    # over half of head_dim 16.
    "ernie4_5_vl_moe": ("ernie4_5_vl_moe.Ernie4_5_VLMoeTextConfig", "ernie4_5_vl_moe.Ernie4_5_VLMoeTextModel",
                        {"moe_num_experts": NUM_EXPERTS, "moe_k": TOP_K, "moe_intermediate_size": [32, 16],
                         "moe_num_shared_experts": 1, "mlp_layer_types": _ALL_SPARSE,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                             "mrope_section": [3, 3, 2]}}, "ids"),
    # Families below exist only in newer transformers (5.25): resolved lazily, so harmless on older ones.
    # Bailing-Hybrid: one KDA linear-attention and one MLA layer (head_dim sizes the KDA heads); its
    # router is always group-limited.
    "bailing_hybrid": ("bailing_hybrid.BailingHybridConfig", "bailing_hybrid.BailingHybridForCausalLM",
                       {**_DEEPSEEK, **_MLA, **_GROUPED, "num_local_experts": NUM_EXPERTS, "head_dim": 16,
                        "mlp_layer_types": _ALL_SPARSE, "layer_types": ["linear_attention", "full_attention"]},
                       "ids"),
    # dots3-note's text model: one DSA (MLA + indexer) layer and one sliding-window MLA layer, whose
    # own sizes come from the swa_* keys.
    "dots3_note": ("dots3_note.Dots3NoteTextConfig", "dots3_note.Dots3NoteForCausalLM",
                   {**_DEEPSEEK, **_MLA, **_UNGROUPED, **_INDEXER, "head_dim": 24,
                    "shared_experts_intermediate_size": 32, "mlp_layer_types": _ALL_SPARSE,
                    "layer_types": ["indexed_attention", "sliding_attention"], "sliding_window": 4,
                    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 16,
                    "swa_kv_lora_rank": 16, "swa_head_dim": 24, "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 16},
                   "ids"),
    # Hy-V4-VL's text model: M-RoPE sections over half of qk_rope_head_dim 8.
    "hy_v4_vl": ("hy_v4_vl.HYV4VLTextConfig", "hy_v4_vl.HYV4VLTextModel",
                 {**_DEEPSEEK, **_MLA, **_UNGROUPED, **_INDEXER, "mlp_layer_types": _ALL_SPARSE,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}},
                 "ids"),
    "minicpm5_moe": ("minicpm5_moe.MiniCPM5MoeConfig", "minicpm5_moe.MiniCPM5MoeForCausalLM",
                     {**_DEEPSEEK, **_UNGROUPED, "head_dim": 16, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    # Beam: one sliding-window (RoPE) and one full-attention (NoPE) layer; group-limited router.
    "beam": ("beam.BeamConfig", "beam.BeamForCausalLM",
             {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, **_GROUPED, "head_dim": 16,
              "mlp_layer_types": _ALL_SPARSE, "layer_types": ["sliding_attention", "full_attention"],
              "sliding_window": 4}, "ids"),
    # Flint: mlp_only_layers=[] makes both layers sparse; one full and one sliding-window layer.
    "flint": ("flint.FlintConfig", "flint.FlintForCausalLM",
              {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
               "head_dim": 16, "mlp_only_layers": [], "layer_types": ["full_attention", "sliding_attention"],
               "sliding_window": 4}, "ids"),
    # Lara-Mini: one gated-delta-net linear-attention and one full-attention layer.
    "lara_mini": ("lara_mini.LaraMiniConfig", "lara_mini.LaraMiniForCausalLM",
                  {**_QWEN, **_SHARED, **_HYBRID}, "ids"),
    # Mistral-Large-4's text model: MLA without a query LoRA, DSA indexer, group-limited router.
    "mistral_large4": ("mistral_large4.MistralLarge4TextConfig", "mistral_large4.MistralLarge4TextModel",
                       {**_DEEPSEEK, **{k: v for k, v in _MLA.items() if k != "q_lora_rank"}, **_GROUPED,
                        **_INDEXER, "mlp_layer_types": _ALL_SPARSE}, "ids"),
    # Unlimited-OCR's text model: DeepSeek-V2-style (multi-head attention, softmax router), its
    # group-limited greedy routing here.
    # Inkling-2: a sliding and a full decoder layer; Inkling-2-Loop runs its layer 1 twice per forward.
    "inkling2": ("inkling2.Inkling2TextConfig", "inkling2.Inkling2ForCausalLM", _INKLING2, "ids"),
    "inkling2_loop": ("inkling2_loop.Inkling2LoopTextConfig", "inkling2_loop.Inkling2LoopForCausalLM",
                      {**_INKLING2, "n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1,
                       "loop_layer_index_end": 2, "loop_num_passes": 2, "loop_gate_rank": 8}, "ids"),
    "kolibri1": ("kolibri1.Kolibri1Config", "kolibri1.Kolibri1ForCausalLM",
                 {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                  "head_dim": 16, "sliding_window": 16}, "ids"),
    "kolibri1_1": ("kolibri1_1.Kolibri1_1Config", "kolibri1_1.Kolibri1_1ForCausalLM",
                   {"num_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                    "head_dim": 16, "sliding_window": 16, "mlp_only_layers": [], "index_num_heads": 2}, "ids"),
    # Muse-Spark's text model (its causal LM is multimodal): experts at a width of their own.
    "muse_spark": ("muse_spark.MuseSparkTextConfig", "muse_spark.MuseSparkTextModel",
                   {"num_local_experts": NUM_EXPERTS, "moe_intermediate_size": 32, "moe_hidden_size": 32,
                    "head_dim": 16, "sliding_window": 16}, "ids"),
    # Ergo: every layer sparse (its default keeps the first dense); a shared expert.
    "ergo": ("ergo.ErgoConfig", "ergo.ErgoForCausalLM",
             {"num_experts": NUM_EXPERTS, "num_dense_blocks": 0, "first_dense_intermediate_size": 64,
              "moe_intermediate_size": 32, "shared_intermediate_size": 32, "sliding_window": 16}, "ids"),
    "unlimited_ocr": ("unlimited_ocr.UnlimitedOcrTextConfig", "unlimited_ocr.UnlimitedOcrTextModel",
                      {**_DEEPSEEK, **_GROUPED, "topk_method": "group_limited_greedy",
                       "mlp_layer_types": _ALL_SPARSE, "sliding_window": 4}, "ids"),
}


# Jamba routes in a method of its block up to 5.19 and in a router module from 5.25: one model, two rows.
FAMILY_MODELS["jamba.block"] = FAMILY_MODELS["jamba"]


def _resolve(dotted: str):
    module_name, _, attribute = dotted.rpartition(".")
    module = importlib.import_module(f"transformers.models.{module_name}")
    return getattr(module, attribute)


class TinyModels:
    """Builders of tiny models of every covered family (see the module docstring)."""

    families = tuple(FAMILY_MODELS)

    def config(self, family: str, **overrides):
        config_path, _, defaults, _ = FAMILY_MODELS[family]
        return _resolve(config_path)(**{**_COMMON, **defaults, **overrides})

    def model(self, family: str, *, experts_implementation: str | None = None, seed: int = 0, **overrides):
        """A fresh model in training mode; weights from ``torch.manual_seed(seed)``."""
        config = self.config(family, **overrides)
        if experts_implementation is not None:
            config._experts_implementation = experts_implementation
        torch.manual_seed(seed)
        model = _resolve(FAMILY_MODELS[family][1])(config)
        # Some families leave weights to a checkpoint load (Qwen3-Omni's talker experts stay
        # torch.empty, its router zeros), so draw every matrix here, from the same seed.
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() >= 2:
                    parameter.normal_(0.0, 0.02, generator=generator)
        assert all(torch.isfinite(p).all() for p in model.parameters()), family
        if experts_implementation is not None:
            assert model.config._experts_implementation == experts_implementation
        return model.train()

    def inputs(self, family: str, *, seed: int = 1) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
        if FAMILY_MODELS[family][3] == "embeds":
            return {"inputs_embeds": torch.randn(BATCH, SEQ, HIDDEN, generator=generator), "use_cache": False}
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        if FAMILY_MODELS[family][1].endswith("ForCausalLM"):
            kwargs["labels"] = ids
        if family == "ernie4_5_vl_moe":  # the last 3 tokens of each sequence are vision tokens: both routers route
            kwargs["moe_mm_token_type_ids"] = (torch.arange(SEQ) >= SEQ - 3).int().expand(BATCH, SEQ)
        return kwargs


def hand_aux_loss(router_logits, expert_ids_per_layer, num_experts: int, attention_mask=None) -> torch.Tensor:
    """The load-balancing loss written out from its definition, in float64.

    loss = E · Σ_e (c_e / N) · (P_e / N), with N = Σ_layers Σ_t m_t, c_e = Σ_layers Σ_t m_t ·
    #{slots of token t routed to e} (ids −1 = not routed) and P_e = Σ_layers Σ_t m_t · softmax(z_t)_e.
    ``expert_ids_per_layer``: per layer LongTensor [T, width], −1 where nothing was dispatched.
    """
    counts = torch.zeros(num_experts, dtype=torch.float64)
    prob_sums = torch.zeros(num_experts, dtype=torch.float64)
    total = 0.0
    for logits, ids in zip(router_logits, expert_ids_per_layer):
        num_tokens = logits.shape[0]
        mask = torch.ones(num_tokens, dtype=torch.float64) if attention_mask is None else attention_mask.reshape(-1).double()
        # P exactly as transformers takes it: softmax in the logits' dtype
        probs = torch.softmax(logits.detach(), dim=-1).double()
        for t in range(num_tokens):
            for expert in ids[t].tolist():
                if expert >= 0:
                    counts[expert] += mask[t]
        prob_sums += (probs * mask[:, None]).sum(0)
        total += float(mask.sum())
    return num_experts * ((counts / total) * (prob_sums / total)).sum()


@pytest.fixture
def tiny() -> TinyModels:
    return TinyModels()


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models run fastest on one intra-op thread, and a busy 2-core runner makes a thread pool
    stall (a 16x64 linear took 1.4 ms with 2 threads under load, 5 µs with one). Restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def hf_clean():
    from elastic_moe_plugin import hf
    from elastic_moe_plugin.hf import budget_rng

    hf.remove()
    budget_rng.reset()  # κ's generator seeds afresh from the test's torch.manual_seed
    yield
    hf.remove()
    budget_rng.reset()


@pytest.fixture
def expert_rows():
    """:class:`ExpertRows`, the GEMM-row counter (``with expert_rows(model) as rows: ...``)."""
    return ExpertRows


@pytest.fixture
def hand_aux():
    """:func:`hand_aux_loss`, the hand-written load-balancing loss."""
    return hand_aux_loss
