"""``elastic-moe``: the command-line entry point. Parses, calls a library function, prints.

Subcommands:
    schedule   print a budget schedule's pmf, survival curve and statistics
    gates      the gate-convention lab (seed 000): compare conventions and their router gradients
    demo       the main job on an embedded default
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from elastic_moe_plugin import __version__
from elastic_moe_plugin.config import ConfigError
from elastic_moe_plugin.schedule import BudgetSchedule


def _cmd_schedule(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.schedule_report import format_summary, plot_schedule, schedule_summary

    schedule = BudgetSchedule.parse(args.spec, args.center, args.sigma, allow_off_center=args.allow_off_center)
    if args.experts is not None:
        schedule.validate_for(args.experts, args.center)
    summary = schedule_summary(schedule, args.ranks)
    if args.plot:
        summary["plot"] = str(plot_schedule(schedule, args.plot))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def _cmd_gates(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.gates import lab

    return lab.run(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.schedule_report import format_summary, schedule_summary

    print("Elastic Expert Routing: the paper's schedules around top-8 (sigma 1.5)\n")
    for spec in ("static", "7-9", "6-10", "5-11"):
        print(format_summary(schedule_summary(BudgetSchedule.parse(spec, 8), 12)))
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-moe",
        description="Elastic Expert Routing for Megatron-core, transformers and ms-swift.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    schedule = commands.add_parser(
        "schedule",
        help="print a budget schedule: pmf, survival per rank, mean, E|k-center|",
        description="Print the discretised-Gaussian budget schedule q(r) ∝ exp(-(r-center)^2/(2 sigma^2)) on {low..high}.",
    )
    schedule.add_argument("spec", help="'LOW-HIGH' (e.g. 6-10), 'static', or the center itself")
    schedule.add_argument("--center", type=int, default=8, help="the model's top-k (default: 8)")
    schedule.add_argument("--sigma", type=float, default=1.5, help="Gaussian width (default: 1.5)")
    schedule.add_argument("--experts", type=int, default=None, help="also check the schedule against E experts")
    schedule.add_argument("--ranks", type=int, default=None, help="survival rows to print (default: high + 2)")
    schedule.add_argument("--allow-off-center", action="store_true", help="accept a schedule whose mean is not the center")
    schedule.add_argument("--json", action="store_true", help="print JSON instead of a table")
    schedule.add_argument("--plot", metavar="PNG", default=None, help="write the pmf and exposure curve to a PNG")
    schedule.set_defaults(handler=_cmd_schedule)

    gates = commands.add_parser(
        "gates",
        help="gate-convention lab: losses, selections and router gradients per convention",
        description="Compare top-k gate conventions on identical logits and experts (seed 000).",
    )
    try:
        from elastic_moe_plugin.gates import lab

        lab.configure_parser(gates)
    except ImportError:  # pragma: no cover - the lab ships with the package
        pass
    gates.set_defaults(handler=_cmd_gates)

    demo = commands.add_parser("demo", help="run the main job on an embedded default")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, ValueError) as error:
        print(f"elastic-moe {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
