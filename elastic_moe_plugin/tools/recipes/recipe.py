"""A loaded recipe (:class:`Recipe`), the model architecture it describes (:class:`ModelFacts`,
with the parameter counts ``elastic-moe budget`` uses), and how messages name recipe files."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.tools import PACKAGE_CONFIGS_DIR
from elastic_moe_plugin.tools.recipes.schema import PLACEHOLDERS, RecipeError

#: the built-in recipes, shipped as package data (a checkout's top-level ``configs/`` links here)
CONFIGS_DIR = PACKAGE_CONFIGS_DIR

_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")


def display_path(path: str | Path) -> str:
    """How messages show a recipe file: a built-in one as ``configs/<setting>/<name>.yaml`` (the
    installed location is long and says nothing), any other relative to the current directory
    when that is shorter."""
    try:
        inside = Path(os.path.abspath(path)).relative_to(CONFIGS_DIR)
    except ValueError:
        inside = None
    if inside is not None:
        return (Path(CONFIGS_DIR.name) / inside).as_posix() if inside.parts else CONFIGS_DIR.name
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return str(path)
    return relative if len(relative) <= len(str(path)) else str(path)


@dataclass(frozen=True)
class ModelFacts:
    """The architecture of an MoE decoder, enough for parameter counts and launch checks.

    Parameter counts include every matrix (embeddings, attention, router, SwiGLU experts with
    three ``hidden x moe_ffn`` matrices each) and leave out norm weights and biases (< 0.01 %).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    num_experts: int
    topk: int
    moe_ffn_hidden_size: int
    vocab_size: int
    untied_embeddings: bool
    train_topk: int | None = None

    @property
    def training_topk(self) -> int:
        """The static top-k the model routes with in training (``train_topk`` or ``topk``)."""
        return self.train_topk if self.train_topk is not None else self.topk

    @property
    def attention_width(self) -> int:
        """d_attn: the query width, heads x head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projections of one layer."""
        q = self.hidden_size * self.attention_width
        kv = 2 * self.hidden_size * self.num_query_groups * self.head_dim
        return 2 * q + kv

    @property
    def expert_params(self) -> int:
        """One SwiGLU expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the output head (the head counts only when untied)."""
        return self.vocab_size * self.hidden_size * (2 if self.untied_embeddings else 1)

    def non_embedding_params(self, experts_per_token: float | None = None) -> float:
        """Per-layer attention + router + experts, summed over layers. ``experts_per_token=None``: all experts."""
        experts = self.num_experts if experts_per_token is None else experts_per_token
        return self.num_layers * (self.attention_params + self.router_params + experts * self.expert_params)

    def total_params(self) -> int:
        return int(self.non_embedding_params() + self.embedding_params)

    def active_params(self, experts_per_token: float | None = None) -> float:
        k = self.topk if experts_per_token is None else experts_per_token
        return self.non_embedding_params(k) + self.embedding_params


@dataclass(frozen=True)
class Recipe:
    """A loaded, merged and validated recipe. ``origin`` maps key paths to the file that set them."""

    path: Path
    data: dict[str, Any]
    origin: dict[tuple, str] = field(repr=False)

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def setting(self) -> str:
        return self.data["setting"]

    @property
    def launcher(self) -> str:
        return self.data["launcher"]

    @property
    def description(self) -> str:
        return self.data.get("description") or ""

    @property
    def model(self) -> ModelFacts:
        return ModelFacts(**self.data["model"])

    @property
    def parallel(self) -> dict[str, int]:
        return dict(self.data["parallel"])

    @property
    def batch(self) -> dict[str, int]:
        return dict(self.data["batch"])

    @property
    def cluster(self) -> dict[str, int]:
        return dict(self.data.get("cluster") or {})

    @property
    def elastic(self) -> ElasticConfig:
        return ElasticConfig(**self.data.get("elastic", {}))

    @property
    def args(self) -> dict[str, Any]:
        return {k: v for k, v in (self.data.get("args") or {}).items() if v is not None}

    @property
    def env(self) -> dict[str, str]:
        return {k: _env_value(v) for k, v in (self.data.get("env") or {}).items() if v is not None}

    def file_of(self, *path: str) -> str:
        """The file that set ``path`` (e.g. ``file_of('elastic', 'schedule')``), for messages."""
        for cut in range(len(path), 0, -1):
            file = self.origin.get(tuple(path[:cut]))
            if file:
                return display_path(file)
        return display_path(self.path)

    def get(self, dotted: str) -> Any:
        """The value at a dotted key path (``'args.learning_rate'``); KeyError if absent."""
        node: Any = self.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                raise KeyError(dotted)
            node = node[part]
        return node

    def interpolate(self, value: Any, where: str) -> Any:
        """``value`` with its ``${recipe}``/``${setting}`` placeholders filled in; ``where`` is its
        dotted key, for the error an unknown placeholder raises."""
        if not isinstance(value, str):
            return value

        def sub(match: re.Match) -> str:
            name = match.group(1)
            if name == "recipe":
                return self.name
            if name == "setting":
                return self.setting
            raise RecipeError(
                f"{self.file_of(*where.split('.'))}: {where} uses ${{{name}}}; the placeholders are "
                f"{', '.join('${' + p + '}' for p in PLACEHOLDERS)}."
            )

        return _PLACEHOLDER.sub(sub, value)


def flat_flags(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested ``args`` as dotted flag names (``{"training": {"steps": 10}}`` -> ``{"training.steps": 10}``),
    in order; ``None`` (a flag an overlay deletes) and empty mappings are left out."""
    flags: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flags.update(flat_flags(value, name + "."))
        elif value is not None:
            flags[name] = value
    return flags


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
