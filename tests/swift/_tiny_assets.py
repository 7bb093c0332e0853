"""Tiny offline assets for ``swift sft`` / ``megatron sft`` smoke runs (no downloads).

    python tests/swift/_tiny_assets.py DIR     # writes DIR/{olmoe,qwen3_moe,...,train.jsonl}, prints JSON

- a byte-level BPE tokenizer trained here with ``tokenizers`` (384 tokens), saved as a
  ``PreTrainedTokenizerFast`` with a ChatML chat template and the special tokens that ms-swift's
  ``olmoe``, ``qwen3``, ``deepseek_v4``, ``gpt_oss`` and ``minimax_m2`` templates write
  (``|||IP_ADDRESS|||``, ``<|im_start|>``, ``<｜User｜>``, ``]~b]``, ...);
- tiny random OLMoE (top-2, ``norm_topk_prob=False``) and Qwen3-MoE (top-4, and top-2 as
  ``qwen3_moe_k2``; ``norm_topk_prob=True``) checkpoints from transformers configs (2 layers, 8
  experts, hidden 64), ``save_pretrained``; a Qwen3-MoE routing to top-8 of 16 experts
  (``qwen3_moe_top8``, the paper's k) and a dense Qwen3 (``qwen3_dense``, no router at all);
  three other routing styles of the transformers door, top-2 of 8: DeepSeek-V4 (``deepseek_v4``:
  the router's sqrt-softplus activation + correction bias in its top-k layers, a hash-routed first
  layer, 3 layers), GPT-OSS (``gpt_oss``: top-k on the logits at ``mlp.router``) and MiniMax-M2
  (``minimax_m2``: sigmoid + a correction bias the block passes in);
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
    # DeepSeek-V4 (the router's sqrt-softplus activation, selection on it + e_score_correction_bias,
    # renormalised, × routed_scaling_factor): a hash-routed first layer (experts from a token-id
    # table: static by construction) and two top-k layers, one shared expert; its hybrid attention
    # small (one sliding-window, one compressed-sparse and one heavily-compressed layer) and its
    # hyper-connections at 2 streams. ``intermediate_size`` is an alias of ``moe_intermediate_size``
    "deepseek_v4": ("deepseek_v4", "deepseek_v4", "deepseek_v4.DeepseekV4Config", "deepseek_v4.DeepseekV4ForCausalLM",
                    {"num_hidden_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                     "intermediate_size": 32, "moe_intermediate_size": 32, "num_key_value_heads": 1, "head_dim": 32,
                     "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 2,
                     "index_head_dim": 16, "index_topk": 4, "sliding_window": 64, "hc_mult": 2, "hc_sinkhorn_iters": 3,
                     "num_nextn_predict_layers": 0,
                     "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                     "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                     "mlp_layer_types": ["hash_moe", "moe", "moe"]}),
    # GPT-OSS style (``mlp.router``: top-k on the biased logits, softmax over the kept): the config's
    # alternating sliding/full attention (window 128 < --max_length 512, so both kinds are used) and
    # plain RoPE instead of its default YaRN, which assumes 4096 original positions
    "gpt_oss": ("gpt_oss", "gpt_oss", "gpt_oss.GptOssConfig", "gpt_oss.GptOssForCausalLM",
                {"num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 128,
                 "layer_types": ["sliding_attention", "full_attention"],
                 "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}),
    # MiniMax-M2 (sigmoid scores, selection on scores + e_score_correction_bias, which the block
    # passes to its router, renormalised): ``intermediate_size`` is the experts' width. The last
    # three keys are in the real checkpoint's config.json; transformers' config class ignores them
    # (keeping them as attributes), but mcore-bridge reads ``scoring_func`` (sigmoid scores and an
    # expert bias) and ``use_qk_norm`` (the q/k norms): without them ``megatron sft`` silently
    # builds a softmax router with no expert bias and no q/k norms, a different model
    "minimax_m2": ("minimax_m2", "minimax_m2", "minimax_m2.MiniMaxM2Config", "minimax_m2.MiniMaxM2ForCausalLM",
                   {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "head_dim": 16,
                    "scoring_func": "sigmoid", "use_qk_norm": True, "use_routing_bias": True}),
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
