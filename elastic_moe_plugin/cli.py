"""``elastic-moe``: the command-line entry point. Parses, calls a library function, prints.

``schedule`` lives here; every other subcommand is a module listed in :data:`SUBCOMMANDS` that
provides ``configure_parser(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence

from elastic_moe_plugin import __version__

#: subcommand -> (module with ``configure_parser(parser)`` and ``run(args) -> int``, help, description)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "gates": (
        "elastic_moe_plugin.gates.lab",
        "gate-convention lab: losses, selections and router gradients per convention",
        "Compare top-k gate conventions on identical logits and experts (seed 000).",
    ),
    "plugin-path": (
        "elastic_moe_plugin.plugin_path",
        "print the ms-swift plugin file (for --external_plugins)",
        "Print the path of the installed ms-swift plugin file: swift sft ... --external_plugins \"$(elastic-moe plugin-path)\".",
    ),
    "bench": (
        "elastic_moe_plugin.bench",
        "benchmark elastic against stock Megatron: router, MoE layer, training step",
        "Time forward+backward of stock, elastic iid and elastic balanced routing, interleaved in one process; "
        "report median ratios, peak memory, device-to-host syncs and dispatched pairs.",
    ),
    "demo": (
        "elastic_moe_plugin.demo",
        "train static and elastic Megatron MoE models on CPU and compare them",
        "Train a tiny Megatron-core MoE GPT twice (static top-k and elastic) on a generated corpus, on CPU, "
        "and print a side-by-side summary.",
    ),
    "eval": (
        "elastic_moe_plugin.evaluation",
        "evaluate a MoE checkpoint on the paper's suites (Avg(9), pretraining) through lm-eval",
        "Run an evaluation suite (avg9, pretrain11 or a suite YAML) through lm-evaluation-harness, "
        "optionally with an inference-time routing top-k, and write raw results plus a summary row.",
    ),
    "eval-table": (
        "elastic_moe_plugin.evaluation_table",
        "merge eval summaries into a Table-1-style comparison (markdown + CSV)",
        "Merge the summaries of several `elastic-moe eval` runs into one table, with deltas against a "
        "baseline run.",
    ),
    "recipes": (
        "elastic_moe_plugin.recipes",
        "list the training recipes in configs/, or print one fully merged",
        "List the recipes that reproduce the paper's three settings (configs/<setting>/*.yaml), or print "
        "one recipe with its extends chain merged.",
    ),
    "launch": (
        "elastic_moe_plugin.launch",
        "launch a recipe on this node (swift sft / megatron sft / torchrun pretrain_gpt.py), or --dry-run",
        "Render a recipe's exact launch command with its ELASTIC_MOE_* environment for this node and run it. "
        "Run once per node; reads SLURM or NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT when flags are not given.",
    ),
    "diagnose": (
        "elastic_moe_plugin.diagnostics",
        "routing diagnostics of checkpoints: router divergence, D1/Dk, top-k sweep, router swap, κ plots",
        "Offline routing analysis (paper §6): `compare` streams a probe set through checkpoints and writes per-layer "
        "router divergence (boundary / non-boundary), D1 and Dk, expert prioritisation near the cutoff and an "
        "inference top-k sweep with plots; `swap` writes a router-swapped checkpoint; `kappa` plots κ histograms "
        "against the schedule's pmf.",
    ),
    "budget": (
        "elastic_moe_plugin.budget",
        "parameters, FLOPs per token, compute and experts per token of a recipe",
        "Print a recipe's total and active parameters, M (FLOPs per token), D, C = M*D against the paper's "
        "6e19, and the expected and worst-case experts per token of every schedule of its setting.",
    ),
}
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

    for name, (module_name, help_text, description) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=help_text, description=description)
        module.configure_parser(sub)
        sub.set_defaults(handler=module.run)
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
