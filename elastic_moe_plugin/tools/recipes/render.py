"""Render a recipe into this node's launch command (``swift sft``, ``megatron sft``,
``torchrun ... -m elastic_moe_plugin.megatron_lm SCRIPT`` or ``torchrun ... -m torchtitan.train``,
:mod:`.render_titan`) with its ``ELASTIC_MOE_*`` environment, and run it (docs/recipes.md,
"Launching")."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.config import ENV_VARS, ElasticConfig
from elastic_moe_plugin.swift import plugin_path
from elastic_moe_plugin.swift.plugin_flag import OFF_SWITCH, hook_installed, rewrite
from elastic_moe_plugin.tools.recipes.recipe import Recipe, display_path
from elastic_moe_plugin.tools.recipes.render_titan import ENTRY as TITAN_ENTRY
from elastic_moe_plugin.tools.recipes.render_titan import render_torchtitan, torchtitan_problem
from elastic_moe_plugin.tools.recipes.schema import RecipeError
from elastic_moe_plugin.tools.recipes.topology import Fit, Topology, check_fit, torchrun_argv


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
        return '"$MEGATRON_LM_DIR"/' + shlex.quote(word[len("$MEGATRON_LM_DIR/") :])
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


def render(
    recipe: Recipe,
    topology: Topology,
    extra_args: Iterable[str] = (),
    *,
    megatron_lm_dir: str | None = None,
    plugin_form: str = "auto",
) -> LaunchCommand:
    """Render the command that launches ``recipe`` on this node.

    ``plugin_form`` (ms-swift launchers): ``"plugin"`` renders ``--plugin elastic_moe``,
    ``"path"`` ``--external_plugins FILE --callbacks elastic_moe``; ``"auto"`` the first where this
    environment has the start-up hook (:func:`~elastic_moe_plugin.swift.plugin_flag.hook_installed`).

    Raises:
        RecipeError: when the world size does not fit the recipe.
    """
    how = (
        f"{topology.nnodes} node(s) x {topology.nproc_per_node} GPUs, nnodes from {topology.sources.get('nnodes')}, "
        f"nproc_per_node from {topology.sources.get('nproc_per_node')}"
    )
    fit = check_fit(recipe, topology.world_size, how)
    command = LaunchCommand(
        argv=[],
        env={},
        notes=[
            f"recipe: {display_path(recipe.path)} ({recipe.setting}, launcher {recipe.launcher})"
            + (f": {recipe.description}" if recipe.description else ""),
            *fit.describe(),
            "topology: "
            + ", ".join(
                f"{k}={getattr(topology, k)} ({topology.sources.get(k, '?')})"
                for k in ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port")
            ),
            f"elastic: {recipe.elastic}",
        ],
    )
    if recipe.launcher in ("swift_sft", "megatron_sft"):
        if plugin_form not in ("auto", "plugin", "path"):
            raise ValueError(f"plugin_form={plugin_form!r}: expected 'auto', 'plugin' or 'path'.")
        _render_swift(recipe, topology, fit, command, plugin_form)
    elif recipe.launcher == "torchtitan":
        command.argv, notes = render_torchtitan(recipe, topology, fit)
        command.notes += notes
    else:
        _render_megatron_lm(recipe, topology, command, megatron_lm_dir)
    command.argv += list(extra_args)
    if topology.nnodes > 1 and topology.sources.get("master_addr") == "default":
        command.notes.append(
            f"WARNING: {topology.nnodes} nodes but master_addr is the default {topology.master_addr}; pass "
            f"--master-addr (node 0's host) or set MASTER_ADDR, or run under SLURM"
        )
    command.env.update(elastic_environment(recipe.elastic))
    command.env.update({k: recipe.interpolate(v, f"env.{k}") for k, v in recipe.env.items()})
    return command


def _render_swift(recipe: Recipe, topology: Topology, fit: Fit, command: LaunchCommand, plugin_form: str) -> None:
    """``swift sft`` / ``megatron sft`` with ms-swift's torchrun variables."""
    model, batch, args = recipe.model, recipe.batch, recipe.args
    command.env.update(
        {
            "NNODES": str(topology.nnodes),
            "NODE_RANK": str(topology.node_rank),
            "MASTER_ADDR": topology.master_addr,
            "MASTER_PORT": str(topology.master_port),
            "NPROC_PER_NODE": str(topology.nproc_per_node),
        }
    )
    model_arg = model.name
    if recipe.launcher == "swift_sft":
        if model.train_topk is not None:
            # ms-swift has no HF-config override flag: train from a copy whose config says k.
            output_dir = recipe.interpolate(args.get("output_dir", "output/${setting}/${recipe}"), "args.output_dir")
            model_arg = str(Path(output_dir) / f"model-top{model.train_topk}")
            command.prepare.append((model.name, {"num_experts_per_tok": model.train_topk}, model_arg))
            command.notes.append(
                f"top-{model.train_topk} control: the launcher first writes {model_arg}/ = {model.name} with "
                f"config.json num_experts_per_tok={model.train_topk} (weights symlinked); evaluate the result with "
                f"num_experts_per_tok={model.topk}"
            )
        head = {
            "model": model_arg,
            "per_device_train_batch_size": batch["micro"],
            "gradient_accumulation_steps": fit.accumulation,
            "max_length": batch["seq_length"],
        }
        command.argv = ["swift", "sft"]
    else:
        if model.train_topk is not None:
            args["megatron_extra_kwargs"] = {
                **(args.get("megatron_extra_kwargs") or {}),
                "moe_router_topk": model.train_topk,
            }
            command.notes.append(
                f"top-{model.train_topk} control: megatron_extra_kwargs sets moe_router_topk={model.train_topk} for "
                f"training only (the HF config is untouched); evaluate at top-{model.topk}: check that the exported "
                f"checkpoint's config.json says num_experts_per_tok={model.topk}"
            )
        p = recipe.parallel
        head = {
            "model": model_arg,
            "tensor_model_parallel_size": p["tp"],
            "pipeline_model_parallel_size": p["pp"],
            "context_parallel_size": p["cp"],
            "expert_model_parallel_size": p["ep"],
            "expert_tensor_parallel_size": p["etp"],
            "micro_batch_size": batch["micro"],
            "global_batch_size": batch["global"],
            "max_length": batch["seq_length"],
        }
        command.argv = ["megatron", "sft"]
    plugin = plugin_path()
    flags = _swift_flags(recipe, head) + _swift_flags(recipe, args) + ["--plugin", "elastic_moe"]
    if plugin_form == "plugin" or (plugin_form == "auto" and hook_installed()):
        command.notes.append(
            "the plugin: --plugin elastic_moe (ms-swift has no such flag; the start-up hook of this "
            "install turns it into --external_plugins <plugin file> --callbacks elastic_moe on every "
            "rank, docs/swift.md)"
        )
    else:
        # The same rewrite the hook makes, done here: this environment has no hook (an editable
        # install of a checkout, or the off switch), so the command carries ms-swift's own flags.
        flags = rewrite(flags, "sft").argv
        command.notes.append(
            f"the plugin: --external_plugins {plugin} --callbacks elastic_moe (the path form: this "
            f"environment has no --plugin start-up hook: an editable install, or {OFF_SWITCH}=0)"
        )
    command.argv += flags
    cli = "swift/cli/sft.py" if recipe.launcher == "swift_sft" else "swift/cli/_megatron/sft.py"
    command.notes.append(
        f"{command.argv[0]} re-launches itself under: python -m torch.distributed.run --nproc_per_node "
        f"{topology.nproc_per_node} --master_port {topology.master_port} --nnodes {topology.nnodes} "
        f"--node_rank {topology.node_rank} --master_addr {topology.master_addr} {cli} <the flags below>"
    )
    if not plugin.is_file():
        command.notes.append(f"WARNING: the plugin file {plugin} does not exist; a real launch refuses to start")


