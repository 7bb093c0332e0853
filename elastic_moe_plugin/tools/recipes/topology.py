"""Where a launch runs and whether the recipe fits it: this node's place in the job (flags, SLURM,
torchrun-style environment, the recipe's ``cluster:`` block) and the world-size arithmetic of the
recipe's parallelism and batch."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_moe_plugin.tools.recipes.recipe import Recipe, display_path
from elastic_moe_plugin.tools.recipes.schema import RecipeError

DEFAULT_MASTER_PORT = 29500

_TOPOLOGY_KEYS = ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port")
_INTEGER_KEYS = ("nnodes", "nproc_per_node", "node_rank", "master_port")


# ================================================================================== topology
@dataclass(frozen=True)
class Topology:
    """Where this node's launch sits in the job. ``sources`` says where each value came from."""

    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def torchrun_argv(topology: Topology, module: str) -> list[str]:
    """``torchrun --nnodes ... --master-port ... -m MODULE``: the head of every torchrun launch a
    recipe renders, so that the Megatron-LM and torchtitan launchers place a node in the job alike."""
    return [
        "torchrun",
        "--nnodes",
        str(topology.nnodes),
        "--nproc-per-node",
        str(topology.nproc_per_node),
        "--node-rank",
        str(topology.node_rank),
        "--master-addr",
        topology.master_addr,
        "--master-port",
        str(topology.master_port),
        "-m",
        module,
    ]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``'gpu[07-08,11],cpu1'`` -> ``'gpu07'``."""
    text = nodelist.strip()
    depth = 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            text = text[:index]
            break
    match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", text)
    if not match:
        return text
    prefix, ranges, suffix = match.groups()
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def resolve_topology(
    recipe: Recipe,
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Topology:
    """Resolve the job layout: command line > SLURM > ``NNODES``/``PET_NNODES``-style environment >
    the recipe's ``cluster`` block > defaults (1 node of 8, rank 0, 127.0.0.1:29500).

    Raises:
        RecipeError: when already inside a torchrun worker, or the values are inconsistent.
    """
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in environ or ("LOCAL_RANK" in environ and "GROUP_RANK" in environ):
        raise RecipeError(
            "elastic-moe launch is running inside a torchrun worker (TORCHELASTIC_RUN_ID/LOCAL_RANK are set). "
            "Run it once per node, outside torchrun: it starts torchrun itself."
        )
    flags = {
        "nnodes": nnodes,
        "nproc_per_node": nproc_per_node,
        "node_rank": node_rank,
        "master_addr": master_addr,
        "master_port": master_port,
    }
    values, sources = _first_given(_layers(recipe, flags, environ))
    _check_layout(values, sources)
    return Topology(sources=sources, **values)


def _layers(recipe: Recipe, flags: dict[str, Any], environ: Mapping[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """``[(source label, {key: value or None})]``, highest precedence first."""
    layers: list[tuple[str, dict[str, Any]]] = [("command line", flags)]
    if environ.get("SLURM_JOB_ID") and (environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")):
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        gpus = environ.get("SLURM_GPUS_ON_NODE")
        layers.append(
            (
                "SLURM",
                {
                    "nnodes": environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES"),
                    "node_rank": environ.get("SLURM_NODEID"),
                    "master_addr": first_slurm_host(nodelist) if nodelist else None,
                    "nproc_per_node": gpus if gpus and gpus.isdigit() else None,
                },
            )
        )
    for prefix, label in (("", "environment"), ("PET_", "environment (PET_*)")):
        layers.append(
            (
                label,
                {
                    "nnodes": environ.get(prefix + "NNODES"),
                    "nproc_per_node": environ.get(prefix + "NPROC_PER_NODE"),
                    "node_rank": environ.get(prefix + "NODE_RANK"),
                    "master_addr": environ.get(prefix + "MASTER_ADDR"),
                    "master_port": environ.get(prefix + "MASTER_PORT"),
                },
            )
        )
    layers.append((f"recipe {recipe.file_of('cluster')}", dict(recipe.cluster)))
    layers.append(
        (
            "default",
            {
                "nnodes": 1,
                "nproc_per_node": 8,
                "node_rank": 0,
                "master_addr": "127.0.0.1",
                "master_port": DEFAULT_MASTER_PORT,
            },
        )
    )
    return layers


def _first_given(layers: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Per key, the first layer's non-empty value and that layer's label."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in _TOPOLOGY_KEYS:
        for label, layer in layers:
            value = layer.get(key)
            if value is not None and value != "":
                values[key] = value
                sources[key] = label
                break
    return values, sources


def _check_layout(values: dict[str, Any], sources: dict[str, str]) -> None:
    """Convert the integer keys in place and check they describe a job this node belongs to."""
    for key in _INTEGER_KEYS:
        try:
            values[key] = int(values[key])
        except (TypeError, ValueError):
            raise RecipeError(f"{key}={values[key]!r} (from {sources[key]}) is not an integer.") from None
    if values["nnodes"] < 1 or values["nproc_per_node"] < 1:
        raise RecipeError(f"nnodes={values['nnodes']} and nproc_per_node={values['nproc_per_node']} must be >= 1.")
    if not 0 <= values["node_rank"] < values["nnodes"]:
        raise RecipeError(
            f"node_rank={values['node_rank']} (from {sources['node_rank']}) is outside 0..{values['nnodes'] - 1} "
            f"for nnodes={values['nnodes']} (from {sources['nnodes']})."
        )


# ================================================================================== fit checks
@dataclass(frozen=True)
class Fit:
    """How a recipe's parallelism and batch divide a world size."""

    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    micro: int
    global_batch: int
    accumulation: int

    def describe(self) -> list[str]:
        return [
            f"world {self.world_size} = TP {self.tp} x PP {self.pp} x CP {self.cp} x DP {self.dp}; "
            f"EP {self.ep} (x ETP {self.etp}) divides DP x CP x TP = {self.dp * self.cp * self.tp}",
            f"global batch {self.global_batch} = micro {self.micro} x DP {self.dp} x accumulation {self.accumulation}",
        ]


