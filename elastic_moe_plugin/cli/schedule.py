"""``elastic-moe schedule``: print a budget schedule (pmf, survival per rank, moments), or plot it."""

from __future__ import annotations

import argparse
import json


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", help="'LOW-HIGH' (e.g. 6-10), 'static', or the center itself")
    parser.add_argument("--center", type=int, default=8, help="the model's top-k (default: 8)")
    parser.add_argument("--sigma", type=float, default=1.5, help="Gaussian width (default: 1.5)")
    parser.add_argument("--experts", type=int, default=None, help="also check the schedule against E experts")
    parser.add_argument("--ranks", type=int, default=None, help="survival rows to print (default: high + 2)")
    parser.add_argument("--allow-off-center", action="store_true", help="accept a schedule whose mean is not the center")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="PNG", default=None, help="write the pmf and exposure curve to a PNG")


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.core.schedule import BudgetSchedule
    from elastic_moe_plugin.tools.schedule_report import format_summary, plot_schedule, schedule_summary

    schedule = BudgetSchedule.parse(args.spec, args.center, args.sigma, allow_off_center=args.allow_off_center)
    if args.experts is not None:
        schedule.validate_for(args.experts, args.center)
    summary = schedule_summary(schedule, args.ranks)
    if args.plot:
        summary["plot"] = str(plot_schedule(schedule, args.plot))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0
