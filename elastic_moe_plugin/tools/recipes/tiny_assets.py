"""Tiny offline stand-ins for a recipe's checkpoint, tokenizer and data (no hub access).

- :func:`train_tokenizer`: a byte-level BPE tokenizer trained here with ``tokenizers``, saved as a
  ``PreTrainedTokenizerFast`` with a ChatML chat template and the special tokens ms-swift's
  ``olmoe``/``olmoe_0924``, ``qwen3``, ``deepseek_v2_5``/``deepseek_v4``, ``gpt_oss`` and
  ``minimax_m2`` templates write (``|||IP_ADDRESS|||``, ``<|im_start|>``, ``<｜User｜>``,
  ``<|start|>``, ``]~b]``, ...);
- :func:`write_model`: a random MoE checkpoint of a transformers family (``OlmoeForCausalLM``,
  ``Qwen3MoeForCausalLM``, ``DeepseekV3ForCausalLM``, ``DeepseekV4ForCausalLM``,
  ``GptOssForCausalLM``, ``MiniMaxM2ForCausalLM``) from a config, written with ``save_pretrained``
  next to the tokenizer;
- :func:`chat_rows` / :func:`write_chat_dataset`: ``{"messages": [user, assistant]}`` rows of
  random English words;
- :func:`write_indexed_dataset`: Megatron's indexed dataset (``PREFIX.bin``/``PREFIX.idx``, what
  Megatron-LM's ``tools/preprocess_data.py`` writes) of the same text, tokenized;
- for torchtitan (:func:`write_titan_assets`): a corpus of JSON lines ``{"text": ...}``
  (:func:`titan_corpus`, :func:`write_text_dataset`, what torchtitan's ``c4_test`` and the recipes'
  ``fineweb_edu`` read) and a byte-level BPE tokenizer trained on it with ``<|begin_of_text|>`` /
  ``<|end_of_text|>``, named in its ``tokenizer_config.json`` as torchtitan reads them
  (:func:`write_titan_tokenizer`).

Used by the recipe rehearsal (:mod:`elastic_moe_plugin.tools.recipes.rehearse`) and by the tests
(``tests/swift/_tiny_assets.py``, ``tests/fixtures/titan/assets.py``). Everything is seeded: the same
calls write the same files.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "SPECIAL_TOKENS",
    "TITAN_BOS",
    "TITAN_EOS",
    "TITAN_VOCAB",
    "VOCAB",
    "WORDS",
    "chat_rows",
    "sentence",
    "titan_corpus",
    "train_tokenizer",
    "write_chat_dataset",
    "write_indexed_dataset",
    "write_model",
    "write_text_dataset",
    "write_titan_assets",
    "write_titan_tokenizer",
]

VOCAB = 384
#: ChatML and OLMoE's separators, then the ones ms-swift's ``deepseek_v2_5`` (DeepSeek-V3; its
#: ``deepseek_v4`` writes the same), ``gpt_oss`` (harmony) and ``minimax_m2`` templates write: each is
#: one token, as in the real tokenizers, so that a template's separators never split into byte pieces
#: of the random text around them
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "|||IP_ADDRESS|||",
    "<think>",
    "</think>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<|start|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|channel|>",
    "]~!b[",
    "]~b]",
    "[e~[",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
    "when",
    "up",
    "use",
    "your",
    "how",
    "said",
    "an",
    "each",
    "she",
    "which",
    "do",
    "their",
    "time",
    "if",
    "will",
    "way",
    "about",
    "many",
    "then",
    "them",
    "write",
    "would",
    "like",
    "so",
    "these",
    "her",
    "long",
    "make",
    "thing",
    "see",
    "him",
    "two",
    "has",
    "look",
    "more",
    "day",
    "could",
    "go",
    "come",
    "did",
    "number",
    "sound",
    "no",
    "most",
    "people",
    "my",
    "over",
    "know",
    "water",
    "than",
    "call",
    "first",
)
#: transformers family -> (config class, model class) under ``transformers.models``
FAMILIES: dict[str, tuple[str, str]] = {
    "olmoe": ("olmoe.OlmoeConfig", "olmoe.OlmoeForCausalLM"),
    "qwen3_moe": ("qwen3_moe.Qwen3MoeConfig", "qwen3_moe.Qwen3MoeForCausalLM"),
    "qwen3": ("qwen3.Qwen3Config", "qwen3.Qwen3ForCausalLM"),  # dense: the plugin's refusal tests
    # other routing styles of the transformers door (``elastic_moe_plugin/hf/family_table.py``):
    # sigmoid + correction bias + groups; the router's activation + correction bias, with hash-routed
    # layers; top-k on the logits then softmax over the kept; sigmoid + a correction bias the block
    # passes in
    "deepseek_v3": ("deepseek_v3.DeepseekV3Config", "deepseek_v3.DeepseekV3ForCausalLM"),
    "deepseek_v4": ("deepseek_v4.DeepseekV4Config", "deepseek_v4.DeepseekV4ForCausalLM"),
    "gpt_oss": ("gpt_oss.GptOssConfig", "gpt_oss.GptOssForCausalLM"),
    "minimax_m2": ("minimax_m2.MiniMaxM2Config", "minimax_m2.MiniMaxM2ForCausalLM"),
}


def sentence(rng: random.Random, words: int) -> str:
    """``words`` random words, capitalised, with a full stop."""
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def train_tokenizer(rng: random.Random):
    """A ``PreTrainedTokenizerFast`` of at most :data:`VOCAB` tokens, trained on 2000 random sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([sentence(rng, rng.randint(5, 20)) for _ in range(2000)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>", chat_template=CHAT_TEMPLATE
    )
    assert len(fast) <= VOCAB, len(fast)
    return fast


def _resolve(dotted: str):
    module_name, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(f"transformers.models.{module_name}"), attribute)