def fit_problems(recipe: Recipe, world_size: int) -> list[str]:
    """Every reason ``recipe`` cannot run on ``world_size`` ranks, each with its arithmetic."""
    p = recipe.parallel
    tp, pp, cp, ep, etp = p["tp"], p["pp"], p["cp"], p["ep"], p["etp"]
    batch = recipe.batch
    model = recipe.model
    problems = []
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        problems.append(
            f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {model_parallel}"
        )
        return problems
    dp = world_size // model_parallel
    if (dp * cp * tp) % (ep * etp):
        problems.append(
            f"EP x ETP = {ep} x {etp} = {ep * etp} does not divide DP x CP x TP = {dp} x {cp} x {tp} = {dp * cp * tp} "
            f"(Megatron builds the expert-parallel groups inside each pipeline stage of {world_size // pp} ranks)"
        )
    if model.num_experts % ep:
        problems.append(f"model.num_experts={model.num_experts} is not divisible by EP={ep}")
    per_step = batch["micro"] * dp
    if batch["global"] % per_step:
        problems.append(
            f"global batch {batch['global']} is not divisible by micro batch x DP = "
            f"{batch['micro']} x {dp} = {per_step}"
        )
    return problems


def valid_world_sizes(recipe: Recipe, limit: int = 256) -> list[int]:
    return [w for w in range(1, limit + 1) if not fit_problems(recipe, w)]


def check_fit(recipe: Recipe, world_size: int, how: str = "") -> Fit:
    """The :class:`Fit` of ``recipe`` on ``world_size`` ranks.

    Raises:
        RecipeError: with the arithmetic of every problem and the world sizes that would work.
    """
    problems = fit_problems(recipe, world_size)
    if problems:
        fits = valid_world_sizes(recipe)
        shown = ", ".join(str(w) for w in fits[:12]) + (", ..." if len(fits) > 12 else "")
        raise RecipeError(
            f"{display_path(recipe.path)} does not fit world size {world_size}{' (' + how + ')' if how else ''} "
            f"[parallel: {recipe.file_of('parallel')}, batch: {recipe.file_of('batch')}]:\n  - "
            + "\n  - ".join(problems)
            + f"\nWorld sizes this recipe accepts: {shown or 'none up to 256'}."
        )
    p = recipe.parallel
    dp = world_size // (p["tp"] * p["pp"] * p["cp"])
    batch = recipe.batch
    return Fit(
        world_size=world_size,
        tp=p["tp"],
        pp=p["pp"],
        cp=p["cp"],
        ep=p["ep"],
        etp=p["etp"],
        dp=dp,
        micro=batch["micro"],
        global_batch=batch["global"],
        accumulation=batch["global"] // (batch["micro"] * dp),
    )
