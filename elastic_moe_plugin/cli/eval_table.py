"""``elastic-moe eval-table``: merge eval summaries into one table (docs/evaluation.md).

Parses and wires only; :mod:`elastic_moe_plugin.tools.eval.table` is imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
import sys


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="eval output folders (or their summary.json)")
    parser.add_argument(
        "--baseline", default=None, metavar="NAME", help="run to take deltas against (default: the first)"
    )
    parser.add_argument("--out", default=None, metavar="FILE", help="also write FILE.md and FILE.csv")


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.eval.errors import EvaluationError
    from elastic_moe_plugin.tools.eval.table import load_summary, merge, to_markdown, write_table

    try:
        table = merge([load_summary(path) for path in args.runs], baseline=args.baseline)
    except EvaluationError as error:
        print(f"elastic-moe {args.command}: error: {error}", file=sys.stderr)
        return 2
    print(to_markdown(table), end="")
    if args.out:
        md, csv_path = write_table(table, args.out)
        print(f"wrote {md} and {csv_path}")
    return 0