def write_model(directory: Path, family: str, tokenizer: Any, config: dict[str, Any], seed: int = 0) -> Path:
    """A random ``family`` model of ``config`` (transformers config keys), with ``tokenizer``, saved in
    ``directory`` (weights drawn after ``torch.manual_seed(seed)``; the global RNG is restored)."""
    import torch

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}.")
    config_path, model_path = FAMILIES[family]
    with torch.random.fork_rng():
        model_config = _resolve(config_path)(
            **config, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None
        )
        torch.manual_seed(seed)
        _resolve(model_path)(model_config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def chat_rows(rng: random.Random, count: int, sentences: int = 3, words: tuple[int, int] = (20, 30)) -> list[dict]:
    """``count`` rows ``{"messages": [user, assistant]}`` of ``sentences`` random sentences each."""
    rows = []
    for _ in range(count):
        user = " ".join(sentence(rng, rng.randint(*words)) for _ in range(sentences))
        assistant = " ".join(sentence(rng, rng.randint(*words)) for _ in range(sentences))
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]})
    return rows


def write_chat_dataset(path: Path, rows: Iterable[dict]) -> Path:
    """``rows`` as a jsonl file (ms-swift reads a local ``.jsonl`` given as ``--dataset``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return Path(path)


def write_indexed_dataset(prefix: Path, tokenizer: Any, documents: Iterable[str]) -> int:
    """Megatron's indexed dataset of ``documents`` (each tokenized, then the EOS token appended, as
    ``tools/preprocess_data.py --append-eod`` writes it) at ``PREFIX.bin``/``PREFIX.idx``; returns the
    number of tokens. Needs megatron-core (``megatron.core.datasets.indexed_dataset``)."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    total = 0
    for text in documents:
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        builder.add_document(torch.tensor(ids, dtype=torch.int32), [len(ids)])
        total += len(ids)
    builder.finalize(f"{prefix}.idx")
    return total


# ================================================================================== torchtitan
#: the torchtitan tokenizer's vocabulary (under the tiny and the debug models' embeddings)
TITAN_VOCAB = 1024
TITAN_BOS, TITAN_EOS = "<|begin_of_text|>", "<|end_of_text|>"
_TITAN_TEXT = (
    "expert router token budget layer gate score weight sparse dense mixture elastic static rank "
    "train step loss batch sequence model shard gradient optimizer schedule sample mean variance "
    "the a of to in and is for on with as by at from that this be are was it or an"
)
_TITAN_WORDS = tuple(_TITAN_TEXT.split())


def titan_corpus(documents: int = 600, seed: int = 0) -> list[str]:
    """``documents`` texts of 40-120 words from a fixed word list (the same on every machine)."""
    generator = random.Random(seed)
    return [" ".join(generator.choices(_TITAN_WORDS, k=generator.randint(40, 120))) + "." for _ in range(documents)]


def write_text_dataset(directory: Path, texts: Iterable[str]) -> Path:
    """``directory/data.json``: one ``{"text": ...}`` line per text (``datasets.load_dataset(directory)``
    reads it, streamed or not)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / "data.json").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return Path(directory)


def write_titan_tokenizer(directory: Path, texts: Iterable[str]) -> Path:
    """A byte-level BPE tokenizer of at most :data:`TITAN_VOCAB` tokens trained on ``texts``, as
    torchtitan's ``HuggingFaceTokenizer`` reads a folder: ``tokenizer.json`` and a
    ``tokenizer_config.json`` naming BOS and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TITAN_VOCAB, special_tokens=[TITAN_BOS, TITAN_EOS], show_progress=False)
    tokenizer.train_from_iterator(list(texts), trainer)
    Path(directory).mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(Path(directory) / "tokenizer.json"))
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps({"bos_token": TITAN_BOS, "eos_token": TITAN_EOS}))
    return Path(directory)


def write_titan_assets(folder: Path, *, repeated: bool = False) -> Path:
    """What torchtitan's debug configs read from their working directory, under ``folder``:
    ``tests/assets/tokenizer`` and the ``c4_test`` dataset ``tests/assets/c4_test`` (files of its
    source repository, not of its wheel); returns ``folder``.

    ``repeated``: every document of the dataset is the corpus's first one, so that every data-parallel
    rank's token stream is the same as a single process's (torchtitan splits the documents between
    ranks): a 2-rank step then sees the global batch of one process, twice."""
    texts = titan_corpus()
    write_text_dataset(folder / "tests" / "assets" / "c4_test", [texts[0]] * len(texts) if repeated else texts)
    write_titan_tokenizer(folder / "tests" / "assets" / "tokenizer", texts)
    return folder
