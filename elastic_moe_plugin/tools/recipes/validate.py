"""Validate a merged recipe: required keys and their types, the flags ``args`` may not repeat, the
model's own consistency, and the ``elastic:`` block resolved against the model."""

from __future__ import annotations

from elastic_moe_plugin.core.config import ConfigError, ElasticConfig, Spelling
from elastic_moe_plugin.tools.recipes.recipe import Recipe, display_path, flat_flags
from elastic_moe_plugin.tools.recipes.schema import (
    LAUNCHERS,
    OPTIONAL_KEYS,
    OWNED_FLAGS,
    SCHEMA,
    STR,
    RecipeError,
    check_type,
)


def validate(recipe: Recipe) -> None:
    """Check a merged recipe: required keys, types, the elastic block against the model.

    Raises:
        RecipeError: naming the file that set the first offending key.
    """
    _check_launcher(recipe)
    _check_blocks(recipe)
    _check_owned_flags(recipe)
    _check_model(recipe)
    _check_elastic(recipe)
    _check_placeholders(recipe)
    if recipe.launcher == "torchtitan":
        _check_torchtitan(recipe)


def _check_launcher(recipe: Recipe) -> None:
    data = recipe.data
    launcher = data.get("launcher")
    if launcher is None:
        raise RecipeError(
            f"{display_path(recipe.path)}: no 'launcher' after merging its extends chain; this file is an overlay. "
            f"Launch a recipe that extends it (e.g. configs/<setting>/<schedule>.yaml)."
        )
    if launcher not in LAUNCHERS:
        raise RecipeError(f"{recipe.file_of('launcher')}: launcher={launcher!r} is not one of {LAUNCHERS}.")
    check_type(recipe.file_of("setting"), "setting", data.get("setting"), STR)
    if "script" in data and launcher != "megatron_lm":
        raise RecipeError(f"{recipe.file_of('script')}: 'script' is only used by launcher megatron_lm.")
    if launcher == "megatron_lm":
        check_type(recipe.file_of("script"), "script", data.get("script"), STR)


def _check_blocks(recipe: Recipe) -> None:
    """Every SCHEMA block present (``cluster`` may be left out) with its keys typed right."""
    data = recipe.data
    where = display_path(recipe.path)
    for block, keys in SCHEMA.items():
        values = data.get(block)
        if block == "cluster" and values is None:
            continue
        if not isinstance(values, dict):
            raise RecipeError(f"{where}: missing block '{block}:' (keys: {', '.join(keys)}).")
        for key, tag in keys.items():
            if key not in values:
                if (block, key) in OPTIONAL_KEYS or block == "cluster":
                    continue
                raise RecipeError(f"{where}: missing key {block}.{key} ({tag}); set it in the setting's base.yaml.")
            check_type(recipe.file_of(block, key), f"{block}.{key}", values[key], tag)
    for block in ("args", "env"):
        if data.get(block) is not None and not isinstance(data[block], dict):
            raise RecipeError(f"{recipe.file_of(block)}: '{block}' must be a mapping.")


def _check_owned_flags(recipe: Recipe) -> None:
    owned = OWNED_FLAGS[recipe.launcher]
    normal = {_norm(flag): (flag, owner) for flag, owner in owned.items()}
    args = recipe.data.get("args") or {}
    for key in flat_flags(args) if recipe.launcher == "torchtitan" else args:
        hit = normal.get(_norm(str(key)))
        if hit:
            raise RecipeError(
                f"{recipe.file_of('args', *str(key).split('.'))}: args.{key} is rendered from {hit[1]}; set it there, "
                f"not in args (the launcher checks and renders it)."
            )


def _norm(flag: str) -> str:
    """A flag compared with every spelling: no leading dashes, dashes as underscores."""
    return flag.lstrip("-").replace("-", "_")


def _check_model(recipe: Recipe) -> None:
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
    if recipe.launcher == "swift_sft":
        bad = {k: v for k, v in recipe.parallel.items() if v != 1}
        if bad:
            raise RecipeError(
                f"{recipe.file_of('parallel')}: launcher swift_sft (transformers + DeepSpeed/FSDP) is pure data "
                f"parallel; parallel.{', parallel.'.join(bad)} must be 1 (use megatron_sft for TP/PP/EP)."
            )


