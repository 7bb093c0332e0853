"""Training recipes: YAML files that reproduce the paper's three settings (``configs/``).

A recipe is one YAML file. It names a **launcher** (how the run starts) and carries five
validated blocks plus the framework's own flags::

    extends: [base.yaml, ../overlays/6-10.yaml]   # included first, in order, then this file
    description: one line
    setting: olmoe_sft                 # which paper setting (the folder name)
    launcher: swift_sft                # swift_sft | megatron_sft | megatron_lm
    script: pretrain_gpt.py            # megatron_lm only: the Megatron-LM script to run
    cluster:  {nnodes: 2, nproc_per_node: 8, master_port: 29500}
    model:    {name, num_layers, hidden_size, num_attention_heads, num_query_groups, head_dim,
               num_experts, topk, moe_ffn_hidden_size, vocab_size, untied_embeddings, train_topk}
    parallel: {tp, pp, cp, ep, etp}
    batch:    {global, micro, seq_length}
    elastic:  {ElasticConfig fields}   # -> ELASTIC_MOE_* environment of the launched command
    env:      {NAME: value}            # extra environment (never ELASTIC_MOE_*: use elastic:)
    args:     {flag: value}            # the framework's flags, spelled as the framework spells
                                       # them, without the leading dashes

Merging (``extends``): parents are loaded in order, then the file itself; mappings merge
recursively, anything else (scalars, lists) replaces. ``null`` deletes an inherited flag in
``args``/``env`` (it is not rendered). Every key of every file is checked where it is written,
so an unknown key is an error naming the key and that file.

The structured blocks own the numbers the launcher checks (world size, batch arithmetic,
expert parallelism, layer ranges) and renders into the framework's flags; ``args`` may not set
those flags a second time. ``model`` holds the checkpoint's architecture (ms-swift recipes: facts
of the HF config, used for checks and ``elastic-moe budget``; Megatron-LM: rendered into the
architecture flags). ``model.train_topk`` trains with a different static top-k than the
checkpoint's (the paper's top-9/top-10 controls, evaluated at ``model.topk``).

String values in ``args``/``env``/``script`` may use ``${recipe}`` (the file's stem, e.g.
``6-10``) and ``${setting}``.

This module loads, merges and validates recipes (and lists them: ``elastic-moe recipes``);
:mod:`elastic_moe_plugin.tools.recipes.render` renders and runs them, :mod:`elastic_moe_plugin.tools.recipes.compute` does the
arithmetic, :mod:`elastic_moe_plugin.tools.recipes.argcheck` checks the rendered flags with the
frameworks' parsers. See ``docs/recipes.md`` for the settings, the paper table and every value the
paper leaves open.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from elastic_moe_plugin.core.config import ConfigError, ElasticConfig
from elastic_moe_plugin.tools import PACKAGE_CONFIGS_DIR

#: the recipes, shipped as package data (a checkout's top-level ``configs/`` links here)
CONFIGS_DIR = PACKAGE_CONFIGS_DIR

LAUNCHERS: tuple[str, ...] = ("swift_sft", "megatron_sft", "megatron_lm")

TOP_LEVEL_KEYS: tuple[str, ...] = (
    "extends", "description", "setting", "launcher", "script", "cluster", "model", "parallel", "batch",
    "elastic", "env", "args",
)

_INT = "int"
_POS_INT = "positive int"
_STR = "str"
_BOOL = "bool"
_OPT_POS_INT = "positive int or null"

#: block -> key -> type tag. ``elastic`` is checked against ElasticConfig's fields instead.
SCHEMA: dict[str, dict[str, str]] = {
    "cluster": {"nnodes": _POS_INT, "nproc_per_node": _POS_INT, "master_port": _POS_INT},
    "model": {
        "name": _STR,
        "num_layers": _POS_INT,
        "hidden_size": _POS_INT,
        "num_attention_heads": _POS_INT,
        "num_query_groups": _POS_INT,
        "head_dim": _POS_INT,
        "num_experts": _POS_INT,
        "topk": _POS_INT,
        "moe_ffn_hidden_size": _POS_INT,
        "vocab_size": _POS_INT,
        "untied_embeddings": _BOOL,
        "train_topk": _OPT_POS_INT,
    },
    "parallel": {"tp": _POS_INT, "pp": _POS_INT, "cp": _POS_INT, "ep": _POS_INT, "etp": _POS_INT},
    "batch": {"global": _POS_INT, "micro": _POS_INT, "seq_length": _POS_INT},
}
_OPTIONAL = {("model", "train_topk")}

#: Flags the structured blocks render, per launcher (``args`` may not repeat them).
OWNED_FLAGS: dict[str, dict[str, str]] = {
    "swift_sft": {
        "model": "model.name", "per_device_train_batch_size": "batch.micro",
        "gradient_accumulation_steps": "batch.global (derived from the world size)",
        "max_length": "batch.seq_length", "external_plugins": "the launcher (plugin_path())",
    },
    "megatron_sft": {
        "model": "model.name", "micro_batch_size": "batch.micro", "global_batch_size": "batch.global",
        "max_length": "batch.seq_length", "tensor_model_parallel_size": "parallel.tp",
        "pipeline_model_parallel_size": "parallel.pp", "context_parallel_size": "parallel.cp",
        "expert_model_parallel_size": "parallel.ep", "expert_tensor_parallel_size": "parallel.etp",
        "external_plugins": "the launcher (plugin_path())",
    },
    "megatron_lm": {
        "num-layers": "model.num_layers", "hidden-size": "model.hidden_size",
        "num-attention-heads": "model.num_attention_heads", "group-query-attention": "model.num_query_groups",
        "num-query-groups": "model.num_query_groups", "kv-channels": "model.head_dim",
        "num-experts": "model.num_experts", "moe-ffn-hidden-size": "model.moe_ffn_hidden_size",
        "moe-router-topk": "model.topk / model.train_topk",
        "untie-embeddings-and-output-weights": "model.untied_embeddings",
        "make-vocab-size-divisible-by": "model.vocab_size", "seq-length": "batch.seq_length",
        "max-position-embeddings": "batch.seq_length", "micro-batch-size": "batch.micro",
        "global-batch-size": "batch.global", "tensor-model-parallel-size": "parallel.tp",
        "pipeline-model-parallel-size": "parallel.pp", "context-parallel-size": "parallel.cp",
        "expert-model-parallel-size": "parallel.ep", "expert-tensor-parallel-size": "parallel.etp",
    },
}

_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_PLACEHOLDERS = ("recipe", "setting")


class RecipeError(ConfigError):
    """A recipe is invalid or does not fit the cluster. The message names the file and key."""


# ================================================================================== loading
_READ_CACHE: dict[tuple[Path, int, int], Any] = {}


def _read(path: Path) -> dict[str, Any]:
    """One YAML file as a fresh dict (parsed once per file version)."""
    import yaml

    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist.")
    stat = path.stat()
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _READ_CACHE:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        try:
            _READ_CACHE[key] = yaml.load(path.read_text(), Loader=loader)  # noqa: S506 - a safe loader
        except yaml.YAMLError as error:
            raise RecipeError(f"{path}: not valid YAML: {error}") from None
    data = copy.deepcopy(_READ_CACHE[key])
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of recipe keys, got {type(data).__name__}.")
    return data


def _unknown(file: Path | str, where: str, key: Any, known: Iterable[str]) -> RecipeError:
    known = list(known)
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    label = f"{where}.{key}" if where else str(key)
    return RecipeError(f"{file}: unknown key {label!r}{hint}. Accepted keys{' in ' + where if where else ''}: "
                       f"{', '.join(known)}.")


def _check_file_keys(file: Path, data: Mapping[str, Any]) -> None:
    """Structural check of one file's own keys, so errors name the file that wrote them."""
    for key, value in data.items():
        if key not in TOP_LEVEL_KEYS:
            raise _unknown(file, "", key, TOP_LEVEL_KEYS)
        if key in SCHEMA or key in ("elastic", "env", "args"):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise RecipeError(f"{file}: '{key}' must be a mapping, got {type(value).__name__}.")
            known = SCHEMA[key] if key in SCHEMA else ElasticConfig.field_names() if key == "elastic" else None
            if known is not None:
                for sub in value:
                    if sub not in known:
                        raise _unknown(file, key, sub, known)
        if key == "env" and isinstance(value, dict):
            for name in value:
                if str(name).startswith("ELASTIC_MOE_"):
                    raise RecipeError(
                        f"{file}: env.{name} is set directly; put elastic settings in the 'elastic:' block "
                        f"(the launcher renders every ELASTIC_MOE_* variable from it)."
                    )


