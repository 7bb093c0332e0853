"""What a recipe may contain: its keys and their types, the launchers, the flags the structured
blocks own, and the error every recipe problem raises. The format is described in docs/recipes.md."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from elastic_moe_plugin.core.errors import ConfigError

LAUNCHERS: tuple[str, ...] = ("swift_sft", "megatron_sft", "megatron_lm", "torchtitan")

TOP_LEVEL_KEYS: tuple[str, ...] = (
    "extends",
    "description",
    "setting",
    "launcher",
    "script",
    "cluster",
    "model",
    "parallel",
    "batch",
    "elastic",
    "env",
    "args",
)

#: the free-form mappings: ``elastic`` (checked against ElasticConfig's fields), ``env`` and ``args``
MAPPING_BLOCKS: tuple[str, ...] = ("elastic", "env", "args")

POS_INT = "positive int"
STR = "str"
BOOL = "bool"
OPT_POS_INT = "positive int or null"

#: block -> key -> type tag. ``elastic`` is checked against ElasticConfig's fields instead.
SCHEMA: dict[str, dict[str, str]] = {
    "cluster": {"nnodes": POS_INT, "nproc_per_node": POS_INT, "master_port": POS_INT},
    "model": {
        "name": STR,
        "num_layers": POS_INT,
        "hidden_size": POS_INT,
        "num_attention_heads": POS_INT,
        "num_query_groups": POS_INT,
        "head_dim": POS_INT,
        "num_experts": POS_INT,
        "topk": POS_INT,
        "moe_ffn_hidden_size": POS_INT,
        "vocab_size": POS_INT,
        "untied_embeddings": BOOL,
        "train_topk": OPT_POS_INT,
    },
    "parallel": {"tp": POS_INT, "pp": POS_INT, "cp": POS_INT, "ep": POS_INT, "etp": POS_INT},
    "batch": {"global": POS_INT, "micro": POS_INT, "seq_length": POS_INT},
}
#: keys of SCHEMA a recipe may leave out (every ``cluster`` key may be left out too)
OPTIONAL_KEYS = {("model", "train_topk")}

#: Flags the structured blocks render, per launcher (``args`` may not repeat them).
OWNED_FLAGS: dict[str, dict[str, str]] = {
    "swift_sft": {
        "model": "model.name",
        "per_device_train_batch_size": "batch.micro",
        "gradient_accumulation_steps": "batch.global (derived from the world size)",
        "max_length": "batch.seq_length",
        "external_plugins": "the launcher (--plugin elastic_moe)",
        "plugin": "the launcher (--plugin elastic_moe)",
    },
    "megatron_sft": {
        "model": "model.name",
        "micro_batch_size": "batch.micro",
        "global_batch_size": "batch.global",
        "max_length": "batch.seq_length",
        "tensor_model_parallel_size": "parallel.tp",
        "pipeline_model_parallel_size": "parallel.pp",
        "context_parallel_size": "parallel.cp",
        "expert_model_parallel_size": "parallel.ep",
        "expert_tensor_parallel_size": "parallel.etp",
        "external_plugins": "the launcher (--plugin elastic_moe)",
        "plugin": "the launcher (--plugin elastic_moe)",
    },
    "megatron_lm": {
        "num-layers": "model.num_layers",
        "hidden-size": "model.hidden_size",
        "num-attention-heads": "model.num_attention_heads",
        "group-query-attention": "model.num_query_groups",
        "num-query-groups": "model.num_query_groups",
        "kv-channels": "model.head_dim",
        "num-experts": "model.num_experts",
        "moe-ffn-hidden-size": "model.moe_ffn_hidden_size",
        "moe-router-topk": "model.topk / model.train_topk",
        "untie-embeddings-and-output-weights": "model.untied_embeddings",
        "make-vocab-size-divisible-by": "model.vocab_size",
        "seq-length": "batch.seq_length",
        "max-position-embeddings": "batch.seq_length",
        "micro-batch-size": "batch.micro",
        "global-batch-size": "batch.global",
        "tensor-model-parallel-size": "parallel.tp",
        "pipeline-model-parallel-size": "parallel.pp",
        "context-parallel-size": "parallel.cp",
        "expert-model-parallel-size": "parallel.ep",
        "expert-tensor-parallel-size": "parallel.etp",
    },
    # torchtitan's flags are dotted paths of its config tree; ``args`` nests them (``training: {steps: 10}``)
    "torchtitan": {
        "training.local_batch_size": "batch.micro",
        "training.global_batch_size": "batch.global",
        "training.seq_len": "batch.seq_length",
        "parallelism.data_parallel_shard_degree": "the world size over parallel.tp x pp x cp (FSDP over the rest)",
        "parallelism.data_parallel_replicate_degree": "the launcher (FSDP only: 1)",
        "parallelism.tensor_parallel_degree": "parallel.tp",
        "parallelism.pipeline_parallel_degree": "parallel.pp",
        "parallelism.context_parallel_degree": "parallel.cp",
        "parallelism.expert_parallel_degree": "parallel.ep",
        "override.imports": "the elastic: block (the door's --override.imports entry)",
    },
}

#: the ``${name}`` placeholders string values may use
PLACEHOLDERS = ("recipe", "setting")


class RecipeError(ConfigError):
    """A recipe is invalid or does not fit the cluster. The message names the file and key."""


def unknown_key_error(file: Any, where: str, key: Any, known: Iterable[str]) -> RecipeError:
    """The error for ``key`` (under block ``where``, or top level) that is not one of ``known``,
    with a did-you-mean."""
    known = list(known)
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    label = f"{where}.{key}" if where else str(key)
    return RecipeError(
        f"{file}: unknown key {label!r}{hint}. Accepted keys{' in ' + where if where else ''}: {', '.join(known)}."
    )


def check_type(file: str, label: str, value: Any, tag: str) -> None:
    """Raise unless ``value`` (at ``label``, set in ``file``) is of the type ``tag`` names."""
    ok = {
        POS_INT: isinstance(value, int) and not isinstance(value, bool) and value > 0,
        OPT_POS_INT: value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
        STR: isinstance(value, str) and bool(value.strip()),
        BOOL: isinstance(value, bool),
    }[tag]
    if not ok:
        raise RecipeError(f"{file}: {label}={value!r} is invalid: expected a {tag}.")
