"""``elastic-moe recipes``: list or print the training recipes (docs/recipes.md)."""

from __future__ import annotations

import argparse
import importlib

_TOOL = "elastic_moe_plugin.tools.recipes.load"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    importlib.import_module(_TOOL).configure_parser(parser)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(_TOOL).run(args)
