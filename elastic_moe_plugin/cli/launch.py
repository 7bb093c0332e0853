"""``elastic-moe launch RECIPE``: render a recipe's launch command for this node and run it, or
print it with ``--dry-run`` (docs/recipes.md, "Launching")."""

from __future__ import annotations

import argparse
from typing import Mapping

_USAGE = ("elastic-moe launch RECIPE [--nnodes N] [--nproc-per-node N] [--node-rank R] "
          "[--master-addr HOST] [--master-port P] [--set KEY=VALUE] [--dry-run] [-- extra framework args]\n"
          "       elastic-moe launch --list")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None,
                        help="recipe file, or a built-in name such as olmoe_sft/6-10 (see --list)")
    parser.add_argument("--list", action="store_true", help="list the built-in recipes with their descriptions and exit")
    _add_options(parser)
    # Everything after RECIPE: more options, then '--' and the framework's own extra flags.
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.usage = _USAGE


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=None, help="number of nodes (default: SLURM/env/recipe)")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="GPUs per node (default: SLURM/env/recipe)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: SLURM_NODEID/NODE_RANK/0)")
    parser.add_argument("--master-addr", default=None, help="rank-0 host (default: first SLURM host/MASTER_ADDR/127.0.0.1)")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: MASTER_PORT/recipe/29500)")
    parser.add_argument("--megatron-lm-dir", default=None,
                        help="Megatron-LM checkout holding the recipe's script (default: $MEGATRON_LM_DIR)")
    parser.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set args.train-data-path=[/data/fw] (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and its environment, run nothing")


def run(args: argparse.Namespace) -> int:
    from elastic_moe_plugin.tools.recipes.render import launch

    if args.list:
        return list_recipes()
    if args.recipe is None:
        from elastic_moe_plugin.tools.recipes.schema import RecipeError

        raise RecipeError("launch needs a RECIPE (a file, or a built-in name such as olmoe_sft/6-10); "
                          "elastic-moe launch --list prints them.")
    command = build_command(args)
    print(command.shell(), flush=True)
    if args.dry_run:
        return 0
    return launch(command)


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
        recipe, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, environ=environ,
    )
    return render(recipe, topology, extra, megatron_lm_dir=args.megatron_lm_dir)


def _split_rest(args: argparse.Namespace) -> list[str]:
    """Parse launch options given after RECIPE into ``args``; return the framework's extra args
    (after ``--``)."""
    from elastic_moe_plugin.tools.recipes.schema import RecipeError

    rest = list(args.rest or [])
    if "--" in rest:
        cut = rest.index("--")
        head, tail = rest[:cut], rest[cut + 1:]
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
            elif key == "dry_run":
                args.dry_run = args.dry_run or value
            elif value is not None:
                setattr(args, key, value)
    return tail
