"""``elastic-moe budget``: parameters, FLOPs and experts per token of a recipe (docs/recipes.md)."""

from __future__ import annotations

import argparse
import json


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe file, or a name under configs/ such as pretrain/6-10")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.recipes.compute import budget, format_budget
    from elastic_moe_plugin.tools.recipes.load import load_recipe

    report = budget(load_recipe(args.recipe))
    print(json.dumps(report, indent=2) if args.json else format_budget(report))
    return 0
