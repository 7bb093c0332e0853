"""``elastic-moe launch RECIPE``: render a recipe's launch command for this node and run it.

::

    elastic-moe launch configs/pretrain/6-10.yaml [--nnodes 2 --nproc-per-node 8 --node-rank R
        --master-addr HOST --master-port P] [--set KEY=VALUE ...] [--dry-run] [-- extra framework args]

- ``swift_sft`` / ``megatron_sft`` recipes run ``swift sft ...`` / ``megatron sft ...`` with
  ``NPROC_PER_NODE``, ``NNODES``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set: ms-swift
  then re-launches itself under torchrun. The plugin is loaded with ``--external_plugins``.
- ``megatron_lm`` recipes run ``torchrun ... -m elastic_moe_plugin.megatron_lm pretrain_gpt.py ...``.
- Every command gets the recipe's ``elastic:`` block as ``ELASTIC_MOE_*`` variables.

Run it once per node (under SLURM: one task per node, see ``scripts/slurm_example.sbatch``); it
reads ``SLURM_NNODES``, ``SLURM_NODEID`` and the first host of ``SLURM_JOB_NODELIST``, or the
``NNODES``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``/``NPROC_PER_NODE`` (or ``PET_*``)
variables, when the flags are not given. It refuses to start when the world size does not fit the
recipe's parallelism or global batch, and says why with the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from elastic_moe_plugin.core.config import ENV_VARS, ElasticConfig
from elastic_moe_plugin.swift import plugin_path
from elastic_moe_plugin.tools.recipes.load import Recipe, RecipeError, display_path, load_recipe


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


DEFAULT_MASTER_PORT = 29500


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
    layers: list[tuple[str, dict[str, Any]]] = [
        ("command line", {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "node_rank": node_rank,
                          "master_addr": master_addr, "master_port": master_port}),
    ]
    if environ.get("SLURM_JOB_ID") and (environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES")):
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        gpus = environ.get("SLURM_GPUS_ON_NODE")
        layers.append(("SLURM", {
            "nnodes": environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES"),
            "node_rank": environ.get("SLURM_NODEID"),
            "master_addr": first_slurm_host(nodelist) if nodelist else None,
            "nproc_per_node": gpus if gpus and gpus.isdigit() else None,
        }))
    for prefix, label in (("", "environment"), ("PET_", "environment (PET_*)")):
        layers.append((label, {
            "nnodes": environ.get(prefix + "NNODES"), "nproc_per_node": environ.get(prefix + "NPROC_PER_NODE"),
            "node_rank": environ.get(prefix + "NODE_RANK"), "master_addr": environ.get(prefix + "MASTER_ADDR"),
            "master_port": environ.get(prefix + "MASTER_PORT"),
        }))
    layers.append((f"recipe {recipe.file_of('cluster')}", dict(recipe.cluster)))
    layers.append(("default", {"nnodes": 1, "nproc_per_node": 8, "node_rank": 0, "master_addr": "127.0.0.1",
                               "master_port": DEFAULT_MASTER_PORT}))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port"):
        for label, layer in layers:
            value = layer.get(key)
            if value is not None and value != "":
                values[key] = value
                sources[key] = label
                break
    for key in ("nnodes", "nproc_per_node", "node_rank", "master_port"):
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
    return Topology(sources=sources, **values)


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
            f"global batch {batch['global']} is not divisible by micro batch x DP = {batch['micro']} x {dp} = {per_step}"
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
    return Fit(world_size=world_size, tp=p["tp"], pp=p["pp"], cp=p["cp"], ep=p["ep"], etp=p["etp"], dp=dp,
               micro=batch["micro"], global_batch=batch["global"],
               accumulation=batch["global"] // (batch["micro"] * dp))


# ================================================================================== rendering
def elastic_environment(config: ElasticConfig) -> dict[str, str]:
    """Every ``ELASTIC_MOE_*`` variable for ``config`` (all fields, so stale variables are overridden).
    ``ElasticConfig.from_env`` of the result equals ``config``."""
    env = {}
    for name, var in ENV_VARS.items():
        value = getattr(config, name)
        if value is None:
            value = {"center": "auto", "layers": "all", "top_p_max_experts": "none"}[name]
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[var] = str(value)
    return env


@dataclass
class LaunchCommand:
    """A rendered launch: ``argv`` run with ``os.environ`` + ``env``; ``notes`` explain it;
    ``prepare`` lists model-override folders to create first (``[(source, overrides, dest)]``)."""

    argv: list[str]
    env: dict[str, str]
    notes: list[str]
    prepare: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)

    def shell(self) -> str:
        """A copy-pasteable shell rendering: comments, ``env VAR=... \\`` lines, then the command
        with one flag (and its values) per line."""
        lines = [f"# {note}" for note in self.notes]
        groups = ["env"] + [f"{k}={_quote(v)}" for k, v in self.env.items()]
        current: list[str] = []
        for word in self.argv:
            if word.startswith("-") and current:
                groups.append(" ".join(current))
                current = []
            current.append(_quote(word))
        if current:
            groups.append(" ".join(current))
        return "\n".join(lines + [" \\\n  ".join(groups)])


def _quote(word: str) -> str:
    """shlex.quote, except that a leading ``$MEGATRON_LM_DIR`` placeholder stays expandable."""
    if word.startswith("$MEGATRON_LM_DIR/"):
        return '"$MEGATRON_LM_DIR"/' + shlex.quote(word[len("$MEGATRON_LM_DIR/"):])
    return shlex.quote(word)


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _swift_flags(recipe: Recipe, flags: Mapping[str, Any]) -> list[str]:
    argv = []
    for key, value in flags.items():
        if value is None:
            continue
        value = recipe.interpolate(value, f"args.{key}")
        if isinstance(value, list):
            if value:
                argv += [f"--{key}"] + [_flag_value(recipe.interpolate(v, f"args.{key}")) for v in value]
            continue
        argv += [f"--{key}", _flag_value(value)]
    return argv


def _megatron_lm_flags(recipe: Recipe, flags: Mapping[str, Any]) -> list[str]:
    argv = []
    for key, value in flags.items():
        if value is None:
            continue
        value = recipe.interpolate(value, f"args.{key}")
        if value is True:
            argv.append(f"--{key}")
        elif value is False:
            raise RecipeError(
                f"{recipe.file_of('args', key)}: args.{key}: false cannot be rendered for Megatron-LM, whose boolean "
                f"flags are switches; delete the key (or set it to null in an overlay)."
            )
        elif isinstance(value, list):
            argv += [f"--{key}"] + [_flag_value(recipe.interpolate(v, f"args.{key}")) for v in value]
        else:
            argv += [f"--{key}", _flag_value(value)]
    return argv


def render(recipe: Recipe, topology: Topology, extra_args: Iterable[str] = (), *,
           megatron_lm_dir: str | None = None) -> LaunchCommand:
    """Render the command that launches ``recipe`` on this node.

    Raises:
        RecipeError: when the world size does not fit the recipe.
    """
    how = (f"{topology.nnodes} node(s) x {topology.nproc_per_node} GPUs, nnodes from {topology.sources.get('nnodes')}, "
           f"nproc_per_node from {topology.sources.get('nproc_per_node')}")
    fit = check_fit(recipe, topology.world_size, how)
    command = LaunchCommand(argv=[], env={}, notes=[
        f"recipe: {display_path(recipe.path)} ({recipe.setting}, launcher {recipe.launcher})"
        + (f": {recipe.description}" if recipe.description else ""),
        *fit.describe(),
        "topology: " + ", ".join(f"{k}={getattr(topology, k)} ({topology.sources.get(k, '?')})"
                                 for k in ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port")),
        f"elastic: {recipe.elastic}",
    ])
    if recipe.launcher in ("swift_sft", "megatron_sft"):
        _render_swift(recipe, topology, fit, command)
    else:
        _render_megatron_lm(recipe, topology, command, megatron_lm_dir)
    command.argv += list(extra_args)
    if topology.nnodes > 1 and topology.sources.get("master_addr") == "default":
        command.notes.append(
            f"WARNING: {topology.nnodes} nodes but master_addr is the default {topology.master_addr}; pass "
            f"--master-addr (node 0's host) or set MASTER_ADDR, or run under SLURM")
    command.env.update(elastic_environment(recipe.elastic))
    command.env.update({k: recipe.interpolate(v, f"env.{k}") for k, v in recipe.env.items()})
    return command


def _render_swift(recipe: Recipe, topology: Topology, fit: Fit, command: LaunchCommand) -> None:
    """``swift sft`` / ``megatron sft`` with ms-swift's torchrun variables."""
    model, batch, args = recipe.model, recipe.batch, recipe.args
    command.env.update({
        "NNODES": str(topology.nnodes), "NODE_RANK": str(topology.node_rank),
        "MASTER_ADDR": topology.master_addr, "MASTER_PORT": str(topology.master_port),
        "NPROC_PER_NODE": str(topology.nproc_per_node),
    })
    model_arg = model.name
    if recipe.launcher == "swift_sft":
        if model.train_topk is not None:
            # ms-swift has no HF-config override flag: train from a copy whose config says k.
            output_dir = recipe.interpolate(args.get("output_dir", "output/${setting}/${recipe}"), "args.output_dir")
            model_arg = str(Path(output_dir) / f"model-top{model.train_topk}")
            command.prepare.append((model.name, {"num_experts_per_tok": model.train_topk}, model_arg))
            command.notes.append(
                f"top-{model.train_topk} control: the launcher first writes {model_arg}/ = {model.name} with config.json "
                f"num_experts_per_tok={model.train_topk} (weights symlinked); evaluate the result with "
                f"num_experts_per_tok={model.topk}"
            )
        head = {"model": model_arg, "per_device_train_batch_size": batch["micro"],
                "gradient_accumulation_steps": fit.accumulation, "max_length": batch["seq_length"]}
        command.argv = ["swift", "sft"]
    else:
        if model.train_topk is not None:
            args["megatron_extra_kwargs"] = {**(args.get("megatron_extra_kwargs") or {}),
                                             "moe_router_topk": model.train_topk}
            command.notes.append(
                f"top-{model.train_topk} control: megatron_extra_kwargs sets moe_router_topk={model.train_topk} for "
                f"training only (the HF config is untouched); evaluate at top-{model.topk}: check that the exported "
                f"checkpoint's config.json says num_experts_per_tok={model.topk}"
            )
        p = recipe.parallel
        head = {"model": model_arg, "tensor_model_parallel_size": p["tp"], "pipeline_model_parallel_size": p["pp"],
                "context_parallel_size": p["cp"], "expert_model_parallel_size": p["ep"],
                "expert_tensor_parallel_size": p["etp"], "micro_batch_size": batch["micro"],
                "global_batch_size": batch["global"], "max_length": batch["seq_length"]}
        command.argv = ["megatron", "sft"]
    plugin = plugin_path()
    command.argv += _swift_flags(recipe, head) + _swift_flags(recipe, args) + ["--external_plugins", str(plugin)]
    cli = "swift/cli/sft.py" if recipe.launcher == "swift_sft" else "swift/cli/_megatron/sft.py"
    command.notes.append(
        f"{command.argv[0]} re-launches itself under: python -m torch.distributed.run --nproc_per_node "
        f"{topology.nproc_per_node} --master_port {topology.master_port} --nnodes {topology.nnodes} "
        f"--node_rank {topology.node_rank} --master_addr {topology.master_addr} {cli} <the flags below>"
    )
    if not plugin.is_file():
        command.notes.append(f"WARNING: the plugin file {plugin} does not exist; a real launch refuses to start")


