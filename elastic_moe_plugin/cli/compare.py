"""``elastic-moe compare``: a paired multi-seed study of the demo model (:mod:`elastic_moe_plugin.tools.compare`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.errors import ConfigError

#: --quick: 2 seeds of the demo's quick settings, static against 2-6 (what CI runs)
QUICK_SEEDS, QUICK_ARMS = 2, "static,2-6"
#: --scale 4: a model about 4x the demo's parameters (hidden and expert width doubled)
SCALES: dict[int, dict[str, Any]] = {1: {}, 4: {"hidden_size": 128, "expert_ffn_hidden_size": 128}}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arms", default="static,2-6,3-5", help="static first, then schedules (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1 per arm (default: %(default)s)")
    parser.add_argument("--scale", type=int, choices=sorted(SCALES), default=1, help="model size x the demo's")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: the demo's)")
    parser.add_argument("--out", default="compare_out", help="folder of results.json (resumed if present)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SEEDS} seeds, {QUICK_ARMS}, the demo's --quick")
    parser.add_argument("--json", action="store_true", help="print the comparisons as JSON instead of the table")


def plan_from_args(args: argparse.Namespace):
    from elastic_moe_plugin.tools.compare.study import StudyPlan
    from elastic_moe_plugin.tools.demo.settings import QUICK, DemoSettings

    values: dict[str, Any] = {**SCALES[args.scale], **(QUICK if args.quick else {})}
    settings = DemoSettings(**values)
    if args.steps is not None:
        if args.steps < 1:
            raise ConfigError(f"--steps={args.steps} is invalid: expected at least 1.")
        settings = dataclasses.replace(settings, steps=args.steps)
    seeds = QUICK_SEEDS if args.quick else args.seeds
    if seeds < 2:
        raise ConfigError(f"--seeds={seeds}: an interval needs at least 2 seeds; use --seeds 8.")
    arms = QUICK_ARMS if args.quick else args.arms
    return StudyPlan(tuple(arm.strip() for arm in arms.split(",") if arm.strip()), tuple(range(seeds)), settings)


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.compare import report
    from elastic_moe_plugin.tools.compare.study import run_study, save_results

    plan = plan_from_args(args)
    out = Path(args.out)
    data = run_study(plan, out)
    data["comparisons"] = report.comparisons(data)
    save_results(out / "results.json", data)
    print(json.dumps(data["comparisons"], indent=1) if args.json else report.format_table(data, data["comparisons"]))
    return 0
