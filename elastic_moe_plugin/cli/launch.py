"""``elastic-moe launch RECIPE``: render a recipe's launch command for this node and run it, or
print it with ``--dry-run`` (docs/recipes.md, "Launching"); with ``--rehearse``, run the recipe's own
launcher on this machine for a few steps on a tiny model of the same family first
(docs/recipes.md, "Rehearse before you allocate")."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

_USAGE = (
    "elastic-moe launch RECIPE [--nnodes N] [--nproc-per-node N] [--node-rank R] "
    "[--master-addr HOST] [--master-port P] [--set KEY=VALUE] [--dry-run] [-- extra framework args]\n"
    "       elastic-moe launch RECIPE --rehearse [--steps N] [--rehearse-dir DIR] [--nproc-per-node N] "
    "[--set KEY=VALUE] [--dry-run]\n"
    "       elastic-moe launch --list"
)
_EPILOG = (
    "Rehearse before you allocate: --rehearse runs the recipe's own launcher (swift sft, megatron sft, "
    "Megatron-LM's or torchtitan's trainer) here, on CPU, for --steps steps on a tiny random model of the "
    "same family, with the recipe's flags and schedule; it prints every flag it had to replace and why, and "
    "exits non-zero on the first error the launcher raises (an unknown flag, a bad value, a schedule that "
    "does not fit) or when no routing metric was logged. About 1-3 minutes on 2 CPU cores; nothing is "
    "downloaded."
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe", nargs="?", default=None, help="recipe file, or a built-in name such as olmoe_sft/6-10 (see --list)"
    )
    parser.add_argument(
        "--list", action="store_true", help="list the built-in recipes with their descriptions and exit"
    )
    _add_options(parser)
    # Everything after RECIPE: more options, then '--' and the framework's own extra flags.
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.usage = _USAGE
    parser.epilog = _EPILOG


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=None, help="number of nodes (default: SLURM/env/recipe)")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="GPUs per node (default: SLURM/env/recipe)")
    parser.add_argument(
        "--node-rank", type=int, default=None, help="this node's rank (default: SLURM_NODEID/NODE_RANK/0)"
    )
    parser.add_argument(
        "--master-addr", default=None, help="rank-0 host (default: first SLURM host/MASTER_ADDR/127.0.0.1)"
    )
    parser.add_argument(
        "--master-port", type=int, default=None, help="rendezvous port (default: MASTER_PORT/recipe/29500)"
    )
    parser.add_argument(
        "--megatron-lm-dir",
        default=None,
        help="Megatron-LM checkout holding the recipe's script (default: $MEGATRON_LM_DIR; "
        "--rehearse without one uses the megatron-core wheel's trainer and the repository's "
        "example script)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set args.train-data-path=[/data/fw] (repeatable)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command and its environment, run nothing")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="run the recipe's own launcher on this machine (CPU) for a few steps on a tiny model of "
        "the same family, printing the flags it replaced and why; exit non-zero on the first "
        "error the launcher raises",
    )
    parser.add_argument("--steps", type=int, default=None, help="--rehearse: training steps (default: 3)")
    parser.add_argument(
        "--rehearse-dir",
        default=None,
        help="--rehearse: an empty or new work folder (default: a fresh temporary folder, kept)",
    )


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.recipes.render import launch

    if args.list:
        return list_recipes()
    if args.recipe is None:
        from elastic_moe_plugin.tools.recipes.schema import RecipeError

        raise RecipeError(
            "launch needs a RECIPE (a file, or a built-in name such as olmoe_sft/6-10); "
            "elastic-moe launch --list prints them."
        )
    _split_rest(args)  # options given after RECIPE (--rehearse among them) count from here on
    if args.rehearse:
        return rehearse(args)
    if args.steps is not None or args.rehearse_dir is not None:
        from elastic_moe_plugin.tools.recipes.schema import RecipeError

        raise RecipeError(
            "--steps and --rehearse-dir belong to a rehearsal: add --rehearse "
            "(elastic-moe launch RECIPE --rehearse --steps 3)."
        )
    command = build_command(args)
    print(command.shell(), flush=True)
    if args.dry_run:
        return 0
    return launch(command)


def rehearse(args: argparse.Namespace) -> int:
    """``--rehearse``: plan the rehearsal, print what it replaced and the command, run it (not with
    ``--dry-run``)."""
    import shutil

    from elastic_moe_plugin.tools.recipes.rehearse import DEFAULT_STEPS, plan_rehearsal
    from elastic_moe_plugin.tools.recipes.rehearse import rehearse as run_rehearsal

    extra = _split_rest(args)
    plan = plan_rehearsal(
        args.recipe,
        args.overrides or (),
        steps=args.steps or DEFAULT_STEPS,
        work_dir=args.rehearse_dir,
        megatron_lm_dir=args.megatron_lm_dir,
        nproc=args.nproc_per_node,
        extra_args=extra,
        build_assets=not args.dry_run,
    )
    print(plan.describe(), flush=True)
    print(plan.command.shell(), flush=True)
    if args.dry_run:
        if args.rehearse_dir is None:
            shutil.rmtree(plan.work, ignore_errors=True)
        return 0
    return run_rehearsal(plan)


def list_recipes() -> int:
    """Print every built-in recipe: name, launcher, one-line description (what ``--list`` shows)."""
    from elastic_moe_plugin.tools.recipes.load import list_recipes as rows_of_recipes

    rows = rows_of_recipes()
    width = max((len(row["name"]) for row in rows), default=4)
    for row in rows:
        print(f"{row['name']:<{width}}  {row['launcher']:<12}  {row['description']}")
    print(f"\n{len(rows)} recipes; run one with: elastic-moe launch NAME [--dry-run]")
    return 0


def build_command(args: argparse.Namespace, environ: Mapping[str, str] | None = None):
    """The :class:`~elastic_moe_plugin.tools.recipes.render.LaunchCommand` the parsed ``args``
    describe, with the topology read from ``environ`` (default: ``os.environ``)."""
    from elastic_moe_plugin.tools.recipes.load import load_recipe
    from elastic_moe_plugin.tools.recipes.render import render
    from elastic_moe_plugin.tools.recipes.topology import resolve_topology

    extra = _split_rest(args)
    recipe = load_recipe(args.recipe, args.overrides or ())
    topology = resolve_topology(
        recipe,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        environ=environ,
    )
    return render(recipe, topology, extra, megatron_lm_dir=args.megatron_lm_dir)


def _split_rest(args: argparse.Namespace) -> list[str]:
    """Parse launch options given after RECIPE into ``args``; return the framework's extra args
    (after ``--``)."""
    from elastic_moe_plugin.tools.recipes.schema import RecipeError

    if getattr(args, "framework_args", None) is not None:
        return list(args.framework_args)  # already split
    rest = list(args.rest or [])
    if "--" in rest:
        cut = rest.index("--")
        head, tail = rest[:cut], rest[cut + 1 :]
    else:
        head, tail = rest, []
    if head:
        parser = argparse.ArgumentParser(prog="elastic-moe launch RECIPE", add_help=False, allow_abbrev=False)
        _add_options(parser)
        parsed, unknown = parser.parse_known_args(head)
        if unknown:
            raise RecipeError(
                f"unknown launch option(s) {' '.join(unknown)}; framework flags go after '--', e.g. "
                f"elastic-moe launch RECIPE --dry-run -- {' '.join(unknown)}"
            )
        for key, value in vars(parsed).items():
            if key == "overrides":
                if value:
                    args.overrides = (args.overrides or []) + value
            elif key in ("dry_run", "rehearse"):
                setattr(args, key, getattr(args, key) or value)
            elif value is not None:
                setattr(args, key, value)
    args.framework_args = list(tail)
    return tail
