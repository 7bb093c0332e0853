"""``elastic-moe diagnose``: offline routing diagnostics of trained MoE checkpoints (docs/diagnostics.md).

Three subcommands::

    elastic-moe diagnose compare STATIC ELASTIC --probe probe.pt [--probe more.txt ...] --out diag/
    elastic-moe diagnose swap --router-from ELASTIC --into STATIC --out swapped/ [--layers 3-7]
    elastic-moe diagnose kappa routing_metrics.json --out diag/

Parsing and wiring only; the work is :mod:`elastic_moe_plugin.tools.diagnose`, imported inside the
handlers so that ``--help`` loads neither torch nor the frameworks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_moe_plugin.tools.diagnose.checkpoints import CheckpointSpec
    from elastic_moe_plugin.tools.diagnose.compare import CompareSettings
    from elastic_moe_plugin.tools.diagnose.probe import ProbeTask

_DTYPES = ("float32", "bfloat16", "float16")


def _add_compare_parser(commands: Any) -> None:
    compare_parser = commands.add_parser(
        "compare",
        help="router divergence, D1/Dk, prioritisation and a top-k sweep on a probe set",
        description="Stream a probe set through checkpoints (transformers folders or elastic-moe demo outputs) and "
        "write per-layer router divergence, D1/Dk, expert prioritisation near the cutoff, an inference "
        "top-k sweep and plots (paper §6).",
    )
    compare_parser.add_argument(
        "checkpoints",
        nargs="+",
        metavar="[LABEL=]PATH",
        help="transformers folder, demo folder (all runs), DEMO_DIR:RUN or DEMO_DIR/RUN.pt",
    )
    compare_parser.add_argument(
        "--probe",
        action="append",
        required=True,
        metavar="FILE",
        help="token ids (.pt/.npy/.json/.jsonl/.txt of ints) or, with --tokenizer, text lines; "
        "repeat for several tasks (averaged with equal weight)",
    )
    compare_parser.add_argument("--tokenizer", default=None, help="tokenizer name or folder for text probe files")
    compare_parser.add_argument("--out", default="diagnostics_out", help="output folder (default: diagnostics_out/)")
    compare_parser.add_argument("--k", type=int, default=None, help="top-k of the sets in Dk (default: the models')")
    compare_parser.add_argument(
        "--topk-sweep",
        default=None,
        metavar="K",
        help="inference top-k values, e.g. '4-12' or '2,4,8'; 'off' to skip (default: k-2..k+2)",
    )
    compare_parser.add_argument(
        "--boundary",
        type=int,
        default=1,
        help="first and last N MoE layers count as boundary layers (default 1: L0 and L_last)",
    )
    compare_parser.add_argument(
        "--boundary-layers",
        default=None,
        metavar="LAYERS",
        help="explicit 0-based boundary layers, e.g. '0,15' (overrides --boundary)",
    )
    compare_parser.add_argument(
        "--block-width", type=int, default=5, help="width of the peak non-boundary block (default 5)"
    )
    compare_parser.add_argument(
        "--cutoff-window", type=int, default=2, help="last deployed ranks that count as near the cutoff (default 2)"
    )
    compare_parser.add_argument("--js-base", choices=("2", "e"), default="2", help="log base of JS (default 2: bits)")
    compare_parser.add_argument("--batch-size", type=int, default=8, help="probe windows per batch (default 8)")
    compare_parser.add_argument(
        "--seq-len", type=int, default=None, help="probe window length (default: model maximum, <= 1024)"
    )
    compare_parser.add_argument("--max-sequences", type=int, default=None, help="cap on windows per probe file")
    compare_parser.add_argument(
        "--all-pairs", action="store_true", help="compare every pair (default: first vs each other)"
    )
    compare_parser.add_argument(
        "--kappa-metrics",
        action="append",
        default=[],
        metavar="FILE",
        help="routing-metrics JSON / JSONL / demo summary.json for the κ histogram plot",
    )
    compare_parser.add_argument(
        "--dtype", default="float32", choices=_DTYPES, help="transformers weights dtype (default float32)"
    )
    compare_parser.add_argument("--no-plots", action="store_true", help="write JSON and CSV only")
    compare_parser.add_argument("--json", action="store_true", help="print diagnostics.json instead of the report")
    compare_parser.set_defaults(diagnose_handler=_run_compare)


def _add_swap_parser(commands: Any) -> None:
    swap = commands.add_parser(
        "swap",
        help="write a checkpoint: one model's experts and everything else, another's routers",
        description="Router swap (paper Table 4): load the routers of --router-from into --into (all MoE layers or "
        "--layers) and write the result as a checkpoint of the same kind.",
    )
    swap.add_argument("--router-from", required=True, metavar="[LABEL=]PATH", help="router donor")
    swap.add_argument("--into", required=True, metavar="[LABEL=]PATH", help="target (experts, attention, embeddings)")
    swap.add_argument("--out", required=True, help="output folder (must be new or empty)")
    swap.add_argument("--layers", default=None, help="0-based layers to swap, e.g. '3-7' (default: every MoE layer)")
    swap.add_argument("--dtype", default="float32", choices=_DTYPES)
    swap.set_defaults(diagnose_handler=_run_swap)


def _add_kappa_parser(commands: Any) -> None:
    kappa = commands.add_parser(
        "kappa",
        help="plot realised κ histograms against the schedule's pmf from logged routing metrics",
        description="Plot κ shares per layer against the budget pmf from a routing-metrics JSON/JSONL (hf / mcore "
        "routing_metrics, a trainer log history) or an elastic-moe demo summary.json.",
    )
    kappa.add_argument("files", nargs="+", metavar="FILE")
    kappa.add_argument("--out", default="diagnostics_out", help="output folder (default: diagnostics_out/)")
    kappa.set_defaults(diagnose_handler=_run_kappa)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="diagnose_command", required=True, metavar="{compare,swap,kappa}")
    _add_compare_parser(commands)
    _add_swap_parser(commands)
    _add_kappa_parser(commands)


# ---------------------------------------------------------------------------------- flag values
def _parse_sweep(text: str | None) -> tuple[int, ...] | None:
    """``--topk-sweep``: None (flag absent: the default sweep), () ('off'), or the sorted values."""
    from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError

    if text is None:
        return None
    if text.strip().lower() in ("none", "off", ""):
        return ()
    values: set[int] = set()
    for item in text.replace(" ", "").split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match:
            raise DiagnosticsError(f"--topk-sweep {text!r}: expected values or ranges such as '4-12' or '2,4,8'.")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise DiagnosticsError(f"--topk-sweep {text!r}: reversed range {item!r}.")
        values.update(range(first, last + 1))
    return tuple(sorted(values))


def _single(spec: str, role: str) -> CheckpointSpec:
    from elastic_moe_plugin.tools.diagnose.checkpoints import parse_checkpoint
    from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError

    specs = parse_checkpoint(spec)
    if len(specs) != 1:
        raise DiagnosticsError(
            f"{role} {spec!r} holds {len(specs)} runs ({', '.join(str(s.run) for s in specs)}); pick one with DIR:RUN."
        )
    return specs[0]


def _load_tasks(args: argparse.Namespace) -> list[ProbeTask]:
    """The ``--probe`` files, tokenised with ``--tokenizer`` if given; equal names get an index prefix."""
    from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError
    from elastic_moe_plugin.tools.diagnose.probe import load_probe

    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as error:
            raise DiagnosticsError(f"cannot load tokenizer {args.tokenizer!r}: {error}") from None
    tasks = [load_probe(path, tokenizer=tokenizer) for path in args.probe]
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):
        for index, task in enumerate(tasks):
            task.name = f"{index}:{task.name}"
    return tasks


def _compare_settings(args: argparse.Namespace) -> CompareSettings:
    from elastic_moe_plugin.core.config import parse_layers
    from elastic_moe_plugin.core.errors import ConfigError
    from elastic_moe_plugin.tools.diagnose.compare import CompareSettings
    from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError

    boundary_layers_value = None
    if args.boundary_layers is not None:
        try:
            boundary_layers_value = tuple(sorted(parse_layers(args.boundary_layers)))
        except ConfigError as error:
            raise DiagnosticsError(str(error)) from None
    for name in ("batch_size", "block_width", "cutoff_window"):
        if getattr(args, name) < 1:
            raise DiagnosticsError(f"--{name.replace('_', '-')} must be >= 1.")
    if args.seq_len is not None and args.seq_len < 2:
        raise DiagnosticsError("--seq-len must be >= 2.")
    return CompareSettings(
        k=args.k,
        sweep=_parse_sweep(args.topk_sweep),
        boundary=args.boundary,
        boundary_layers=boundary_layers_value,
        block_width=args.block_width,
        cutoff_window=args.cutoff_window,
        log_base=2.0 if args.js_base == "2" else math.e,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        max_sequences=args.max_sequences,
        all_pairs=args.all_pairs,
    )


# ---------------------------------------------------------------------------------- handlers
def _run_compare(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.diagnose.checkpoints import parse_checkpoint
    from elastic_moe_plugin.tools.diagnose.compare import compare
    from elastic_moe_plugin.tools.diagnose.kappa import demo_kappa_for, load_kappa
    from elastic_moe_plugin.tools.diagnose.models import load_models
    from elastic_moe_plugin.tools.diagnose.report import format_report, write_outputs

    specs = [spec for text in args.checkpoints for spec in parse_checkpoint(text)]
    tasks = _load_tasks(args)
    settings = _compare_settings(args)
    kappa = {}
    for file in args.kappa_metrics:
        kappa.update(load_kappa(file))
    with contextlib.ExitStack() as stack:
        models = load_models(specs, stack, args.dtype)
        # a live progress line only on a terminal; logs and captured output stay clean
        progress = (
            (lambda text: print(f"\relastic-moe diagnose: {text}   ", end="", file=sys.stderr, flush=True))
            if sys.stderr.isatty()
            else None
        )
        results = compare(models, tasks, settings, progress)
        if progress is not None:
            print(file=sys.stderr)
        kappa = {**demo_kappa_for(models), **kappa}
    out = Path(args.out)
    write_outputs(results, out, kappa, plots=not args.no_plots)
    print(
        json.dumps(results, indent=2)
        if args.json
        else format_report(results) + f"\n\nwrote {', '.join(results['files'])} to {out}/"
    )
    return 0


def _run_swap(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.diagnose.swap import router_swap

    donor, target = _single(args.router_from, "--router-from"), _single(args.into, "--into")
    record = router_swap(donor, target, args.out, args.layers, args.dtype)
    print(
        f"wrote {args.out}: routers of {donor.label} ({donor.path}) in layers {record['layers']} into "
        f"{target.label} ({target.path}); everything else is {target.label}'s."
    )
    return 0


def _run_kappa(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.diagnose.compare import FORMAT
    from elastic_moe_plugin.tools.diagnose.kappa import load_kappa
    from elastic_moe_plugin.tools.diagnose.report import write_outputs

    kappa = {}
    for file in args.files:
        kappa.update(load_kappa(file))
    out = Path(args.out)
    results = {"format": FORMAT, "pairs": {}, "topk_sweep": {}}
    files = write_outputs(results, out, kappa, plots=True)
    print(f"wrote {', '.join(files)} to {out}/")
    return 0


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError

    try:
        return args.diagnose_handler(args)
    except DiagnosticsError as error:
        print(f"elastic-moe diagnose {args.diagnose_command}: error: {error}", file=sys.stderr)
        return 2
