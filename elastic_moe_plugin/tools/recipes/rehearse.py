"""``elastic-moe launch RECIPE --rehearse``: run a recipe's own launcher here, for a few steps, on a
tiny model of the same family, before the real job is sent to 16 GPUs (docs/recipes.md, "Rehearse
before you allocate").

What runs is the command the recipe renders (:func:`~elastic_moe_plugin.tools.recipes.render.render`),
with the recipe's own flags and its ``ELASTIC_MOE_*`` overlay, through the launcher it names:

- ``swift_sft`` (OLMoE): ``swift sft``, ms-swift's transformers trainer, with the recipe's own engine
  (DeepSpeed ZeRO-2) on 2 CPU ranks, every process under the CPU runtime's engines part
  (:mod:`elastic_moe_plugin.cpu_runtime.engines`, switched on by the child bootstrap,
  :mod:`elastic_moe_plugin.tools.child_bootstrap`, with ``EMOE_BOOTSTRAP=engines``: the recipe's
  ZeRO-2 needs none of it, an overlay's ZeRO-3 or FSDP2 does);
- ``megatron_sft`` (Qwen3): ``megatron sft``, Megatron-SWIFT with mcore-bridge, every process under
  the CPU runtime (:mod:`elastic_moe_plugin.cpu_runtime.megatron_swift`, switched on by the child
  bootstrap on ``PYTHONPATH`` with ``EMOE_BOOTSTRAP=megatron_swift``);
- ``torchtitan`` (pretraining): ``torchrun -m torchtitan.train`` with the recipe's own flags and the
  door in ``--override.imports``, every rank under the CPU runtime for torchtitan
  (:mod:`elastic_moe_plugin.cpu_runtime.titan`, switched on by the child bootstrap with
  ``EMOE_BOOTSTRAP=titan``), on the tiny config of :mod:`.titan_models` of the recipe's variant;
- ``megatron_lm`` (pretraining): torchrun of ``python -m elastic_moe_plugin.megatron_lm SCRIPT``
  (Megatron-LM's ``megatron.training``: the recipe's ``pretrain_gpt.py`` of ``--megatron-lm-dir`` when
  given, else the megatron-core wheel's trainer with this repository's
  ``examples/megatron_lm/pretrain_gpt_moe.py``) with the entry point's own ``--cpu``, which switches
  the CPU runtime on in every rank; the child bootstrap adds host-tensor gradient clipping
  (``EMOE_BOOTSTRAP=grad_clip``), so the recipe keeps its ``--clip-grad``.

Only what cannot apply on this machine is replaced, each replacement printed with its reason
(:class:`Replacement`): the checkpoint by a random one of the same family (router, gate convention,
top-k, and the elastic layer range scaled to 4 layers), the hub dataset and tokenizer by tiny local
ones, the node count and parallel sizes by one node of a few CPU processes, bf16 by float32, GPU-only
kernels (flash attention, grouped GEMM, fused kernels) by their CPU paths, the length of the run by
``--steps``, and the batch's sequence length by the tiny model's. Everything runs in a
fresh work folder (the current directory of the launcher, so the recipe's relative output paths
land there). It exits with the launcher's status on the first error the launcher raises, and
non-zero if the run logged no ``elastic_moe/`` metric for its training steps.

Planning (:func:`plan_rehearsal`) and running (:func:`rehearse`) are here; what is replaced and why
is :mod:`.rehearsal_replacements`, the tiny checkpoint, tokenizer and data :mod:`.rehearsal_assets`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from elastic_moe_plugin.tools import child_bootstrap
from elastic_moe_plugin.tools.recipes.load import load_recipe
from elastic_moe_plugin.tools.recipes.recipe import Recipe, display_path
from elastic_moe_plugin.tools.recipes.rehearsal_assets import write_tiny_assets
from elastic_moe_plugin.tools.recipes.rehearsal_replacements import (
    TINY_LAYERS,
    Replacement,
    tiny_settings,
)
from elastic_moe_plugin.tools.recipes.render import LaunchCommand, render
from elastic_moe_plugin.tools.recipes.render_titan import torchtitan_problem
from elastic_moe_plugin.tools.recipes.schema import RecipeError
from elastic_moe_plugin.tools.recipes.topology import Topology

__all__ = [
    "DEFAULT_STEPS",
    "TINY_LAYERS",
    "Rehearsal",
    "Replacement",
    "plan_rehearsal",
    "rehearse",
]

DEFAULT_STEPS = 3
MEGATRON_LM_ENTRY = "elastic_moe_plugin.megatron_lm"
#: what the child bootstrap switches on in every process of a rehearsal, per launcher
BOOTSTRAP_FEATURES = {
    "swift_sft": ("engines",),
    "megatron_sft": ("megatron_swift",),
    "megatron_lm": ("grad_clip",),
    "torchtitan": ("titan",),
}
#: the door's console line of a logged step (``elastic_moe_plugin.titan.trainer.logging_metrics``)
TITAN_STEP_LINE = re.compile(r"elastic-moe: step (\d+): .*mean_kappa")


@dataclass
class Rehearsal:
    """A planned rehearsal: the recipe as it runs here, the command, and what was replaced."""

    original: Recipe
    recipe: Recipe
    command: LaunchCommand
    replacements: list[Replacement]
    work: Path
    steps: int
    assets: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [
            f"# rehearsal of {display_path(self.original.path)} ({self.original.launcher}) in {self.work}: "
            f"{self.steps} steps on this machine; replaced, because they cannot apply here:"
        ]
        lines += [f"#   {item.describe()}" for item in self.replacements]
        return "\n".join(lines)


# ================================================================================== planning
def plan_rehearsal(
    recipe_path: str | os.PathLike[str],
    overrides: Iterable[str] = (),
    *,
    steps: int = DEFAULT_STEPS,
    work_dir: str | os.PathLike[str] | None = None,
    megatron_lm_dir: str | None = None,
    nproc: int | None = None,
    extra_args: Iterable[str] = (),
    build_assets: bool = True,
) -> Rehearsal:
    """Plan the rehearsal of a recipe: build its tiny assets in ``work_dir`` (a fresh temporary folder
    when None), scale the recipe and render its command.

    Raises:
        RecipeError: the recipe (with ``overrides``) is invalid, or its family cannot be rehearsed.
    """
    if steps < 1:
        raise RecipeError(f"--steps {steps}: a rehearsal trains at least 1 step, e.g. --steps {DEFAULT_STEPS}.")
    original = load_recipe(recipe_path, overrides)
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix=f"rehearse_{original.setting}_"))
    work = work.resolve()
    if work.exists() and any(work.iterdir()):
        raise RecipeError(
            f"--rehearse-dir {work} is not empty; a rehearsal starts in a fresh folder (it would resume "
            f"from a checkpoint left there)."
        )
    work.mkdir(parents=True, exist_ok=True)
    tiny = tiny_settings(original, work, steps, nproc, megatron_lm_dir)
    recipe = load_recipe(recipe_path, [*overrides, *tiny.overrides])
    assets = write_tiny_assets(recipe, tiny.family, work, steps) if build_assets else {}
    topology = Topology(
        nnodes=1,
        nproc_per_node=tiny.world,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=_free_port(),
        sources=dict.fromkeys(("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port"), "rehearsal"),
    )
    command = render(recipe, topology, list(extra_args), megatron_lm_dir=megatron_lm_dir)
    _adapt_command(command, recipe, work)
    return Rehearsal(original, recipe, command, tiny.replacements, work, steps, assets)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _adapt_command(command: LaunchCommand, recipe: Recipe, work: Path) -> None:
    """The rendered command as it runs here: CPU-only environment, offline, the CPU runtime's entry."""
    env = command.env
    env.update(
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        TORCH_COMPILE_DISABLE="1",
        PYTHONUNBUFFERED="1",
        HF_DATASETS_CACHE=str(work / "cache" / "hf_datasets"),
        MODELSCOPE_CACHE=str(work / "cache" / "modelscope"),
    )
    features = BOOTSTRAP_FEATURES.get(recipe.launcher)
    if features:
        env.update(child_bootstrap.environment(features, os.environ.get("PYTHONPATH")))
    if recipe.launcher == "swift_sft":
        command.notes.append(
            f"CPU runtime: {child_bootstrap.directory()} first on PYTHONPATH with "
            f"{child_bootstrap.BOOTSTRAP_ENV}=engines switches elastic_moe_plugin.cpu_runtime.engines on in every "
            "process swift sft starts (DeepSpeed's zero.Init and FSDP2 on CPU ranks over gloo)"
        )
    elif recipe.launcher == "megatron_sft":
        command.notes.append(
            f"CPU runtime: {child_bootstrap.directory()} first on PYTHONPATH with "
            f"{child_bootstrap.BOOTSTRAP_ENV}=megatron_swift switches elastic_moe_plugin.cpu_runtime.megatron_swift "
            "on in every process megatron sft starts"
        )
    elif recipe.launcher == "torchtitan":
        argv = command.argv
        argv[: argv.index("--nnodes")] = [sys.executable, "-m", "torch.distributed.run"]
        command.notes.append(
            f"CPU runtime: {child_bootstrap.directory()} first on PYTHONPATH with "
            f"{child_bootstrap.BOOTSTRAP_ENV}=titan switches elastic_moe_plugin.cpu_runtime.titan on in every rank "
            "torchrun starts (device cpu, gloo, FlexAttention and the grouped GEMM on the CPU)"
        )
    elif recipe.launcher == "megatron_lm":
        argv = command.argv
        argv.insert(argv.index(MEGATRON_LM_ENTRY) + 1, "--cpu")
        argv[: argv.index("--nnodes")] = [sys.executable, "-m", "torch.distributed.run"]
        command.notes.append(
            f"CPU runtime: -m {MEGATRON_LM_ENTRY} --cpu (the recipe's entry point, its CPU flag) switches "
            f"elastic_moe_plugin.cpu_runtime on in every rank; {child_bootstrap.directory()} first on PYTHONPATH "
            f"with {child_bootstrap.BOOTSTRAP_ENV}=grad_clip adds gradient clipping on host tensors, so the "
            "recipe keeps its --clip-grad"
        )


