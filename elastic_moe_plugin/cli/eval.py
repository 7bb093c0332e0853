"""``elastic-moe eval``: the paper's evaluation suites through lm-evaluation-harness (docs/evaluation.md).

Parses and wires only; the tool (:mod:`elastic_moe_plugin.tools.eval`) is imported inside :func:`run`,
so building the parser loads neither torch, transformers nor lm-eval.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _topk_arg(value: str) -> int:
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is invalid: expected an integer >= 1")
    return k


def _limit_arg(value: str) -> float:
    try:
        limit = float(value)
    except ValueError:
        limit = 0.0
    if not limit > 0:
        raise argparse.ArgumentTypeError(
            f"{value!r} is invalid: expected documents per task (>= 1) or a fraction in (0, 1)"
        )
    return int(limit) if limit >= 1 and limit.is_integer() else limit


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        nargs="?",
        default=None,
        help="transformers checkpoint folder (or hub id) of a MoE causal LM (not needed with --list-tasks)",
    )
    parser.add_argument(
        "--suite",
        required=True,
        metavar="avg9|pretrain11|PATH.yaml",
        help="suite to run: a built-in name (configs/eval/) or a suite YAML",
    )
    parser.add_argument(
        "--topk",
        type=_topk_arg,
        default=None,
        metavar="K",
        help="route to the top K experts at inference (default: the checkpoint's own)",
    )
    parser.add_argument(
        "--limit",
        type=_limit_arg,
        default=None,
        metavar="N",
        help="documents per task (or a fraction < 1); for smoke tests only",
    )
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="hf (default) or vllm")
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output folder (default: eval-results/<checkpoint>_<suite>_topk<K|native>)",
    )
    parser.add_argument("--name", default=None, help="run name in eval-table (default: the --out folder's name)")
    parser.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="run tasks that execute model-written code (MBPP); off by default",
    )
    parser.add_argument(
        "--apply-chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="format prompts with the tokenizer's chat template (default: the suite's setting, off)",
    )
    parser.add_argument("--batch-size", default="1", help="per-device batch size, or 'auto' (default: 1)")
    parser.add_argument(
        "--device",
        default=None,
        help="hf backend device: cuda, cuda:1, cpu, or auto to shard over all GPUs "
        "(default: cuda if available, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="weights dtype (default: auto, the checkpoint's)",
    )
    parser.add_argument(
        "--log-samples", action="store_true", help="also write every document's prompt and output to samples/"
    )
    parser.add_argument(
        "--bootstrap-iters",
        type=int,
        default=100_000,
        help="lm-eval stderr bootstrap iterations (default: 100000; 0 for none)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing summary in --out")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve the suite, the checkpoint and its top-k, print the harness calls and stop "
        "(no lm-eval needed, no weights loaded)",
    )
    parser.add_argument(
        "--list-tasks",
        action="store_true",
        help="print the suite's tasks (harness task, shots, metric key, averaged) and stop",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="allow model code from the checkpoint")


def default_out_dir(checkpoint: str, suite: str, topk: int | None) -> Path:
    ckpt = Path(checkpoint.rstrip("/")).name or "model"
    return Path("eval-results") / f"{ckpt}_{Path(suite).stem}_topk{topk if topk is not None else 'native'}"


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.eval.errors import EvaluationError
    from elastic_moe_plugin.tools.inference_topk import NotAMoEError

    try:
        if args.list_tasks:
            from elastic_moe_plugin.tools.eval.plan import format_suite_tasks
            from elastic_moe_plugin.tools.eval.suite import load_suite

            print(format_suite_tasks(load_suite(args.suite)))
            return 0
        if args.checkpoint is None:
            raise EvaluationError(
                "no checkpoint given: elastic-moe eval CHECKPOINT --suite SUITE "
                "(or --list-tasks to see a suite's tasks without one)."
            )
        if args.dry_run:
            return _dry_run(args)
        return _evaluate(args)
    except (EvaluationError, NotAMoEError) as error:
        print(f"elastic-moe {args.command}: error: {error}", file=sys.stderr)
        return 2


def _dry_run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.eval.plan import format_plan, plan_evaluation, registry_check

    out_dir = Path(args.out) if args.out else default_out_dir(args.checkpoint, args.suite, args.topk)
    plan = plan_evaluation(
        args.checkpoint,
        args.suite,
        out_dir=out_dir,
        topk=args.topk,
        limit=args.limit,
        backend=args.backend,
        allow_code_execution=args.allow_code_execution,
        apply_chat_template=args.apply_chat_template,
        overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code,
    )
    print(format_plan(plan, registry_check(plan)))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.eval.checkpoint import CODE_EXECUTION_WARNING, evaluate_checkpoint
    from elastic_moe_plugin.tools.eval.summary import format_summary

    if args.allow_code_execution:
        print(CODE_EXECUTION_WARNING, file=sys.stderr)
    out_dir = Path(args.out) if args.out else default_out_dir(args.checkpoint, args.suite, args.topk)
    summary = evaluate_checkpoint(
        args.checkpoint,
        args.suite,
        out_dir=out_dir,
        topk=args.topk,
        limit=args.limit,
        backend=args.backend,
        allow_code_execution=args.allow_code_execution,
        apply_chat_template=args.apply_chat_template,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        name=args.name,
        log_samples=args.log_samples,
        bootstrap_iters=args.bootstrap_iters,
        overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code,
    )
    print(format_summary(summary, out_dir))
    return 0
