"""``elastic-moe gates``: the gate-convention lab (docs/gates.md)."""

from __future__ import annotations

import argparse
import json
import sys


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``elastic-moe gates`` to ``parser``."""
    from elastic_moe_plugin.core.schedule import SAMPLING_MODES
    from elastic_moe_plugin.tools.gates_lab.conventions import CONVENTION_NAMES
    from elastic_moe_plugin.tools.gates_lab.inputs import DTYPES

    toy = parser.add_argument_group("toy MoE")
    toy.add_argument("--k", type=int, default=1, help="top-k, the schedule's center (default: 1)")
    toy.add_argument(
        "--schedule", default=None, help="elastic budget schedule around k, e.g. '1-3' (default: static top-k)"
    )
    toy.add_argument("--sigma", type=float, default=1.5, help="schedule sigma (default: 1.5)")
    toy.add_argument("--sampling", choices=SAMPLING_MODES, default="iid", help="budget sampling (default: iid)")
    toy.add_argument("--experts", type=int, default=None, help="number of experts E (default: 8, or from --logits)")
    toy.add_argument("--tokens", type=int, default=None, help="number of tokens T (default: 16, or from --logits)")
    toy.add_argument("--hidden", type=int, default=8, help="toy width D (default: 8)")
    toy.add_argument("--seed", type=int, default=0, help="seed of the toy and the budgets (default: 0)")
    toy.add_argument(
        "--logits", metavar="FILE", default=None, help="user-supplied router logits [T, E]: .pt, .npy or .json"
    )
    toy.add_argument(
        "--conventions",
        default=None,
        metavar="LIST",
        help=f"comma-separated subset of {','.join(CONVENTION_NAMES)} (default: all)",
    )
    toy.add_argument("--identical-experts", action="store_true", help="give every expert the same weights")
    toy.add_argument("--logit-scale", type=float, default=1.0, help="scale the toy router's logits (large = saturated)")
    toy.add_argument(
        "--detach-gate", action="store_true", help="detach the gate weights (shows the 'detached tensor' cause)"
    )
    toy.add_argument("--dtype", choices=tuple(DTYPES), default="float64", help="compute dtype (default: float64)")
    toy.add_argument("--gradcheck", action="store_true", help="also run the boundary-aware finite-difference check")
    toy.add_argument(
        "--step", type=float, default=None, help="finite-difference step for --gradcheck (default: from the margins)"
    )
    toy.add_argument("--show-tokens", type=int, default=8, help="tokens whose selection the table lists (default: 8)")
    example = parser.add_argument_group("two-logit example")
    example.add_argument("--two-logit", action="store_true", help="the worked example: logits [0, w*x - 0.5]")
    example.add_argument("--x", type=float, default=None, help="input x of the two-logit example (default: 1)")
    example.add_argument("--w", type=float, default=None, help="weight w of the two-logit example (default: 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _execute(args: argparse.Namespace) -> str:
    from elastic_moe_plugin.tools.gates_lab import (
        compare,
        format_comparison,
        format_two_logit,
        load_logits,
        two_logit_example,
    )

    if args.two_logit:
        example = two_logit_example(1.0 if args.x is None else args.x, 1.0 if args.w is None else args.w)
        return json.dumps(example, indent=2) if args.json else format_two_logit(example)
    if args.x is not None or args.w is not None:
        raise ValueError("--x and --w set the two-logit example: add --two-logit, or drop them.")
    if args.show_tokens < 0:
        raise ValueError(f"--show-tokens={args.show_tokens} is invalid: expected an integer >= 0.")
    report = compare(
        k=args.k,
        schedule=args.schedule,
        sigma=args.sigma,
        sampling=args.sampling,
        num_experts=args.experts,
        num_tokens=args.tokens,
        hidden=args.hidden,
        seed=args.seed,
        conventions=args.conventions,
        logits=None if args.logits is None else load_logits(args.logits),
        identical_experts=args.identical_experts,
        logit_scale=args.logit_scale,
        detach_gate=args.detach_gate,
        dtype=args.dtype,
        gradcheck=args.gradcheck,
        step=args.step,
    )
    if args.logits is not None:
        report["setup"]["router"] = f"user-supplied logits from {args.logits}"
    return json.dumps(report, indent=2) if args.json else format_comparison(report, args.show_tokens)


def run(args: argparse.Namespace) -> int:
    """``elastic-moe gates``: print the table (or JSON); bad input -> message on stderr, exit 2."""
    try:
        print(_execute(args))
    except ValueError as error:
        print(f"elastic-moe gates: error: {error}", file=sys.stderr)
        return 2
    return 0
