"""``elastic-moe recipes``: list or print the training recipes, or check their rendered flags
with the frameworks' parsers (docs/recipes.md)."""

from __future__ import annotations

import argparse
import json


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None, help="print this recipe fully merged (path or setting/name)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--check-args",
        action="store_true",
        help="check every recipe's (or RECIPE's) rendered flags with ms-swift's and Megatron-LM's own "
        "argument parsers (python -m elastic_moe_plugin.tools.recipes.argcheck)",
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "check_args", False):
        from elastic_moe_plugin.tools.recipes.argcheck import run_checks

        return run_checks([args.recipe] if args.recipe else [], as_json=args.json)
    if args.recipe:
        return _print_recipe(args.recipe, as_json=args.json)
    return _print_list(as_json=args.json)


def _print_recipe(name: str, *, as_json: bool) -> int:
    from elastic_moe_plugin.tools.recipes.load import load_recipe
    from elastic_moe_plugin.tools.recipes.recipe import display_path

    recipe = load_recipe(name)
    if as_json:
        print(json.dumps(recipe.data, indent=2, default=str))
    else:
        import yaml

        print(f"# {display_path(recipe.path)} merged (extends resolved)")
        print(yaml.safe_dump(recipe.data, sort_keys=False).rstrip())
    return 0


def _print_list(*, as_json: bool) -> int:
    from elastic_moe_plugin.tools.recipes.load import list_recipes

    rows = list_recipes()
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max((len(r["name"]) for r in rows), default=4)
    for row in rows:
        print(f"{row['name']:<{width}}  {row['launcher']:<12}  {row['description']}")
    return 0
