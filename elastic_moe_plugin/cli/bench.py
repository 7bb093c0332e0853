"""``elastic-moe bench``: every measurement of the package, one mode each (``--only``), one JSON
format (``--json``; ``elastic_moe_plugin.tools.bench.schema``; docs/performance.md). The modes and
their descriptions are ``elastic_moe_plugin.tools.bench.MODES``; ``--help`` lists them."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import textwrap
from pathlib import Path


def _epilog() -> str:
    from elastic_moe_plugin.tools.bench import DEFAULT_MODES, MODES

    lines = ["modes (--only; without it: " + ", ".join(DEFAULT_MODES) + "):"]
    for name, what in MODES.items():
        lines += textwrap.wrap(
            what, width=96, initial_indent=f"  {name:14s}", subsequent_indent=" " * 16, break_on_hyphens=False
        )
    lines.append("")
    lines += textwrap.wrap(
        "--json prints one report for every mode: {schema, schema_version, quick, modes, ok, environment, rows}, "
        "each row {mode, scenario, shape, variant, baseline, params, metrics, ratios} "
        "(elastic_moe_plugin.tools.bench.schema). Exit status 1 when a check of mcore-cuda fails.",
        width=110,
    )
    return "\n".join(lines)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    # the bench's package and its e2e module import no framework: --help stays fast
    from elastic_moe_plugin.tools.bench import DEFAULT_MODES, MODES
    from elastic_moe_plugin.tools.bench.e2e import LAUNCHERS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _epilog()
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small shapes, a few seconds per mode (what CI runs); e2e: 1 round of 4 steps, the two runs of "
        "a launcher side by side (times say nothing); mcore-cuda: tiny shapes; hook-cost: 3 runs",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the tables")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(MODES),
        default=None,
        metavar="MODE",
        help="run only these modes (below; default: " + " ".join(DEFAULT_MODES) + ")",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument(
        "--no-aux",
        action="store_true",
        help="router, routing, layer, gpt: Megatron's routers without the aux loss (default: aux_loss 0.01, "
        "whose second top-k map stock builds and elastic routing does not)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="e2e: rounds per launcher, each one static and one elastic run in alternating order, or one "
        "interleaved run (default 3; --quick: 1); mcore-cuda: timing rounds (default 10; 2 with --quick or "
        "without CUDA); log-metrics: "
        "rounds (default 60; --quick: 5); hook-cost: runs of each variant (default 20)",
    )
    e2e = parser.add_argument_group("e2e and swift-profile")
    e2e.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per run (e2e default: swift sft 20; megatron sft, Megatron-LM and torchtitan 91 "
        "interleaved, the warm-up then 16 blocks of 5 (megatron sft, torchtitan) or 8 of 10 (Megatron-LM) and "
        "one step, or 60 with --separate-runs; --quick: 4, interleaved 7; swift-profile: 8, --quick 4)",
    )
    e2e.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps left out of the steady-state rate (default: swift sft 4, the others 10; --quick: 2)",
    )
    e2e.add_argument(
        "--launchers",
        nargs="+",
        choices=LAUNCHERS,
        default=list(LAUNCHERS),
        help="which launchers (default: all five; torchtitan's row only where torchtitan is importable)",
    )
    e2e.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="swift sft's hidden size H, its experts' width too (default 256; e.g. 768)",
    )
    e2e.add_argument(
        "--experts-impl",
        default=None,
        help="swift sft's --experts_impl (default: transformers' own, grouped_mm)",
    )
    e2e.add_argument(
        "--separate-runs",
        action="store_true",
        help="megatron sft, Megatron-LM and torchtitan too in one static and one elastic run per round, as "
        "swift sft runs (separate peak RSS; default: one run per round that switches between static and "
        "elastic blocks of 5 or 10 steps, timed in the one process)",
    )
    e2e.add_argument(
        "--profile",
        default=None,
        metavar="FIRST:COUNT",
        help="swift-profile: profile steps FIRST+1 to FIRST+COUNT (default 4:3; --quick: 2:1)",
    )
    e2e.add_argument(
        "--work",
        type=Path,
        default=None,
        help="folder for the tiny models and the runs' logs (default: a new temporary folder); one that "
        "holds an earlier bench's runs is refused",
    )


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools import bench
    from elastic_moe_plugin.tools.bench.e2e import DEFAULT_ROUNDS, E2EOptions

    options = bench.BenchOptions(
        aux=not args.no_aux,
        rounds=args.rounds,
        profile=args.profile,
        e2e=E2EOptions(
            rounds=args.rounds or DEFAULT_ROUNDS,
            steps=args.steps,
            warmup=args.warmup,
            launchers=tuple(args.launchers),
            hidden=args.hidden,
            work=args.work,
            separate=args.separate_runs,
            experts_impl=args.experts_impl,
        ),
    )
    bench.check_options(args.only, options, args.quick)  # bad options fail before anything runs, with status 2
    # --json promises machine-readable stdout; the frameworks' import-time warnings go to stderr, muted
    with contextlib.redirect_stderr(open(os.devnull, "w")) if args.json else contextlib.nullcontext():
        sections = bench.run_suite(args.quick, args.threads, args.only, options)
    result = bench.to_json(sections, args.quick, args.threads)
    print(json.dumps(result, indent=2) if args.json else bench.format_results(sections))
    return 0 if result["ok"] else 1
