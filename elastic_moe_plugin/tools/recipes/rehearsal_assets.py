"""The tiny assets of a rehearsal (:mod:`~elastic_moe_plugin.tools.recipes.rehearse`), built here
under its work folder: a random checkpoint of the recipe's family with its tokenizer and a chat
dataset, for Megatron-LM a tokenizer and indexed datasets at the recipe's own data paths, or for
torchtitan a tokenizer and text corpora at the recipe's own dataset paths.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
from collections.abc import Iterator
from pathlib import Path

from elastic_moe_plugin.tools.recipes.recipe import Recipe

__all__ = ["write_tiny_assets"]


def write_tiny_assets(recipe: Recipe, family: str | None, work: Path, steps: int) -> dict[str, str]:
    """The tiny checkpoint (or tokenizer) and data the rehearsal's recipe names, under ``work``."""
    from elastic_moe_plugin.tools.recipes import tiny_assets

    if recipe.launcher == "torchtitan":
        return _titan_assets(recipe, work)
    rng = random.Random(0)
    tokenizer = tiny_assets.train_tokenizer(rng)
    model = recipe.model
    tiny = work / "tiny"
    batch = recipe.batch
    if family is None:  # Megatron-LM: a tokenizer and an indexed dataset at the recipe's own paths
        (tiny / "tokenizer").mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(tiny / "tokenizer")
        needed = batch["global"] * (steps + 2) * batch["seq_length"]  # tokens: train steps + validation
        documents, total = [], 0
        while total < 2 * needed:
            documents.append(" ".join(tiny_assets.sentence(rng, rng.randint(10, 30)) for _ in range(8)))
            total += 8 * 25
        written = {}
        with _importable_megatron_core():
            for key in ("train-data-path", "valid-data-path", "test-data-path", "data-path"):
                for prefix in recipe.args.get(key) or []:
                    if isinstance(prefix, str) and not os.path.isabs(prefix):
                        written[prefix] = tiny_assets.write_indexed_dataset(work / prefix, tokenizer, documents)
        return {"tokenizer": str(tiny / "tokenizer"), **{f"data {k}": f"{v} tokens" for k, v in written.items()}}
    config = {
        "hidden_size": model.hidden_size,
        "intermediate_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": 2 * batch["seq_length"],
        "tie_word_embeddings": not model.untied_embeddings,
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.topk,
        "router_aux_loss_coef": 0.01,
        # the checkpoints' own gate conventions: OLMoE keeps the softmax weights of the kept experts,
        # Qwen3-MoE renormalises them (config.json norm_topk_prob of the real checkpoints)
        "norm_topk_prob": family == "qwen3_moe",
    }
    if family == "qwen3_moe":
        config["moe_intermediate_size"] = model.moe_ffn_hidden_size
    else:
        config["intermediate_size"] = model.moe_ffn_hidden_size
    tiny_assets.write_model(tiny / family, family, tokenizer, config)
    rows = tiny_assets.chat_rows(rng, batch["global"] * (steps + 1), sentences=2, words=(20, 30))
    tiny_assets.write_chat_dataset(tiny / "train.jsonl", rows)
    return {"model": str(tiny / family), "dataset": f"{tiny / 'train.jsonl'} ({len(rows)} rows)"}


def _titan_assets(recipe: Recipe, work: Path) -> dict[str, str]:
    """torchtitan's tokenizer at the rehearsal's ``hf_assets_path``, and a text corpus (``data.json``)
    in each dataset folder the recipe names, under ``work`` (relative paths land there)."""
    from elastic_moe_plugin.tools.recipes import tiny_assets

    texts = tiny_assets.titan_corpus()
    tokenizer = Path(work) / recipe.get("args.hf_assets_path")
    tiny_assets.write_titan_tokenizer(tokenizer, texts)
    written = {"tokenizer": str(tokenizer)}
    for key in ("dataloader", "validator.dataloader"):
        try:
            folder = recipe.get(f"args.{key}.dataset_path")
        except KeyError:
            continue
        tiny_assets.write_text_dataset(work / folder, texts)
        written[f"data {key}"] = f"{work / folder} ({len(texts)} documents)"
    return written


@contextlib.contextmanager
def _importable_megatron_core() -> Iterator[None]:
    """megatron-core 0.19 imports triton unconditionally; without triton, its CPU stand-in (the CPU
    runtime, on for the block) lets this process import ``megatron.core.datasets``."""
    if importlib.util.find_spec("triton") is not None:
        yield
        return
    from elastic_moe_plugin import cpu_runtime

    with cpu_runtime.enabled():
        yield
