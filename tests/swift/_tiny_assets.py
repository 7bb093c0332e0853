"""Tiny offline assets for ``swift sft`` / ``megatron sft`` smoke runs (no downloads).

    python tests/swift/_tiny_assets.py DIR     # writes DIR/{olmoe,qwen3_moe,...,train.jsonl}, prints JSON

- a byte-level BPE tokenizer trained here with ``tokenizers`` (384 tokens), saved as a
  ``PreTrainedTokenizerFast`` with a ChatML chat template and the special tokens that ms-swift's
  ``olmoe`` and ``qwen3`` templates write (``|||IP_ADDRESS|||``, ``<|im_start|>``, ...);
- tiny random OLMoE (top-2, ``norm_topk_prob=False``) and Qwen3-MoE (top-4, and top-2 as
  ``qwen3_moe_k2``; ``norm_topk_prob=True``) checkpoints from transformers configs (2 layers, 8
  experts, hidden 64), ``save_pretrained``; a Qwen3-MoE routing to top-8 of 16 experts
  (``qwen3_moe_top8``, the paper's k) and a dense Qwen3 (``qwen3_dense``, no router at all);
  the other two routing styles of the transformers door, top-2 of 8 in every layer: DeepSeek-V3
  (``deepseek_v3``: sigmoid, correction bias, 4 groups, MLA) and GPT-OSS (``gpt_oss``: top-k on the
  logits at ``mlp.router``), with the special tokens of swift's ``deepseek_v2_5`` / ``gpt_oss`` templates;
- ``train.jsonl``: 64 rows of ``{"messages": [user, assistant]}``, about 300 tokens each.

Used by tests/swift/conftest.py and by scripts/gpu_check.sh.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

from elastic_moe_plugin.tools.recipes.tiny_assets import (  # the builders live in the package
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    VOCAB,
    WORDS,
    chat_rows,
    train_tokenizer,
    write_chat_dataset,
    write_model,
)

COMMON_CONFIG: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 512, "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
}
#: model type -> (swift --model_type, swift --template, transformers config class, model class, overrides)
MODELS: dict[str, tuple[str, str, str, str, dict[str, Any]]] = {
    "olmoe": ("olmoe", "olmoe", "olmoe.OlmoeConfig", "olmoe.OlmoeForCausalLM",
              {"num_experts": 8, "num_experts_per_tok": 2}),  # norm_topk_prob=False: full_softmax gate
    "qwen3_moe": ("qwen3_moe", "qwen3", "qwen3_moe.Qwen3MoeConfig", "qwen3_moe.Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "head_dim": 16,
                   "norm_topk_prob": True}),  # renormalised gate
    # the megatron sft tests (tests/swift/test_megatron_sft.py): top-2, so that 1-3 is centred on it
    "qwen3_moe_k2": ("qwen3_moe", "qwen3", "qwen3_moe.Qwen3MoeConfig", "qwen3_moe.Qwen3MoeForCausalLM",
                     {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16,
                      "norm_topk_prob": True}),
    "qwen3_moe_top8": ("qwen3_moe", "qwen3", "qwen3_moe.Qwen3MoeConfig", "qwen3_moe.Qwen3MoeForCausalLM",
                       {"num_experts": 16, "num_experts_per_tok": 8, "moe_intermediate_size": 16, "head_dim": 16,
                        "norm_topk_prob": True}),  # top-8: the default schedule resolves to 6-10
    "qwen3_dense": ("qwen3", "qwen3", "qwen3.Qwen3Config", "qwen3.Qwen3ForCausalLM", {"head_dim": 16}),  # no router
    # DeepSeek-V3 style (sigmoid scores, selection on scores + e_score_correction_bias, top-2 of 4
    # groups, renormalised, × routed_scaling_factor): every layer MoE (first_k_dense_replace=0), MLA
    # with small ranks; DeepseekV3Attention wants as many key/value heads as query heads
    "deepseek_v3": ("deepseek_v3", "deepseek_v2_5", "deepseek_v3.DeepseekV3Config",
                    "deepseek_v3.DeepseekV3ForCausalLM",
                    {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                     "n_group": 4, "topk_group": 2, "first_k_dense_replace": 0, "norm_topk_prob": True,
                     "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                     "qk_rope_head_dim": 8, "v_head_dim": 16}),
    # GPT-OSS style (``mlp.router``: top-k on the biased logits, softmax over the kept): the config's
    # alternating sliding/full attention (window 128 < --max_length 512, so both kinds are used) and
    # plain RoPE instead of its default YaRN, which assumes 4096 original positions
    "gpt_oss": ("gpt_oss", "gpt_oss", "gpt_oss.GptOssConfig", "gpt_oss.GptOssForCausalLM",
                {"num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 128,
                 "layer_types": ["sliding_attention", "full_attention"],
                 "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}),
}
BATCH_SIZE = 8
DATASET_ROWS = 64


@dataclasses.dataclass(frozen=True)
class TinyAssets:
    root: Path
    dataset: Path
    #: a lower bound of the tokens one training micro-batch routes per MoE layer
    min_tokens_per_step: int

    def model_dir(self, name: str) -> Path:
        return self.root / name


def build(root: Path) -> TinyAssets:
    """Write the tokenizer, the models and the dataset under ``root``."""
    rng = random.Random(0)
    fast = train_tokenizer(rng)
    for name, (_, _, config_path, _, overrides) in MODELS.items():
        write_model(root / name, config_path.split(".")[0], fast, {**COMMON_CONFIG, **overrides})
    rows = chat_rows(rng, DATASET_ROWS)
    # the template adds its own tokens and padding adds more: content alone is a lower bound
    lengths = [sum(len(fast(message["content"])["input_ids"]) for message in row["messages"]) for row in rows]
    dataset = write_chat_dataset(root / "train.jsonl", rows)
    return TinyAssets(root=root, dataset=dataset, min_tokens_per_step=BATCH_SIZE * min(lengths))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/swift/_tiny_assets.py DIR", file=sys.stderr)
        return 2
    assets = build(Path(argv[0]))
    print(json.dumps({"dataset": str(assets.dataset), "min_tokens_per_step": assets.min_tokens_per_step,
                      **{name: str(assets.model_dir(name)) for name in MODELS}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
