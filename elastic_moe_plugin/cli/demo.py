"""``elastic-moe demo``: static vs elastic Megatron MoE GPT on CPU.

Parses the flags into :class:`~elastic_moe_plugin.tools.demo.settings.DemoSettings`, validates the
elastic schedule against the demo model before building anything, then wires the tool's steps:
corpus, both training runs (:func:`~elastic_moe_plugin.tools.demo.train.train_runs`), the
checkpoints, ``model_config.json``, ``summary.json``, the PNGs and the printed table or JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_moe_plugin.core.errors import ConfigError

if TYPE_CHECKING:
    from elastic_moe_plugin.core.config import ElasticConfig
    from elastic_moe_plugin.core.schedule import BudgetSchedule
    from elastic_moe_plugin.tools.demo.corpus import Corpus
    from elastic_moe_plugin.tools.demo.settings import DemoSettings


def configure_parser(parser: argparse.ArgumentParser) -> None:
    from elastic_moe_plugin.tools.demo.settings import QUICK, DemoSettings

    defaults = DemoSettings()
    parser.add_argument(
        "--schedule",
        default=defaults.schedule,
        help=f"elastic run's schedule around top-{defaults.topk} (default: {defaults.schedule})",
    )
    parser.add_argument("--sigma", type=float, default=defaults.sigma, help="schedule width (default: 1.5)")
    parser.add_argument(
        "--layers", default=None, help="0-based layers that route elastically, e.g. '1-2' (default: all)"
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=defaults.num_layers,
        help=f"decoder layers, each an MoE layer (default: {defaults.num_layers})",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps per run (default: {defaults.steps}; --quick: {QUICK['steps']})",
    )
    budget.add_argument("--tokens", type=int, default=None, help="training tokens per run (rounded to whole steps)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="init, batch order and κ draws (default: 0)")
    parser.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="train on a text file as byte-level tokens (vocab 256) instead of the synthetic mixture",
    )
    parser.add_argument("--out", default="demo_out", help="output folder (default: demo_out/)")
    parser.add_argument("--quick", action="store_true", help="a run of under a minute (smaller batch, fewer steps)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1; the model is so small that 2 threads gain ~25%% on an "
        "idle machine but run several times slower when other processes share the cores)",
    )
    parser.add_argument("--verbose", action="store_true", help="keep Megatron's warnings and log messages")


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    from elastic_moe_plugin.tools.demo.settings import QUICK, DemoSettings

    values: dict[str, Any] = dict(
        schedule=args.schedule,
        sigma=args.sigma,
        layers=args.layers,
        num_layers=args.num_layers,
        seed=args.seed,
        data=args.data,
    )
    if args.quick:
        values.update(QUICK)
    settings = DemoSettings(**values)
    if args.steps is not None:
        if args.steps < 1:
            raise ConfigError(f"--steps={args.steps} is invalid: expected at least 1.")
        settings = dataclasses.replace(settings, steps=args.steps)
    elif args.tokens is not None:
        if args.tokens < 1:
            raise ConfigError(f"--tokens={args.tokens} is invalid: expected a positive number of tokens.")
        settings = dataclasses.replace(settings, steps=max(1, round(args.tokens / settings.tokens_per_step)))
    if settings.num_layers < 1:
        raise ConfigError(f"--num-layers={settings.num_layers} is invalid: expected at least 1.")
    return settings


@contextlib.contextmanager
def _quiet_megatron(verbose: bool) -> Iterator[None]:
    """Hide Megatron's import-time "TE/Apex not installed" warnings and deprecation log lines."""
    if verbose:
        yield
        return
    logger = logging.getLogger("megatron")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|absl).*")
        try:
            yield
        finally:
            logger.setLevel(level)


def _missing_megatron() -> str | None:
    """Why megatron-core cannot be imported (the demo trains a Megatron-core model), or None."""
    import importlib.util

    try:
        if importlib.util.find_spec("megatron.core") is not None:
            return None
    except ImportError as error:
        return str(error)
    return "No module named 'megatron.core'"


def run(args: argparse.Namespace) -> int:
    missing = _missing_megatron()
    if missing is not None:
        print(
            f"elastic-moe demo: error: the demo trains a Megatron-core model, and megatron-core is not installed "
            f"({missing}). Install the [megatron] extra: pip install 'elastic-moe-plugin[megatron]' "
            f"(megatron-core >=0.16,<0.20; see README, 'Supported versions').",
            file=sys.stderr,
        )
        return 2
    import torch

    from elastic_moe_plugin.core.config import ElasticConfig, Spelling
    from elastic_moe_plugin.tools.demo.corpus import file_corpus, synthetic_corpus

    settings = settings_from_args(args)
    # Validate the schedule against the demo model before building anything; messages name the
    # demo's own flags (--schedule, --sigma, --layers).
    elastic = ElasticConfig.from_dict(
        {"schedule": settings.schedule, "sigma": settings.sigma, "layers": settings.layers},
        source="elastic-moe demo",
        spelling=Spelling("cli", prefix="--"),
    )
    schedule = elastic.resolve(num_experts=settings.num_experts, topk=settings.topk, num_layers=settings.num_layers)
    static = ElasticConfig(schedule="static")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    start = time.perf_counter()
    corpus = file_corpus(settings.data, settings) if settings.data else synthetic_corpus(settings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads={args.threads} is invalid: expected at least 1.")
    torch.set_num_threads(args.threads if args.threads is not None else 1)
    try:
        return _run(args, settings, corpus, elastic, schedule, static, out, start)
    finally:
        torch.set_num_threads(threads)


def _run(
    args: argparse.Namespace,
    settings: DemoSettings,
    corpus: Corpus,
    elastic: ElasticConfig,
    schedule: BudgetSchedule,
    static: ElasticConfig,
    out: Path,
    start: float,
) -> int:
    import torch

    from elastic_moe_plugin.tools.demo.model import model_config
    from elastic_moe_plugin.tools.demo.plots import write_plots
    from elastic_moe_plugin.tools.demo.report import build_summary, format_table, model_config_file
    from elastic_moe_plugin.tools.demo.train import train_runs

    config = model_config(settings, corpus.vocab_size)
    with _quiet_megatron(args.verbose):
        results, states, mcore_version = train_runs({"static": static, "elastic": elastic}, settings, corpus, config)

    files = ["summary.json", "model_config.json", "static.pt", "elastic.pt"]
    for name, state in states.items():
        torch.save(state, out / f"{name}.pt")
    config_file = model_config_file(config, settings, corpus, results, mcore_version)
    (out / "model_config.json").write_text(json.dumps(config_file, indent=2))
    parameters = sum(v.numel() for v in states["static"].values())
    summary = build_summary(settings, corpus, schedule, results, parameters, mcore_version, out)
    try:
        files += write_plots(summary, out, schedule)
    except ImportError:
        print(
            "elastic-moe demo: matplotlib is not installed, skipping the PNGs "
            "(pip install 'elastic-moe-plugin[plot]').",
            file=sys.stderr,
        )
    summary["files"] = files
    summary["wall_time_s"] = time.perf_counter() - start
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    return 0