def _render_megatron_lm(recipe: Recipe, topology: Topology, command: LaunchCommand,
                        megatron_lm_dir: str | None) -> None:
    """``torchrun ... -m elastic_moe_plugin.megatron_lm SCRIPT`` with the architecture rendered from ``model``."""
    model, batch, p = recipe.model, recipe.batch, recipe.parallel
    script = recipe.interpolate(recipe.data["script"], "script")
    base = megatron_lm_dir or os.environ.get("MEGATRON_LM_DIR")
    if os.path.isabs(script):
        script_path = script
    elif base:
        script_path = str(Path(base) / script)
    else:
        script_path = f"$MEGATRON_LM_DIR/{script}"
        command.notes.append("MEGATRON_LM_DIR is not set: pass --megatron-lm-dir (a Megatron-LM core_r0.19 checkout)")
    if model.train_topk is not None:
        command.notes.append(
            f"top-{model.train_topk} control: trains with --moe-router-topk {model.train_topk}; evaluate with "
            f"--moe-router-topk {model.topk} (Megatron-LM takes top-k from the command line, not the checkpoint)"
        )
    if model.vocab_size % p["tp"]:
        raise RecipeError(f"{recipe.file_of('model', 'vocab_size')}: model.vocab_size={model.vocab_size} is not "
                          f"divisible by TP={p['tp']}.")
    gqa = model.num_query_groups < model.num_attention_heads
    structured: dict[str, Any] = {
        "num-layers": model.num_layers, "hidden-size": model.hidden_size,
        "num-attention-heads": model.num_attention_heads,
        "group-query-attention": True if gqa else None, "num-query-groups": model.num_query_groups if gqa else None,
        "kv-channels": model.head_dim, "num-experts": model.num_experts,
        "moe-ffn-hidden-size": model.moe_ffn_hidden_size, "moe-router-topk": model.training_topk,
        "untie-embeddings-and-output-weights": True if model.untied_embeddings else None,
        # Megatron pads the tokenizer's vocabulary up to a multiple of this x TP: with the whole
        # target size here the embedding has exactly model.vocab_size rows.
        "make-vocab-size-divisible-by": model.vocab_size // p["tp"],
        "seq-length": batch["seq_length"], "max-position-embeddings": batch["seq_length"],
        "micro-batch-size": batch["micro"], "global-batch-size": batch["global"],
        "tensor-model-parallel-size": p["tp"], "pipeline-model-parallel-size": p["pp"],
        "context-parallel-size": p["cp"], "expert-model-parallel-size": p["ep"], "expert-tensor-parallel-size": p["etp"],
    }
    command.argv = [
        "torchrun", "--nnodes", str(topology.nnodes), "--nproc-per-node", str(topology.nproc_per_node),
        "--node-rank", str(topology.node_rank), "--master-addr", topology.master_addr,
        "--master-port", str(topology.master_port), "-m", "elastic_moe_plugin.megatron_lm", script_path,
        *_megatron_lm_flags(recipe, structured), *_megatron_lm_flags(recipe, recipe.args),
    ]