def _render_megatron_lm(
    recipe: Recipe, topology: Topology, command: LaunchCommand, megatron_lm_dir: str | None
) -> None:
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
        raise RecipeError(
            f"{recipe.file_of('model', 'vocab_size')}: model.vocab_size={model.vocab_size} is not "
            f"divisible by TP={p['tp']}."
        )
    gqa = model.num_query_groups < model.num_attention_heads
    structured: dict[str, Any] = {
        "num-layers": model.num_layers,
        "hidden-size": model.hidden_size,
        "num-attention-heads": model.num_attention_heads,
        "group-query-attention": True if gqa else None,
        "num-query-groups": model.num_query_groups if gqa else None,
        "kv-channels": model.head_dim,
        "num-experts": model.num_experts,
        "moe-ffn-hidden-size": model.moe_ffn_hidden_size,
        "moe-router-topk": model.training_topk,
        "untie-embeddings-and-output-weights": True if model.untied_embeddings else None,
        # Megatron pads the tokenizer's vocabulary up to a multiple of this x TP: with the whole
        # target size here the embedding has exactly model.vocab_size rows.
        "make-vocab-size-divisible-by": model.vocab_size // p["tp"],
        "seq-length": batch["seq_length"],
        "max-position-embeddings": batch["seq_length"],
        "micro-batch-size": batch["micro"],
        "global-batch-size": batch["global"],
        "tensor-model-parallel-size": p["tp"],
        "pipeline-model-parallel-size": p["pp"],
        "context-parallel-size": p["cp"],
        "expert-model-parallel-size": p["ep"],
        "expert-tensor-parallel-size": p["etp"],
    }
    command.argv = [
        *torchrun_argv(topology, "elastic_moe_plugin.megatron_lm"),
        script_path,
        *_megatron_lm_flags(recipe, structured),
        *_megatron_lm_flags(recipe, recipe.args),
    ]