def _check_elastic(recipe: Recipe) -> None:
    """The ``elastic:`` block builds an ElasticConfig that resolves against the model (schedule
    centred on the training top-k, layers inside the model)."""
    model = recipe.model
    elastic = _elastic_config(recipe)
    try:
        elastic.resolve(num_experts=model.num_experts, topk=model.training_topk, num_layers=model.num_layers)
    except ConfigError as error:
        key = error.field or "schedule"
        raise RecipeError(
            f"{recipe.file_of('elastic', key)}: {error} (model {model.name}: {model.num_layers} layers, "
            f"{model.num_experts} experts, training top-{model.training_topk})",
            field=key,
            fixes=error.fixes,
        ) from None


def _elastic_config(recipe: Recipe) -> ElasticConfig:
    """The recipe's ``elastic:`` block as an ElasticConfig; messages spell settings as the block's
    keys (``elastic.schedule: 6-10``) and name the file that set the key."""
    values = recipe.data.get("elastic") or {}
    try:
        return ElasticConfig.from_dict(values, source="elastic", spelling=Spelling("yaml", prefix="elastic."))
    except ConfigError as error:
        message = str(error).removeprefix("elastic: ")
        key = error.field
        file = recipe.file_of("elastic", key) if key else recipe.file_of("elastic")
        raise RecipeError(f"{file}: {message}", field=key, fixes=error.fixes) from None


def _check_torchtitan(recipe: Recipe) -> None:
    """What torchtitan and its door need of a recipe: FSDP with expert parallelism (no TP, PP or
    ETP), and, for a model of :mod:`.titan_models`, a ``model:`` block equal to ``args.config``'s."""
    from elastic_moe_plugin.tools.recipes import titan_models

    p = recipe.parallel
    refused = {"tp": "the door refuses tensor parallelism", "pp": "the door refuses pipeline parallelism",
               "etp": "torchtitan 0.3 has no expert tensor parallelism"}  # fmt: skip
    for key, why in refused.items():
        if p[key] != 1:
            raise RecipeError(
                f"{recipe.file_of('parallel', key)}: parallel.{key}={p[key]}: {why} (docs/torchtitan.md); set "
                f"parallel.{key}: 1 (FSDP over the ranks, with parallel.ep inside them)."
            )
    args = recipe.data.get("args") or {}
    for key in ("module", "config"):
        check_type(recipe.file_of("args", key), f"args.{key}", args.get(key), STR)
    if args["module"] != titan_models.MODULE:
        return  # a model module of the user's own: torchtitan checks it at start-up
    where = recipe.file_of("args", "config")
    if args["config"] not in titan_models.CONFIGS:
        raise RecipeError(
            f"{where}: args.config={args['config']!r} is no config of {titan_models.MODULE}; its configs: "
            f"{', '.join(titan_models.CONFIGS)}."
        )
    variant = titan_models.CONFIGS[args["config"]]
    model = recipe.data["model"]
    for key, value in variant.facts.items():
        if model.get(key) == value:
            continue
        fix = None
        if key == "train_topk":  # another top-k variant of the same model
            wanted = titan_models.TitanModel(variant.architecture, model.get(key), variant.expert_bias)
            fix = titan_models.config_name(wanted)
        hint = f"set args.config: {fix}" if fix else f"set model.{key}: {value!r} (or register a config there)"
        raise RecipeError(
            f"{recipe.file_of('model', key)}: model.{key}={model.get(key)!r}, but args.config {args['config']} "
            f"({where}) builds {key}={value!r}: torchtitan takes the model from {titan_models.MODULE}, not from "
            f"the model: block; {hint}."
        )
    if recipe.elastic.enabled and recipe.elastic.mode == "top_p" and variant.expert_bias:
        unbiased = titan_models.config_name(titan_models.TitanModel(variant.architecture, variant.train_topk, False))
        raise RecipeError(
            f"{recipe.file_of('elastic', 'mode')}: elastic.mode: top_p ranks by the softmax probability alone, and the "
            f"door refuses a router that ranks by p plus the aux-loss-free expert bias of args.config "
            f"{args['config']} ({where}); set args.config: {unbiased}."
        )


def _check_placeholders(recipe: Recipe) -> None:
    """Every ``${...}`` in ``args``, ``env`` and ``script`` names a known placeholder, so a
    misspelt one fails at load rather than at launch."""
    data = recipe.data
    for block in ("args", "env"):
        for key, value in (data.get(block) or {}).items():
            recipe.interpolate(value, f"{block}.{key}")
    if "script" in data:
        recipe.interpolate(data["script"], "script")
