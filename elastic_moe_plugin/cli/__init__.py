"""``elastic-moe``: the command-line entry point, a table of thin subcommand modules.

Each subcommand is a module ``elastic_moe_plugin.cli.<name>`` with ``configure_parser(parser)``
and ``run(args) -> int``: it parses and wires, and imports the library or tool it calls only
inside ``run``. :func:`main` imports the one module of the command being run; ``elastic-moe
--help`` imports none.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

from elastic_moe_plugin import __version__
from elastic_moe_plugin.core.errors import ConfigError


class Command(NamedTuple):
    module: str
    help: str
    description: str


#: subcommand -> its module (``configure_parser`` and ``run``), one-line help, description
COMMANDS: dict[str, Command] = {
    "schedule": Command(
        "elastic_moe_plugin.cli.schedule",
        "print a budget schedule: pmf, survival per rank, mean, E|k-center|",
        "Print the discretised-Gaussian budget schedule q(r) ∝ exp(-(r-center)^2/(2 sigma^2)) on {low..high}.",
    ),
    "gates": Command(
        "elastic_moe_plugin.cli.gates",
        "gate-convention lab: losses, selections and router gradients per convention",
        "Compare top-k gate conventions on identical logits and experts (docs/gates.md).",
    ),
    "plugin-path": Command(
        "elastic_moe_plugin.cli.plugin_path",
        "print the ms-swift plugin file (for --external_plugins, the fallback of --plugin elastic_moe)",
        "Print the path of the installed ms-swift plugin file: "
        'swift sft ... --external_plugins "$(elastic-moe plugin-path)" '
        "--callbacks elastic_moe, the fallback of swift sft ... --plugin elastic_moe (docs/swift.md).",
    ),
    "bench": Command(
        "elastic_moe_plugin.cli.bench",
        "every measurement of the package, one mode each (--only MODE; elastic-moe bench --help lists them)",
        "Measure elastic routing against stock, one mode at a time (--only MODE ...; the modes are listed below). "
        "router, routing, layer, gpt and hf time forward+backward of stock, elastic iid and elastic balanced "
        "routing, interleaved in one process, and report median ratios, peak memory, device-to-host syncs and "
        "dispatched pairs; e2e trains with swift sft, megatron sft and Megatron-LM's trainer, static against "
        "elastic, and reports steps/s, their ratio, peak RSS, host syncs per step and the realised mean κ. "
        "--json prints one report, in one schema, for every mode.",
    ),
    "demo": Command(
        "elastic_moe_plugin.cli.demo",
        "train static and elastic Megatron MoE models on CPU and compare them",
        "Train a tiny Megatron-core MoE GPT twice (static top-k and elastic) on a generated corpus, on CPU, "
        "and print a side-by-side summary.",
    ),
    "compare": Command(
        "elastic_moe_plugin.cli.compare",
        "a paired multi-seed static-vs-elastic study of the demo model, with 95% intervals",
        "Train static and elastic arms of the demo's tiny Megatron-core GPT for N seeds (same seed, data order and "
        "initialisation per pair; on the CPU or one CUDA GPU), and report the paired differences elastic - static "
        "with paired-t and bootstrap 95% intervals, saying plainly where an interval contains 0, the router "
        "measures of each pair (D1, Dk) and plots. Resumes an interrupted study. --from-eval reads a cluster "
        "study from the recipes' elastic-moe eval summaries instead.",
    ),
    "eval": Command(
        "elastic_moe_plugin.cli.eval",
        "evaluate a MoE checkpoint on the paper's suites (Avg(9), pretraining) through lm-eval",
        "Run an evaluation suite (avg9, pretrain11 or a suite YAML) through lm-evaluation-harness, "
        "optionally with an inference-time routing top-k, and write raw results plus a summary row.",
    ),
    "eval-table": Command(
        "elastic_moe_plugin.cli.eval_table",
        "merge eval summaries into a Table-1-style comparison (markdown + CSV)",
        "Merge the summaries of several `elastic-moe eval` runs into one table, with deltas against a baseline run.",
    ),
    "recipes": Command(
        "elastic_moe_plugin.cli.recipes",
        "list the training recipes, or print one fully merged",
        "List the recipes that reproduce the paper's three settings (<setting>/*.yaml under configs/), or print "
        "one recipe with its extends chain merged.",
    ),
    "launch": Command(
        "elastic_moe_plugin.cli.launch",
        "launch a recipe on this node (swift sft / megatron sft / torchrun pretrain_gpt.py), --dry-run, or --list",
        "Render a recipe's exact launch command with its ELASTIC_MOE_* environment for this node and run it. "
        "Run once per node; reads SLURM or NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT when flags are not given.",
    ),
    "diagnose": Command(
        "elastic_moe_plugin.cli.diagnose",
        "routing diagnostics of checkpoints: router divergence, D1/Dk, top-k sweep, router swap, κ plots",
        "Offline routing analysis (paper §6): `compare` streams a probe set through checkpoints and writes per-layer "
        "router divergence (boundary / non-boundary), D1 and Dk, expert prioritisation near the cutoff and an "
        "inference top-k sweep with plots; `swap` writes a router-swapped checkpoint; `kappa` plots κ histograms "
        "against the schedule's pmf.",
    ),
    "budget": Command(
        "elastic_moe_plugin.cli.budget",
        "parameters, FLOPs per token, compute and experts per token of a recipe",
        "Print a recipe's total and active parameters, M (FLOPs per token), D, C = M*D against the paper's "
        "6e19, and the expected and worst-case experts per token of every schedule of its setting.",
    ),
}


def _requested_command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is one), or None."""
    return next((word for word in argv if word in COMMANDS), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``elastic-moe`` parser. Only the subcommand named in ``argv`` gets its flags configured
    (its module is imported); with ``argv=None`` every subcommand is configured."""
    parser = argparse.ArgumentParser(
        prog="elastic-moe",
        description="Elastic Expert Routing for Megatron-core, transformers and ms-swift.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    requested = _requested_command(argv) if argv is not None else None
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.description)
        if argv is None or name == requested:
            module = importlib.import_module(command.module)
            module.configure_parser(sub)
            sub.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, ValueError) as error:
        print(f"elastic-moe {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `elastic-moe ... | head` closed stdout early: not an error of the command. Point stdout
        # at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