def _paths(value: Any, file: str, path: tuple = ()) -> dict[tuple, str]:
    """{key path: file} for ``value`` and everything under it."""
    found = {path: file} if path else {}
    if isinstance(value, dict):
        for key, sub in value.items():
            found.update(_paths(sub, file, path + (key,)))
    return found


def _merge(base: dict, base_origin: dict, over: Mapping, over_origin: Mapping, path: tuple = ()) -> None:
    """Deep-merge ``over`` into ``base`` (mappings recurse, anything else replaces), keeping
    ``base_origin`` (key path -> file) in step."""
    for key, value in over.items():
        here = path + (key,)
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], base_origin, value, over_origin, here)
            continue
        base[key] = copy.deepcopy(value)
        for stale in [p for p in base_origin if p[: len(here)] == here]:
            del base_origin[stale]
        base_origin.update({p: f for p, f in over_origin.items() if p[: len(here)] == here})


def _load_tree(path: Path, stack: tuple[Path, ...]) -> tuple[dict, dict]:
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(str(p) for p in stack + (path,))
        raise RecipeError(f"{stack[-1]}: 'extends' forms a cycle: {chain}.")
    data = _read(path)
    _check_file_keys(path, data)
    parents = data.get("extends") or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise RecipeError(f"{path}: 'extends' must be a file name or a list of file names, got {parents!r}.")
    merged: dict = {}
    origin: dict = {}
    for parent in parents:
        parent_path = path.parent / parent
        if not parent_path.is_file():
            raise RecipeError(f"{path}: extends {parent!r}, but {parent_path} does not exist.")
        parent_data, parent_origin = _load_tree(parent_path, stack + (path,))
        _merge(merged, origin, parent_data, parent_origin)
    own = {k: v for k, v in data.items() if k != "extends"}
    _merge(merged, origin, own, _paths(own, str(path)))
    return merged, origin


