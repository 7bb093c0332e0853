"""Tiny offline assets for ``swift sft`` / ``megatron sft`` smoke runs (no downloads).

    python tests/swift/_tiny_assets.py DIR     # writes DIR/{olmoe,qwen3_moe,...,train.jsonl}, prints JSON

- a byte-level BPE tokenizer trained here with ``tokenizers`` (384 tokens), saved as a
  ``PreTrainedTokenizerFast`` with a ChatML chat template and the special tokens that ms-swift's
  ``olmoe`` and ``qwen3`` templates write (``|||IP_ADDRESS|||``, ``<|im_start|>``, ...);
- tiny random OLMoE (top-2, ``norm_topk_prob=False``) and Qwen3-MoE (top-4, ``norm_topk_prob=True``)
  checkpoints from transformers configs (2 layers, 8 experts, hidden 64), ``save_pretrained``; a
  Qwen3-MoE routing to top-8 of 16 experts (``qwen3_moe_top8``, the paper's k) and a dense Qwen3
  (``qwen3_dense``, no router at all);
- ``train.jsonl``: 64 rows of ``{"messages": [user, assistant]}``, about 300 tokens each.

Used by tests/swift/conftest.py and by scripts/gpu_check.sh.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import random
import sys
from pathlib import Path
from typing import Any

VOCAB = 384
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "|||IP_ADDRESS|||", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the", "a", "of", "to", "and", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as",
    "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but", "what", "some", "we",
    "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each", "she",
    "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write", "would", "like",
    "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go",
    "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water", "than", "call", "first",
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
    "qwen3_moe_top8": ("qwen3_moe", "qwen3", "qwen3_moe.Qwen3MoeConfig", "qwen3_moe.Qwen3MoeForCausalLM",
                       {"num_experts": 16, "num_experts_per_tok": 8, "moe_intermediate_size": 16, "head_dim": 16,
                        "norm_topk_prob": True}),  # top-8: the default schedule resolves to 6-10
    "qwen3_dense": ("qwen3", "qwen3", "qwen3.Qwen3Config", "qwen3.Qwen3ForCausalLM", {"head_dim": 16}),  # no router
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


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def build(root: Path) -> TinyAssets:
    """Write the tokenizer, both models and the dataset under ``root``."""
    import torch
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([_sentence(rng, rng.randint(5, 20)) for _ in range(2000)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   chat_template=CHAT_TEMPLATE)
    assert len(fast) <= VOCAB, len(fast)

    with torch.random.fork_rng():
        for name, (_, _, config_path, model_path, overrides) in MODELS.items():
            config_cls = _resolve(config_path)
            model_cls = _resolve(model_path)
            config = config_cls(**COMMON_CONFIG, **overrides, pad_token_id=fast.pad_token_id,
                                eos_token_id=fast.eos_token_id, bos_token_id=None)
            torch.manual_seed(0)
            model_cls(config).save_pretrained(root / name)
            fast.save_pretrained(root / name)

    rows, lengths = [], []
    for _ in range(DATASET_ROWS):
        user = " ".join(_sentence(rng, rng.randint(20, 30)) for _ in range(3))
        assistant = " ".join(_sentence(rng, rng.randint(20, 30)) for _ in range(3))
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]})
        # the template adds its own tokens and padding adds more: content alone is a lower bound
        lengths.append(len(fast(user)["input_ids"]) + len(fast(assistant)["input_ids"]))
    dataset = root / "train.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return TinyAssets(root=root, dataset=dataset, min_tokens_per_step=BATCH_SIZE * min(lengths))


def _resolve(dotted: str):
    module_name, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(f"transformers.models.{module_name}"), attribute)


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
