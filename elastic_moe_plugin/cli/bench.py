"""``elastic-moe bench``: elastic against stock, interleaved in one process, and each launcher end to
end (``--only e2e``; docs/performance.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

SCENARIOS = ("router", "layer", "gpt", "hf", "kappa", "calls", "e2e")  # elastic_moe_plugin.tools.bench.SCENARIOS
# the same as elastic_moe_plugin.tools.bench.e2e.LAUNCHERS (tests/tools/test_bench_e2e.py checks it)
LAUNCHERS = ("swift_sft", "swift_sft_deepseek_v3", "megatron_sft", "megatron_lm")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small shapes, a few seconds per scenario (what CI runs); e2e: 1 round of 4 steps, "
        "the two runs of a launcher side by side (times say nothing)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SCENARIOS,
        default=None,
        help="run only these scenarios (default: all but e2e). router, layer (dropless and "
        "drop-and-pad), gpt: Megatron-core; hf: transformers' OLMoE-, Qwen3-MoE- and DeepSeek-V3-shaped blocks "
        "under every experts implementation; kappa: the κ draw per router call for 1-1024 token "
        "shards, before and after the counter-based stream; calls: one router call per door, stock, "
        "static and elastic, in µs and in package calls; e2e: training steps/s of swift sft (OLMoE and "
        "DeepSeek-V3), megatron sft and Megatron-LM's trainer on tiny models, static against elastic 6-10, "
        "in rounds of child processes (minutes)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    e2e = parser.add_argument_group("e2e (--only e2e)")
    e2e.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds per launcher, each one static and one elastic run in alternating order, "
        "or one interleaved run (default 3; --quick: 1)",
    )
    e2e.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps per run (default: swift sft 20; megatron sft and Megatron-LM 91 interleaved, "
        "the warm-up then 16 blocks of 5 (megatron sft) or 8 of 10 (Megatron-LM) and one step, or "
        "60 with --separate-runs; --quick: 4, "
        "interleaved 7)",
    )
    e2e.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps left out of the steady-state rate (default: 4, 10, 10; --quick: 2)",
    )
    e2e.add_argument(
        "--launchers",
        nargs="+",
        choices=LAUNCHERS,
        default=list(LAUNCHERS),
        help="which launchers (default: all four)",
    )
    e2e.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="swift sft's hidden size H, its experts' width too (default 256; e.g. 768)",
    )
    e2e.add_argument(
        "--separate-runs",
        action="store_true",
        help="megatron sft and Megatron-LM too in one static and one elastic run per round, as swift "
        "sft runs (separate peak RSS; default: one run per round that switches between static and "
        "elastic blocks of 5 or 10 steps, timed in the one process)",
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
    from elastic_moe_plugin.tools.bench.e2e import E2EOptions

    options = E2EOptions(
        rounds=args.rounds,
        steps=args.steps,
        warmup=args.warmup,
        launchers=tuple(args.launchers),
        hidden=args.hidden,
        work=args.work,
        separate=args.separate_runs,
    )
    # --json promises machine-readable stdout; the frameworks' import-time warnings go to stderr, muted
    with contextlib.redirect_stderr(open(os.devnull, "w")) if args.json else contextlib.nullcontext():
        results = bench.run_suite(args.quick, args.threads, args.only, e2e_options=options)
    print(json.dumps(bench.to_json(results), indent=2) if args.json else bench.format_results(results))
    return 0
