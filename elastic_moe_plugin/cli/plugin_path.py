"""``elastic-moe plugin-path``: print the ms-swift plugin file of the installed package."""

from __future__ import annotations

import argparse


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        'usage: swift sft ... --external_plugins "$(elastic-moe plugin-path)" --callbacks elastic_moe '
        "(the fallback of swift sft ... --plugin elastic_moe; docs/swift.md)"
    )


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.swift import plugin_path

    print(plugin_path())
    return 0
