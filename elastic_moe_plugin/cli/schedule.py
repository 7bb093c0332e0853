"""``elastic-moe schedule``: print a budget schedule (pmf, survival per rank, moments), or plot it.

The spec, ``--sigma`` and ``--allow-off-center`` go through :class:`~elastic_moe_plugin.core.config.ElasticConfig`
(the rules every entry point shares) against a model routing to top-``--center`` of ``--experts``, so
a refused schedule names this command's own arguments and a fix that is accepted.
"""

from __future__ import annotations

import argparse
import json


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is invalid: expected an integer >= 1")
    return number


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "spec",
        nargs="?",
        default=None,
        help="'LOW-HIGH' (e.g. 6-10), 'static', the center itself, or 'auto' (the default: "
        "k-2..k+2 around --center, kept symmetric and within --experts)",
    )
    parser.add_argument("--center", type=_positive, default=8, help="the model's top-k (default: 8)")
    parser.add_argument("--sigma", default=None, metavar="SIGMA", help="Gaussian width (default: 1.5)")
    parser.add_argument("--experts", type=_positive, default=None, help="also check the schedule against E experts")
    parser.add_argument("--ranks", type=int, default=None, help="survival rows to print (default: high + 2)")
    parser.add_argument(
        "--allow-off-center", action="store_true", help="accept a schedule whose mean is not the center"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="PNG", default=None, help="write the pmf and exposure curve to a PNG")


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.core.config import ElasticConfig, ModelShape, Spelling
    from elastic_moe_plugin.tools.schedule_report import format_summary, plot_schedule, schedule_summary

    values: dict = {}
    if args.spec is not None:
        values["schedule"] = args.spec
    if args.sigma is not None:
        values["sigma"] = args.sigma
    if args.allow_off_center:
        values["allow_off_center"] = True
    model = ModelShape(args.center, args.experts)
    config = ElasticConfig.from_dict(values, source="", spelling=Spelling("schedule_cli"), model=model)
    schedule = config.resolve(num_experts=args.experts, topk=args.center)
    summary = schedule_summary(schedule, args.ranks)
    summary["resolved_from_model"] = config.schedule_from_model
    if args.plot:
        summary["plot"] = str(plot_schedule(schedule, args.plot))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0