# ================================================================================== running
def rehearse(rehearsal: Rehearsal) -> int:
    """Run a planned rehearsal, streaming the launcher's output; its exit status, or 1 when it
    finished without logging ``elastic_moe/`` metrics for its training steps."""
    command = rehearsal.command
    argv = list(command.argv)
    if rehearsal.original.launcher == "torchtitan":
        problem = torchtitan_problem()
        if problem:
            raise RecipeError(f"{problem}.")
    if argv[0] in ("swift", "megatron"):
        found = shutil.which(argv[0]) or str(Path(sys.executable).with_name(argv[0]))
        if not Path(found).exists():
            raise RecipeError(f"'{argv[0]}' is not on PATH; install ms-swift (pip install 'ms-swift>=4.6,<4.7').")
        argv[0] = found
    for source, overrides, dest in command.prepare:
        from elastic_moe_plugin.tools.recipes.render import prepare_model_override

        prepare_model_override(source, overrides, rehearsal.work / dest)
    process = subprocess.Popen(
        argv,
        cwd=rehearsal.work,
        env={**os.environ, **command.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    )
    output: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(line)
        output.append(line)
    returncode = process.wait()
    if returncode != 0:
        print(
            f"rehearsal: the launcher exited with status {returncode} (its error is above); the recipe would fail "
            f"the same way on the cluster.",
            flush=True,
        )
        return returncode
    logged = _logged_metrics(rehearsal, "".join(output))
    if logged < rehearsal.steps:
        print(
            f"rehearsal: {logged} of {rehearsal.steps} training steps logged elastic_moe/ metrics: the plugin did not "
            f"log routing metrics (is it loaded?).",
            flush=True,
        )
        return 1
    through = {"megatron_lm": "Megatron-LM", "torchtitan": "torchtitan"}.get(rehearsal.original.launcher, argv[0])
    print(
        f"rehearsal: OK: {rehearsal.steps} steps of {display_path(rehearsal.original.path)} through {through}, "
        f"elastic_moe/ metrics logged at every step; work folder {rehearsal.work}",
        flush=True,
    )
    return 0


def _logged_metrics(rehearsal: Rehearsal, output: str) -> int:
    """How many training steps logged an ``elastic_moe/`` metric."""
    if rehearsal.recipe.launcher == "megatron_lm":
        return sum(1 for line in output.splitlines() if " iteration " in line and "elastic_moe/" in line)
    if rehearsal.recipe.launcher == "torchtitan":  # every rank logs the line: count the steps
        return len({match.group(1) for match in TITAN_STEP_LINE.finditer(output)})
    steps = 0
    for path in rehearsal.work.rglob("logging.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "loss" in row and "train_runtime" not in row and any(k.startswith("elastic_moe/") for k in row):
                steps += 1
    return steps