def display_path(path: str | Path) -> str:
    """A path relative to the current directory when that is shorter (for messages)."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return str(path)
    return relative if len(relative) <= len(str(path)) else str(path)


# ================================================================================== model facts
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


# ================================================================================== the recipe
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
                f"{', '.join('${' + p + '}' for p in _PLACEHOLDERS)}."
            )

        return _PLACEHOLDER.sub(sub, value)


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _check_type(recipe_path: str, label: str, value: Any, tag: str) -> None:
    ok = {
        _POS_INT: isinstance(value, int) and not isinstance(value, bool) and value > 0,
        _OPT_POS_INT: value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
        _STR: isinstance(value, str) and bool(value.strip()),
        _BOOL: isinstance(value, bool),
    }[tag]
    if not ok:
        raise RecipeError(f"{recipe_path}: {label}={value!r} is invalid: expected a {tag}.")


def load_recipe(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> Recipe:
    """Load ``path`` (or a name such as ``olmoe_sft/6-10`` under ``configs/``), merge its
    ``extends`` chain, apply ``KEY=VALUE`` overrides (``args.learning_rate=1e-5``) and validate.

    Raises:
        RecipeError: naming the file and key of the first problem found.
    """
    file = resolve_recipe_path(path)
    data, origin = _load_tree(file, ())
    for item in overrides:
        _apply_override(data, origin, item)
    recipe = Recipe(path=file, data=data, origin=origin)
    validate(recipe)
    return recipe


def resolve_recipe_path(path: str | os.PathLike[str]) -> Path:
    candidate = Path(path)
    if candidate.is_file():
        return candidate.resolve()
    for guess in (CONFIGS_DIR / candidate, CONFIGS_DIR / f"{candidate}.yaml"):
        if guess.is_file():
            return guess.resolve()
    names = ", ".join(sorted(name for name, _ in list_recipe_files())) or "(no configs/ folder found)"
    raise RecipeError(f"recipe {str(path)!r} does not exist (as a path or under {display_path(CONFIGS_DIR)}/). Recipes: {names}.")


def _apply_override(data: dict, origin: dict, item: str) -> None:
    import yaml

    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. args.learning_rate=1.0e-5 or elastic.schedule=7-9.")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    value = yaml.safe_load(text) if text.strip() else None
    top = parts[0]
    if top not in TOP_LEVEL_KEYS or top == "extends":
        raise _unknown("--set", "", top, [k for k in TOP_LEVEL_KEYS if k != "extends"])
    if len(parts) == 2 and (top in SCHEMA or top == "elastic"):
        known = SCHEMA[top] if top in SCHEMA else ElasticConfig.field_names()
        if parts[1] not in known:
            raise _unknown("--set", top, parts[1], known)
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"--set {item!r}: {part!r} is not a mapping.")
    node[parts[-1]] = value
    for stale in [p for p in origin if p[: len(parts)] == tuple(parts)]:
        del origin[stale]
    origin.update(_paths({parts[-1]: value}, "--set", tuple(parts[:-1])))


# ================================================================================== validation
def validate(recipe: Recipe) -> None:
    """Check a merged recipe: required keys, types, the elastic block against the model."""
    data = recipe.data
    where = display_path(recipe.path)
    launcher = data.get("launcher")
    if launcher is None:
        raise RecipeError(
            f"{where}: no 'launcher' after merging its extends chain; this file is an overlay. Launch a recipe "
            f"that extends it (e.g. configs/<setting>/<schedule>.yaml)."
        )
    if launcher not in LAUNCHERS:
        raise RecipeError(f"{recipe.file_of('launcher')}: launcher={launcher!r} is not one of {LAUNCHERS}.")
    _check_type(recipe.file_of("setting"), "setting", data.get("setting"), _STR)
    if "script" in data and launcher != "megatron_lm":
        raise RecipeError(f"{recipe.file_of('script')}: 'script' is only used by launcher megatron_lm.")
    if launcher == "megatron_lm":
        _check_type(recipe.file_of("script"), "script", data.get("script"), _STR)
    for block, keys in SCHEMA.items():
        values = data.get(block)
        if block == "cluster" and values is None:
            continue
        if not isinstance(values, dict):
            raise RecipeError(f"{where}: missing block '{block}:' (keys: {', '.join(keys)}).")
        for key, tag in keys.items():
            if key not in values:
                if (block, key) in _OPTIONAL or block == "cluster":
                    continue
                raise RecipeError(f"{where}: missing key {block}.{key} ({tag}); set it in the setting's base.yaml.")
            _check_type(recipe.file_of(block, key), f"{block}.{key}", values[key], tag)
    for block in ("args", "env"):
        if data.get(block) is not None and not isinstance(data[block], dict):
            raise RecipeError(f"{recipe.file_of(block)}: '{block}' must be a mapping.")
    _check_owned_flags(recipe)
    model = recipe.model
    if model.num_attention_heads % model.num_query_groups:
        raise RecipeError(
            f"{recipe.file_of('model', 'num_query_groups')}: model.num_query_groups={model.num_query_groups} must "
            f"divide model.num_attention_heads={model.num_attention_heads}."
        )
    if model.training_topk > model.num_experts:
        raise RecipeError(
            f"{recipe.file_of('model', 'train_topk')}: training top-k {model.training_topk} exceeds "
            f"model.num_experts={model.num_experts}."
        )
    if launcher == "swift_sft":
        bad = {k: v for k, v in recipe.parallel.items() if v != 1}
        if bad:
            raise RecipeError(
                f"{recipe.file_of('parallel')}: launcher swift_sft (transformers + DeepSpeed/FSDP) is pure data "
                f"parallel; parallel.{', parallel.'.join(bad)} must be 1 (use megatron_sft for TP/PP/EP)."
            )
    elastic = _elastic_config(recipe)
    try:
        elastic.resolve(num_experts=model.num_experts, topk=model.training_topk, num_layers=model.num_layers)
    except ConfigError as error:
        message = str(error)
        key = "layers" if message.startswith("layers=") else "schedule"
        raise RecipeError(
            f"{recipe.file_of('elastic', key)}: elastic.{key}: {message} (model {model.name}: "
            f"{model.num_layers} layers, {model.num_experts} experts, training top-{model.training_topk})"
        ) from None
    for block in ("args", "env"):
        for key, value in (data.get(block) or {}).items():
            recipe.interpolate(value, f"{block}.{key}")
    if "script" in data:
        recipe.interpolate(data["script"], "script")


def _elastic_config(recipe: Recipe) -> ElasticConfig:
    values = recipe.data.get("elastic") or {}
    try:
        return ElasticConfig(**values)
    except ConfigError as error:
        message = str(error)
        key = _first_field(message)
        file = recipe.file_of("elastic", key) if key else recipe.file_of("elastic")
        label = f"elastic.{key}" if key else "elastic"
        raise RecipeError(f"{file}: {label}: {message}") from None
    except TypeError as error:  # pragma: no cover - keys are checked per file before
        raise RecipeError(f"{recipe.file_of('elastic')}: elastic: {error}") from None


def _first_field(message: str) -> str | None:
    """The ElasticConfig field an error message is about: the one named first."""
    hits = [(m.start(), name) for name in ElasticConfig.field_names()
            for m in [re.search(rf"\b{name}\b", message)] if m]
    return min(hits)[1] if hits else None


def _check_owned_flags(recipe: Recipe) -> None:
    owned = OWNED_FLAGS[recipe.launcher]
    normal = {_norm(flag): (flag, owner) for flag, owner in owned.items()}
    for key in recipe.data.get("args") or {}:
        hit = normal.get(_norm(str(key)))
        if hit:
            raise RecipeError(
                f"{recipe.file_of('args', key)}: args.{key} is rendered from {hit[1]}; set it there, not in args "
                f"(the launcher checks and renders it)."
            )


def _norm(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


# ================================================================================== listing
def setting_dirs(root: Path | None = None) -> list[Path]:
    """The setting folders of ``configs/``: those with a ``base.yaml`` (other folders, such as
    ``configs/eval/``, hold other tools' files)."""
    root = CONFIGS_DIR if root is None else root
    return sorted(p.parent for p in root.glob("*/base.yaml")) if root.is_dir() else []


def list_recipe_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """``[(name, path)]`` of the launchable recipes: ``configs/<setting>/*.yaml`` except ``base.yaml``."""
    found = []
    for folder in setting_dirs(root):
        for path in sorted(folder.glob("*.yaml")):
            if path.name != "base.yaml":
                found.append((f"{folder.name}/{path.stem}", path))
    return found


# ================================================================================== CLI: recipes
def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None, help="print this recipe fully merged (path or setting/name)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--check-args", action="store_true",
                        help="check every recipe's (or RECIPE's) rendered flags with ms-swift's and Megatron-LM's own "
                             "argument parsers (python -m elastic_moe_plugin.tools.recipes.argcheck)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "check_args", False):
        from elastic_moe_plugin.tools.recipes import argcheck as recipe_argcheck

        return recipe_argcheck.main(([args.recipe] if args.recipe else []) + (["--json"] if args.json else []))
    if args.recipe:
        recipe = load_recipe(args.recipe)
        if args.json:
            print(json.dumps(recipe.data, indent=2, default=str))
        else:
            import yaml

            print(f"# {display_path(recipe.path)} merged (extends resolved)")
            print(yaml.safe_dump(recipe.data, sort_keys=False).rstrip())
        return 0
    rows = []
    for name, path in list_recipe_files():
        recipe = load_recipe(path)
        rows.append({"name": name, "path": display_path(path), "launcher": recipe.launcher, "description": recipe.description})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max((len(r["name"]) for r in rows), default=4)
    for row in rows:
        print(f"{row['name']:<{width}}  {row['launcher']:<12}  {row['description']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(recipe=sys.argv[1] if len(sys.argv) > 1 else None, json=False, check_args=False)))
