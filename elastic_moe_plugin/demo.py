"""``elastic-moe demo``: placeholder until the CPU training demo lands (prints the schedules)."""

from __future__ import annotations

import argparse


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a run of under a minute")


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.schedule import BudgetSchedule
    from elastic_moe_plugin.schedule_report import format_summary, schedule_summary

    for spec in ("static", "7-9", "6-10", "5-11"):
        print(format_summary(schedule_summary(BudgetSchedule.parse(spec, 8), 12)))
        print()
    return 0