def framework_args(command: LaunchCommand) -> list[str]:
    """The flags the framework parses: after ``swift sft`` / ``megatron sft``, or after the
    Megatron-LM script of a torchrun command (the script path itself excluded)."""
    if command.argv[0] in ("swift", "megatron"):
        return command.argv[2:]
    index = command.argv.index("elastic_moe_plugin.megatron_lm")
    return command.argv[index + 2:]


def prepare_model_override(source: str, overrides: Mapping[str, Any], dest: str | os.PathLike[str]) -> Path:
    """Make ``dest`` a copy of the HF checkpoint ``source`` whose ``config.json`` has ``overrides``
    (every other file is symlinked). Idempotent. ``source`` is a local folder or a Hub id
    (downloaded with ``huggingface_hub.snapshot_download``)."""
    src = Path(source)
    if not src.is_dir():
        from huggingface_hub import snapshot_download

        src = Path(snapshot_download(source))
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name == "config.json":
            continue
        link = dest / item.name
        if not link.exists():
            link.symlink_to(item.resolve())
    config = json.loads((src / "config.json").read_text())
    config.update(overrides)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest


# ================================================================================== CLI
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


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe file, or a name under configs/ such as pretrain/6-10")
    _add_options(parser)
    # Everything after RECIPE: more options, then '--' and the framework's own extra flags.
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.usage = ("elastic-moe launch RECIPE [--nnodes N] [--nproc-per-node N] [--node-rank R] "
                    "[--master-addr HOST] [--master-port P] [--set KEY=VALUE] [--dry-run] [-- extra framework args]")


