"""Load recipes: find a file by path or built-in name, read it, merge its ``extends`` chain,
apply ``--set KEY=VALUE`` overrides, validate the result; and list the built-in recipes.

Merging: parents load in order, then the file itself; mappings merge recursively, anything else
replaces; every file's keys are checked where they are written (docs/recipes.md, "Recipe format").
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.tools.recipes.recipe import CONFIGS_DIR, Recipe, display_path
from elastic_moe_plugin.tools.recipes.schema import (
    MAPPING_BLOCKS,
    SCHEMA,
    TOP_LEVEL_KEYS,
    RecipeError,
    unknown_key_error,
)
from elastic_moe_plugin.tools.recipes.validate import validate

_READ_CACHE: dict[tuple[Path, int, int], Any] = {}


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
    """The recipe file ``path`` names: an existing file, or a built-in name (``olmoe_sft/6-10``,
    ``olmoe_sft/6-10.yaml``, or ``configs/olmoe_sft/6-10.yaml`` as messages show it)."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate.resolve()
    guesses = [CONFIGS_DIR / candidate, CONFIGS_DIR / f"{candidate}.yaml"]
    if candidate.parts[:1] == (CONFIGS_DIR.name,) and len(candidate.parts) > 1:
        guesses.append(CONFIGS_DIR / Path(*candidate.parts[1:]))
    for guess in guesses:
        if guess.is_file():
            return guess.resolve()
    names = ", ".join(sorted(name for name, _ in list_recipe_files())) or "(no configs/ folder found)"
    raise RecipeError(
        f"recipe {str(path)!r} does not exist (as a path or under {display_path(CONFIGS_DIR)}/). Recipes: {names}."
    )


# ================================================================================== reading and merging
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
            _READ_CACHE[key] = yaml.load(path.read_text(), Loader=loader)
        except yaml.YAMLError as error:
            raise RecipeError(f"{path}: not valid YAML: {error}") from None
    data = copy.deepcopy(_READ_CACHE[key])
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of recipe keys, got {type(data).__name__}.")
    return data


def _check_file_keys(file: Path, data: Mapping[str, Any]) -> None:
    """Structural check of one file's own keys, so errors name the file that wrote them."""
    for key, value in data.items():
        if key not in TOP_LEVEL_KEYS:
            raise unknown_key_error(file, "", key, TOP_LEVEL_KEYS)
        if key in SCHEMA or key in MAPPING_BLOCKS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise RecipeError(f"{file}: '{key}' must be a mapping, got {type(value).__name__}.")
            known = SCHEMA[key] if key in SCHEMA else ElasticConfig.field_names() if key == "elastic" else None
            if known is not None:
                for sub in value:
                    if sub not in known:
                        raise unknown_key_error(file, key, sub, known)
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
    """``path`` merged over its ``extends`` chain: ``(data, origin)``, origin mapping every key
    path to the file that set it. ``stack`` holds the files including this one (cycle check)."""
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(str(p) for p in stack + (path,))
        raise RecipeError(f"{stack[-1]}: 'extends' forms a cycle: {chain}.")
    data = _read(path)
    _check_file_keys(path, data)
    merged: dict = {}
    origin: dict = {}
    for parent in _parents(path, data):
        parent_path = path.parent / parent
        if not parent_path.is_file():
            raise RecipeError(f"{path}: extends {parent!r}, but {parent_path} does not exist.")
        parent_data, parent_origin = _load_tree(parent_path, stack + (path,))
        _merge(merged, origin, parent_data, parent_origin)
    own = {k: v for k, v in data.items() if k != "extends"}
    _merge(merged, origin, own, _paths(own, str(path)))
    return merged, origin


def load_tree(path: str | os.PathLike[str]) -> tuple[dict, dict]:
    """A recipe or overlay file merged over its ``extends`` chain, not yet validated as a recipe:
    ``(data, origin)``, origin mapping every key path (a tuple) to the file that set it."""
    return _load_tree(Path(path), ())


def _parents(path: Path, data: Mapping[str, Any]) -> list[str]:
    """The file names ``data``'s ``extends`` lists (one name may stand alone)."""
    parents = data.get("extends") or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise RecipeError(f"{path}: 'extends' must be a file name or a list of file names, got {parents!r}.")
    return parents


def _apply_override(data: dict, origin: dict, item: str) -> None:
    """Apply one ``--set KEY=VALUE`` (VALUE parsed as YAML) to the merged ``data``; its origin
    becomes ``--set``."""
    import yaml

    if "=" not in item:
        raise RecipeError(
            f"--set {item!r}: expected KEY=VALUE, e.g. args.learning_rate=1.0e-5 or elastic.schedule=7-9."
        )
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    value = yaml.safe_load(text) if text.strip() else None
    top = parts[0]
    if top not in TOP_LEVEL_KEYS or top == "extends":
        raise unknown_key_error("--set", "", top, [k for k in TOP_LEVEL_KEYS if k != "extends"])
    if len(parts) == 2 and (top in SCHEMA or top == "elastic"):
        known = SCHEMA[top] if top in SCHEMA else ElasticConfig.field_names()
        if parts[1] not in known:
            raise unknown_key_error("--set", top, parts[1], known)
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"--set {item!r}: {part!r} is not a mapping.")
    node[parts[-1]] = value
    for stale in [p for p in origin if p[: len(parts)] == tuple(parts)]:
        del origin[stale]
    origin.update(_paths({parts[-1]: value}, "--set", tuple(parts[:-1])))


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


def list_recipes(root: Path | None = None) -> list[dict[str, str]]:
    """One row per launchable recipe, each loaded (so validated): name, path (as messages show
    it), launcher and description."""
    rows = []
    for name, path in list_recipe_files(root):
        recipe = load_recipe(path)
        rows.append(
            {"name": name, "path": display_path(path), "launcher": recipe.launcher, "description": recipe.description}
        )
    return rows
