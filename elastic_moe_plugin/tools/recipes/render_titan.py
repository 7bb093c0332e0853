"""Render a ``launcher: torchtitan`` recipe: ``torchrun ... -m torchtitan.train --module M --config C
<flags> --override.imports 'elastic_moe_plugin.titan.elastic_moe={...}'`` (docs/recipes.md).

torchtitan's flags are dotted paths of its config tree (``--training.steps``), parsed by tyro; a
recipe's ``args`` nest them (``training: {steps: 25034}``), so that overlays and ``--set
args.training.steps=10`` merge like every other key. ``True`` renders ``--a.b``, ``False``
``--a.no_b`` (tyro's switch pair), a list its values after the flag. The structured blocks render
the batch (``--training.local_batch_size/global_batch_size/seq_len``) and the parallelism (FSDP over
the ranks TP x PP x CP leave, ``--parallelism.expert_parallel_degree`` inside it), and the
``elastic:`` block is the door's JSON, spelled as the recipe writes it.

Rendering imports no torchtitan; a launch needs it importable (:func:`torchtitan_problem`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from typing import Any

from elastic_moe_plugin.tools.recipes.recipe import Recipe, flat_flags
from elastic_moe_plugin.tools.recipes.schema import RecipeError
from elastic_moe_plugin.tools.recipes.topology import Fit, Topology, torchrun_argv

__all__ = [
    "DOOR",
    "ENTRY",
    "INSTALL_HINT",
    "door_config_json",
    "render_torchtitan",
    "titan_flags",
    "torchtitan_problem",
]

#: ``-m`` of the launch
ENTRY = "torchtitan.train"
#: the door's ``--override.imports`` target
DOOR = "elastic_moe_plugin.titan.elastic_moe"
#: how to get a torchtitan the door supports
INSTALL_HINT = "pip install 'elastic-moe-plugin[titan]' (torchtitan>=0.3,<0.4)"


def titan_flags(recipe: Recipe, values: dict[str, Any]) -> list[str]:
    """``values`` (nested ``args``) as torchtitan's command-line words, placeholders filled in."""
    argv: list[str] = []
    for name, value in flat_flags(values).items():
        value = recipe.interpolate(value, f"args.{name}")
        if value is True:
            argv.append(f"--{name}")
        elif value is False:
            section, _, field = name.rpartition(".")
            argv.append(f"--{section + '.' if section else ''}no_{field}")
        elif isinstance(value, list):
            argv += [f"--{name}"] + [_word(recipe.interpolate(item, f"args.{name}")) for item in value]
        else:
            argv += [f"--{name}", _word(value)]
    return argv


def _word(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def door_config_json(recipe: Recipe) -> str:
    """The door's JSON: the merged ``elastic:`` block, keys as the recipe writes them."""
    return json.dumps(recipe.data.get("elastic") or {})


def render_torchtitan(recipe: Recipe, topology: Topology, fit: Fit) -> tuple[list[str], list[str]]:
    """This node's ``torchrun -m torchtitan.train`` words and the notes that explain them.

    Raises:
        RecipeError: ``args`` has no ``module`` or ``config``.
    """
    args = dict(recipe.data.get("args") or {})
    for key in ("module", "config"):
        if not isinstance(args.get(key), str):
            raise RecipeError(
                f"{recipe.file_of('args')}: launcher torchtitan needs args.{key} (--{key} of torchtitan)."
            )
    batch, p = recipe.batch, recipe.parallel
    structured = {
        "training": {
            "local_batch_size": batch["micro"],
            "global_batch_size": batch["global"],
            "seq_len": batch["seq_length"],
        },
        "parallelism": {
            "data_parallel_replicate_degree": 1,
            "data_parallel_shard_degree": fit.dp,
            "tensor_parallel_degree": p["tp"],
            "pipeline_parallel_degree": p["pp"],
            "context_parallel_degree": p["cp"],
            "expert_parallel_degree": p["ep"],
        },
    }
    head = {"module": args.pop("module"), "config": args.pop("config")}
    argv = [
        *torchrun_argv(topology, ENTRY),
        *titan_flags(recipe, head),
        *titan_flags(recipe, structured),
        *titan_flags(recipe, args),
        "--override.imports",
        f"{DOOR}={door_config_json(recipe)}",
    ]
    notes = [
        f"torchtitan: the model is {head['module']}.{head['config']} (torchtitan builds no model from flags); FSDP "
        f"over {fit.dp} ranks, EP {p['ep']} inside them ({recipe.model.num_experts // p['ep']} experts per EP rank), "
        f"{fit.accumulation} micro-batches of {batch['micro']} per step",
        f"the door: --override.imports {DOOR}=<the elastic: block as JSON>, applied on every rank before the model "
        "is built (docs/torchtitan.md)",
    ]
    if model_note := _train_topk_note(recipe):
        notes.append(model_note)
    problem = torchtitan_problem()
    if problem:
        notes.append(f"WARNING: {problem}; a launch refuses to start")
    return argv, notes


def _train_topk_note(recipe: Recipe) -> str | None:
    model = recipe.model
    if model.train_topk is None:
        return None
    return (
        f"top-{model.train_topk} control: {recipe.args.get('config')} trains at top-{model.train_topk}; evaluate at "
        f"top-{model.topk} (a config of the same weights at top-{model.topk})"
    )


def torchtitan_problem() -> str | None:
    """Why torchtitan cannot run here (not importable, or outside 0.3), with the fix; None when it can."""
    if importlib.util.find_spec("torchtitan") is None:
        return f"torchtitan is not importable in this environment: {INSTALL_HINT}"
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None  # a source checkout on PYTHONPATH: the door checks its version at start-up
    if not version.startswith("0.3."):
        return f"torchtitan {version} is installed; the door supports 0.3: {INSTALL_HINT}"
    return None
