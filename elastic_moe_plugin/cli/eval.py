"""``elastic-moe eval``: the paper's evaluation suites through lm-evaluation-harness (docs/evaluation.md)."""

from __future__ import annotations

import argparse
import importlib

_TOOL = "elastic_moe_plugin.tools.eval"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    importlib.import_module(_TOOL).configure_parser(parser)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(_TOOL).run(args)