def _split_rest(args: argparse.Namespace) -> list[str]:
    """Parse launch options given after RECIPE; return the framework's extra args (after ``--``)."""
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


def build_command(args: argparse.Namespace, environ=None) -> LaunchCommand:
    extra = _split_rest(args)
    recipe = load_recipe(args.recipe, args.overrides or ())
    topology = resolve_topology(
        recipe, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, environ=environ,
    )
    return render(recipe, topology, extra, megatron_lm_dir=args.megatron_lm_dir)


def run(args: argparse.Namespace) -> int:
    command = build_command(args)
    print(command.shell(), flush=True)
    if args.dry_run:
        return 0
    argv = list(command.argv)
    if any(note.startswith("WARNING: ") and "master_addr is the default" in note for note in command.notes):
        raise RecipeError("a multi-node launch needs node 0's address: pass --master-addr HOST or set MASTER_ADDR "
                          "(under SLURM it is the first host of SLURM_JOB_NODELIST).")
    if argv[0] in ("swift", "megatron"):
        plugin = plugin_path()
        if not plugin.is_file():
            raise RecipeError(f"the ms-swift plugin file {plugin} does not exist; install elastic-moe-plugin[swift].")
        if shutil.which(argv[0]) is None:
            raise RecipeError(f"'{argv[0]}' is not on PATH; install ms-swift (pip install 'ms-swift>=4.6,<4.7').")
    else:
        script = argv[argv.index("elastic_moe_plugin.megatron_lm") + 1]
        if not os.path.isfile(script):
            raise RecipeError(
                f"Megatron-LM script {script} does not exist; pass --megatron-lm-dir or set MEGATRON_LM_DIR to a "
                f"Megatron-LM checkout."
            )
        if shutil.which("torchrun") is None:
            argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    for source, overrides, dest in command.prepare:
        path = prepare_model_override(source, overrides, dest)
        print(f"# prepared {path} ({source} with {overrides})", flush=True)
    result = subprocess.run(argv, env={**os.environ, **command.env})
    return result.returncode
