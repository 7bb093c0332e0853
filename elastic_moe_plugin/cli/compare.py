"""``elastic-moe compare``: a paired multi-seed static-vs-elastic study (:mod:`elastic_moe_plugin.tools.compare`).

Three ways in, one report: train the demo model's arms x seeds (default; resumable), ``--report``
an existing study's results again, or ``--from-eval ROOT`` to read the recipes' ``elastic-moe eval``
summaries of a cluster study.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.errors import ConfigError

#: --quick: 2 seeds of the demo's quick settings, static against 2-6 (what CI runs)
QUICK_SEEDS, QUICK_ARMS = 2, "static,2-6"
DEFAULT_ARMS = "static,2-6,3-5"
#: --scale N: a model about N x the demo's parameters (0.61M); 100 is sized for one GPU (--device cuda)
SCALES: dict[int, dict[str, Any]] = {
    1: {},
    4: {"hidden_size": 128, "expert_ffn_hidden_size": 128},
    100: {
        "num_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "expert_ffn_hidden_size": 384,
        "batch_size": 128,
        "steps": 1000,
    },
}
DEVICES = ("cpu", "cuda")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", default=None, help=f"static first, then schedules (default: {DEFAULT_ARMS}; "
                        "with --from-eval: the baseline arm first, default: every arm found)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1 per arm (default: %(default)s)")
    parser.add_argument("--scale", type=int, choices=sorted(SCALES), default=1, help="model size x the demo's")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: the demo's)")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where the runs train (default: cpu)")
    parser.add_argument("--out", default="compare_out", help="folder of results.json (resumed if present) and plots")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SEEDS} seeds, {QUICK_ARMS}, the demo's --quick")
    parser.add_argument("--report", action="store_true", help="report --out's results again, training nothing")
    parser.add_argument("--from-eval", metavar="ROOT", default=None,
                        help="read the elastic-moe eval summaries ROOT/<arm>/seed<N>/.../summary.json")  # fmt: skip
    parser.add_argument("--no-routers", action="store_true", help="skip the router measures (D1, Dk) of each seed")
    parser.add_argument("--no-plots", action="store_true", help="write results.json only, no PNG plots")
    parser.add_argument("--json", action="store_true", help="print the comparisons as JSON instead of the table")


def plan_from_args(args: argparse.Namespace):
    from elastic_moe_plugin.tools.compare.study import StudyPlan
    from elastic_moe_plugin.tools.demo.settings import QUICK, DemoSettings

    values: dict[str, Any] = {**SCALES[args.scale], **(QUICK if args.quick else {}), "device": args.device}
    settings = DemoSettings(**values)
    if args.steps is not None:
        if args.steps < 1:
            raise ConfigError(f"--steps={args.steps} is invalid: expected at least 1.")
        settings = dataclasses.replace(settings, steps=args.steps)
    seeds = QUICK_SEEDS if args.quick else args.seeds
    if seeds < 2:
        raise ConfigError(f"--seeds={seeds}: an interval needs at least 2 seeds; use --seeds 8.")
    arms = QUICK_ARMS if args.quick else (args.arms or DEFAULT_ARMS)
    return StudyPlan(_split(arms), tuple(range(seeds)), settings)


def _split(arms: str) -> tuple[str, ...]:
    return tuple(arm.strip() for arm in arms.split(",") if arm.strip())


def load_study(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The study's results: trained (resuming), read again (``--report``) or from evaluations."""
    from elastic_moe_plugin.tools.compare import evals
    from elastic_moe_plugin.tools.compare.study import read_results, run_study

    if args.from_eval is not None and args.report:
        raise ConfigError("--report and --from-eval exclude each other: --from-eval ROOT reads the summaries anew.")
    if args.from_eval is not None:
        root = Path(args.from_eval)
        if not root.is_dir():
            raise ConfigError(f"--from-eval {args.from_eval}: no such folder; expected {evals.LAYOUT}.")
        return evals.study_from_evaluations(root, list(_split(args.arms)) if args.arms else None)
    if args.report:
        return read_results(out / "results.json")
    return run_study(plan_from_args(args), out)


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.compare import report
    from elastic_moe_plugin.tools.compare.study import save_results

    out = Path(args.out)
    data = load_study(args, out)
    if data.get("source", "demo") == "demo" and not args.no_routers:
        if data["plan"]["settings"]["device"] == "cpu" or args.report:
            from elastic_moe_plugin.tools.compare.routers import measure_routers

            measure_routers(data, out)
        else:  # the router pass loads the demo models on the CPU runtime, which a GPU run never loads
            print(f"elastic-moe compare: router measures on the CPU: elastic-moe compare --report --out {out}")
    data["comparisons"] = report.comparisons(data)
    save_results(out / "results.json", data)
    if not args.no_plots:
        _plot(data, out)
    print(json.dumps(data["comparisons"], indent=1) if args.json else report.format_table(data, data["comparisons"]))
    return 0


def _plot(data: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("elastic-moe compare: no plots (matplotlib is not installed: pip install 'elastic-moe-plugin[plot]')")
        return
    from elastic_moe_plugin.tools.compare.plots import plot_all

    for path in plot_all(data, data["comparisons"], out):
        print(f"elastic-moe compare: wrote {path}")
