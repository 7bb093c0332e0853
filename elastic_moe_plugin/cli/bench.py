"""``elastic-moe bench``: elastic against stock, interleaved in one process (docs/performance.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes, a few seconds per scenario (what CI runs)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--only", nargs="+", choices=("router", "layer", "gpt", "hf", "kappa"), default=None,
                        help="run only these scenarios (router, layer (dropless and drop-and-pad), gpt: "
                             "Megatron-core; hf: transformers' OLMoE- and Qwen3-MoE-shaped blocks under every "
                             "experts implementation; kappa: the κ draw per router call for 1-1024 token shards, "
                             "before and after the counter-based stream)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools import bench

    # --json promises machine-readable stdout; the frameworks' import-time warnings go to stderr, muted
    with contextlib.redirect_stderr(open(os.devnull, "w")) if args.json else contextlib.nullcontext():
        results = bench.run_suite(args.quick, args.threads, args.only)
    print(json.dumps(bench.to_json(results), indent=2) if args.json else bench.format_results(results))
    return 0
