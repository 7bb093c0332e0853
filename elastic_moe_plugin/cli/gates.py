"""``elastic-moe gates``: the gate-convention lab (docs/gates.md)."""

from __future__ import annotations

import argparse
import importlib

_TOOL = "elastic_moe_plugin.tools.gates_lab"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    importlib.import_module(_TOOL).configure_parser(parser)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(_TOOL).run(args)
