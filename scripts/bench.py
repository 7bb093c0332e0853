"""Thin wrapper: ``python scripts/bench.py [--quick] [--json]`` == ``elastic-moe bench ...``."""

import sys

from elastic_moe_plugin.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