def framework_args(command: LaunchCommand) -> list[str]:
    """The flags the framework parses: after ``swift sft`` / ``megatron sft``, after ``-m
    torchtitan.train``, or after the Megatron-LM script of a torchrun command (the script path
    itself excluded)."""
    if command.argv[0] in ("swift", "megatron"):
        return command.argv[2:]
    if TITAN_ENTRY in command.argv:
        return command.argv[command.argv.index(TITAN_ENTRY) + 1 :]
    index = command.argv.index("elastic_moe_plugin.megatron_lm") + 1
    if command.argv[index] == "--cpu":  # the entry point's own flag, before the script (a rehearsal)
        index += 1
    return command.argv[index + 1 :]


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


# ================================================================================== running
def launch(command: LaunchCommand) -> int:
    """Run a rendered ``command`` on this node (after the checks a dry run skips and the
    ``prepare`` steps); its exit status.

    Raises:
        RecipeError: when the launch cannot start (no master address for several nodes, no plugin
            file, the framework or the Megatron-LM script missing).
    """
    argv = _runnable_argv(command)
    for source, overrides, dest in command.prepare:
        path = prepare_model_override(source, overrides, dest)
        print(f"# prepared {path} ({source} with {overrides})", flush=True)
    result = subprocess.run(argv, env={**os.environ, **command.env})
    return result.returncode


def _runnable_argv(command: LaunchCommand) -> list[str]:
    """``command.argv`` once everything it starts exists; ``torchrun`` becomes
    ``python -m torch.distributed.run`` where only the module is installed."""
    argv = list(command.argv)
    if any(note.startswith("WARNING: ") and "master_addr is the default" in note for note in command.notes):
        raise RecipeError(
            "a multi-node launch needs node 0's address: pass --master-addr HOST or set MASTER_ADDR "
            "(under SLURM it is the first host of SLURM_JOB_NODELIST)."
        )
    if argv[0] in ("swift", "megatron"):
        plugin = plugin_path()
        if not plugin.is_file():
            raise RecipeError(f"the ms-swift plugin file {plugin} does not exist; install elastic-moe-plugin[swift].")
        if shutil.which(argv[0]) is None:
            raise RecipeError(f"'{argv[0]}' is not on PATH; install ms-swift (pip install 'ms-swift>=4.6,<4.7').")
    elif TITAN_ENTRY in argv:
        problem = torchtitan_problem()
        if problem:
            raise RecipeError(f"{problem}.")
        if shutil.which("torchrun") is None:
            argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    else:
        script = argv[argv.index("elastic_moe_plugin.megatron_lm") + 1]
        if not os.path.isfile(script):
            raise RecipeError(
                f"Megatron-LM script {script} does not exist; pass --megatron-lm-dir or set MEGATRON_LM_DIR to a "
                f"Megatron-LM checkout."
            )
        if shutil.which("torchrun") is None:
            argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    return argv
