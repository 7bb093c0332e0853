"""``elastic-moe launch RECIPE --rehearse``: run a recipe's own launcher here, for a few steps, on a
tiny model of the same family, before the real job is sent to 16 GPUs (docs/recipes.md, "Rehearse
before you allocate").

What runs is the command the recipe renders (:func:`~elastic_moe_plugin.tools.recipes.render.render`),
with the recipe's own flags and its ``ELASTIC_MOE_*`` overlay, through the launcher it names:

- ``swift_sft`` (OLMoE): ``swift sft``, ms-swift's transformers trainer;
- ``megatron_sft`` (Qwen3): ``megatron sft``, Megatron-SWIFT with mcore-bridge, every process under
  the CPU runtime (:mod:`elastic_moe_plugin.cpu_runtime.megatron_swift`, switched on by the start-up
  bootstrap :func:`cpu_bootstrap_dir` on ``PYTHONPATH``);
- ``megatron_lm`` (pretraining): torchrun of ``python -m elastic_moe_plugin.megatron_lm SCRIPT``
  (Megatron-LM's ``megatron.training``: the recipe's ``pretrain_gpt.py`` of ``--megatron-lm-dir`` when
  given, else the megatron-core wheel's trainer with this repository's
  ``examples/megatron_lm/pretrain_gpt_moe.py``), through
  :mod:`elastic_moe_plugin.tools.recipes.megatron_lm_cpu`, which switches the CPU runtime on first.

Only what cannot apply on this machine is replaced, each replacement printed with its reason
(:class:`Replacement`): the checkpoint by a random one of the same family (router, gate convention,
top-k, and the elastic layer range scaled to 4 layers), the hub dataset and tokenizer by tiny local
ones, the node count and parallel sizes by one node of a few CPU processes, bf16 by float32, GPU-only
kernels (flash attention, grouped GEMM, fused kernels, DeepSpeed) by their CPU paths, the length of
the run by ``--steps``, and the batch's sequence length by the tiny model's. Everything runs in a
fresh work folder (the current directory of the launcher, so the recipe's relative output paths
land there). It exits with the launcher's status on the first error the launcher raises, and
non-zero if the run logged no ``elastic_moe/`` metric for its training steps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.config import parse_layers
from elastic_moe_plugin.tools.recipes.load import load_recipe
from elastic_moe_plugin.tools.recipes.recipe import Recipe, display_path
from elastic_moe_plugin.tools.recipes.render import LaunchCommand, render
from elastic_moe_plugin.tools.recipes.schema import RecipeError
from elastic_moe_plugin.tools.recipes.topology import Topology

__all__ = [
    "DEFAULT_STEPS",
    "TINY_LAYERS",
    "Rehearsal",
    "Replacement",
    "cpu_bootstrap_dir",
    "plan_rehearsal",
    "rehearse",
]

DEFAULT_STEPS = 3
TINY_LAYERS = 4
TINY_HIDDEN, TINY_HEADS, TINY_HEAD_DIM, TINY_EXPERT_FFN = 64, 4, 16, 32
SEQ_LENGTH = 256
MEGATRON_LM_ENTRY = "elastic_moe_plugin.megatron_lm"
MEGATRON_LM_CPU_ENTRY = "elastic_moe_plugin.tools.recipes.megatron_lm_cpu"
_REPO_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "megatron_lm" / "pretrain_gpt_moe.py"


def cpu_bootstrap_dir() -> Path:
    """The folder whose ``sitecustomize`` switches the Megatron-SWIFT CPU runtime on at interpreter
    start (``elastic_moe_plugin/tools/recipes/cpu_bootstrap``): first on ``PYTHONPATH`` of a CPU
    ``megatron sft``, it reaches every process the launcher starts."""
    return Path(__file__).resolve().parent / "cpu_bootstrap"


@dataclass(frozen=True)
class Replacement:
    """One setting the rehearsal changes: the recipe's key, its value there (``None``: not set),
    the rehearsal's (``None``: removed), and why it cannot apply here."""

    key: str
    recipe: Any
    rehearsal: Any
    reason: str

    def describe(self) -> str:
        was = "unset" if self.recipe is None else _short(self.recipe)
        now = "removed" if self.rehearsal is None else _short(self.rehearsal)
        return f"{self.key}: {was} -> {now}  ({self.reason})"


def _short(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, bool)) else str(value)
    return text if len(text) <= 90 else text[:87] + "..."


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
def _family(recipe: Recipe) -> str | None:
    """The transformers family of the recipe's checkpoint (``None``: Megatron-LM builds its GPT)."""
    if recipe.launcher == "megatron_lm":
        return None
    hints = f"{recipe.args.get('model_type', '')} {recipe.model.name}".lower()
    if "olmoe" in hints:
        return "olmoe"
    if "qwen3" in hints:
        return "qwen3_moe"
    raise RecipeError(
        f"{recipe.file_of('model', 'name')}: model.name={recipe.model.name!r}: the rehearsal builds tiny "
        f"OLMoE and Qwen3-MoE checkpoints only; rehearse a recipe of one of those families."
    )


def _scaled_layers(spec: str | None, depth: int) -> str | None:
    """``spec`` (0-based layers of a ``depth``-layer model) mapped onto :data:`TINY_LAYERS` layers."""
    if spec is None:
        return None
    scaled = sorted({index * TINY_LAYERS // depth for index in parse_layers(spec)})
    runs, start = [], scaled[0]
    for previous, current in zip(scaled, scaled[1:] + [None]):
        if current != previous + 1:
            runs.append(f"{start}-{previous}" if previous != start else f"{start}")
            start = current
    return ",".join(runs)


class _Plan:
    """Collects the ``--set`` overrides of the tiny recipe and the replacements shown to the user."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.overrides: list[str] = []
        self.replacements: list[Replacement] = []

    def set(self, key: str, value: Any, reason: str, *, show: bool = True) -> None:
        try:
            old = self.recipe.get(key)
        except KeyError:
            old = None
        if old == value:
            return
        self.overrides.append(f"{key}={json.dumps(value) if value is not None else ''}")
        if show:
            self.replacements.append(Replacement(key, old, value, reason))

    def drop(self, key: str, reason: str) -> None:
        try:
            self.recipe.get(key)
        except KeyError:
            return
        self.set(key, None, reason)


def _tiny_model(plan: _Plan, model_dir: str) -> dict[str, Any]:
    model = plan.recipe.model
    topk = max(model.topk, model.training_topk)
    gqa = model.num_query_groups < model.num_attention_heads
    tiny = {
        "name": model_dir,
        "num_layers": TINY_LAYERS,
        "hidden_size": TINY_HIDDEN,
        "num_attention_heads": TINY_HEADS,
        "num_query_groups": TINY_HEADS // 2 if gqa else TINY_HEADS,
        "head_dim": TINY_HEAD_DIM,
        "num_experts": max(16, 2 * topk),
        "moe_ffn_hidden_size": TINY_EXPERT_FFN,
        "vocab_size": _vocab_size(),
    }
    for key, value in tiny.items():
        plan.set(f"model.{key}", value, "", show=False)
    plan.replacements.append(
        Replacement(
            "model",
            f"{model.name}: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_experts} experts",
            f"{model_dir}: {TINY_LAYERS} layers, hidden {TINY_HIDDEN}, {tiny['num_experts']} experts, top-{model.topk}"
            + (f" (trained at top-{model.train_topk})" if model.train_topk else ""),
            "the real checkpoint needs GPUs and the hub; a random one of the same family, router, gate convention and "
            "top-k, built here",
        )
    )
    layers = plan.recipe.elastic.layers
    if layers is not None:
        plan.set(
            "elastic.layers",
            _scaled_layers(layers, model.num_layers),
            f"the recipe's layer range on {model.num_layers} layers, scaled to the tiny model's {TINY_LAYERS}",
        )
    return tiny


def _vocab_size() -> int:
    from elastic_moe_plugin.tools.recipes.tiny_assets import VOCAB

    return VOCAB


def _tiny_layout(plan: _Plan, nproc: int | None) -> int:
    parallel = plan.recipe.parallel
    pp, ep = min(parallel["pp"], 2), min(parallel["ep"], 2)
    for key, value in (("tp", 1), ("cp", 1), ("etp", 1), ("pp", pp), ("ep", ep)):
        plan.set(f"parallel.{key}", value, "", show=False)
    world = nproc if nproc is not None else pp * ep
    changed = {
        k: (parallel[k], v) for k, v in (("tp", 1), ("pp", pp), ("cp", 1), ("ep", ep), ("etp", 1)) if parallel[k] != v
    }
    if changed or world != plan.recipe.cluster.get("nnodes", 1) * plan.recipe.cluster.get("nproc_per_node", 1):
        plan.replacements.append(
            Replacement(
                "cluster/parallel",
                f"{plan.recipe.cluster.get('nnodes', 1)} node(s) x {plan.recipe.cluster.get('nproc_per_node', 1)} GPUs, "
                + ", ".join(f"{k}={parallel[k]}" for k in ("tp", "pp", "cp", "ep", "etp")),
                f"1 node x {world} CPU processes (gloo), "
                + ", ".join(f"{k}={v}" for k, v in (("tp", 1), ("pp", pp), ("cp", 1), ("ep", ep), ("etp", 1))),
                "no GPUs here; the same kinds of parallelism, each at most 2-way",
            )
        )
    return world


def _tiny_batch(plan: _Plan) -> None:
    plan.set("batch.seq_length", SEQ_LENGTH, "the tiny model's context; the recipe's length only scales the cost")


def _swift_args(plan: _Plan, dataset: str, steps: int, world: int) -> None:
    plan.set("args.dataset", [dataset], "a hub dataset; a tiny local chat dataset of the same messages schema")
    plan.set("args.check_model", False, "ms-swift asks the hub whether the model is the latest; offline here")
    plan.set("args.torch_dtype", "float32", "bf16 weights are a GPU choice")
    plan.set("args.bf16", False, "bf16 mixed precision is a GPU choice")
    plan.set("args.dataset_num_proc", 1, "one preprocessing process per core of a small machine")
    plan.drop("args.num_train_epochs", f"the rehearsal trains {steps} steps")


def _olmoe_args(plan: _Plan, dataset: str, steps: int, world: int) -> None:
    _swift_args(plan, dataset, steps, world)
    plan.set("args.max_steps", steps, "the rehearsal's length (--steps)")
    plan.set("args.attn_impl", "sdpa", "flash attention is GPU-only")
    plan.set("args.packing", False, "packing needs flash attention (ms-swift checks it)")
    plan.drop("args.deepspeed", "DeepSpeed ZeRO needs CUDA; plain data parallelism here")
    plan.set("args.dataloader_num_workers", 0, "data loader workers of a small machine")
    if world > 1:
        plan.set("args.ddp_backend", "gloo", "NCCL is GPU-only")


def _megatron_sft_args(plan: _Plan, dataset: str, steps: int, world: int) -> None:
    from elastic_moe_plugin.cpu_runtime.megatron_swift import CPU_FLAGS

    _swift_args(plan, dataset, steps, world)
    plan.set("args.model_type", "qwen3_moe", "a local checkpoint has no hub id for ms-swift to match")
    plan.set("args.train_iters", steps, "the rehearsal's length (--steps)")
    plan.set("args.dataloader_num_workers", 0, "data loader workers of a small machine")
    for flag, (value, reason) in CPU_FLAGS.items():
        if flag in ("torch_dtype", "bf16"):
            continue  # set above
        parsed = json.loads(value) if flag == "megatron_extra_kwargs" else _typed(value)
        if flag == "megatron_extra_kwargs":
            parsed = {**(plan.recipe.args.get(flag) or {}), **parsed}
        plan.set(f"args.{flag}", parsed, reason)


def _typed(text: str) -> Any:
    return {"true": True, "false": False}.get(text, text)


def _megatron_lm_args(plan: _Plan, tokenizer: str, steps: int, script: str | None) -> None:
    args = plan.recipe.args
    plan.set("args.tokenizer-model", tokenizer, "a hub tokenizer; the tiny local one (same tokenizer type)")
    plan.set("args.train-iters", steps, "the rehearsal's length (--steps)")
    warmup = args.get("lr-warmup-iters")
    if warmup is not None and warmup >= steps:
        plan.set(
            "args.lr-warmup-iters",
            steps - 1,
            "warmup must end within the rehearsal's steps (Megatron-LM asserts warmup < decay iterations)",
        )
    if (args.get("log-interval") or 1) > 1:
        plan.set(
            "args.log-interval",
            1,
            "the recipe logs every 10 iterations, after the rehearsal's last step; log "
            "every step so the routing metrics of each show",
        )
    if (args.get("eval-iters") or 0) > 1:
        plan.set("args.eval-iters", 1, "one validation batch exercises the path; a full pass outlasts the rehearsal")
    plan.drop("args.bf16", "bf16 is a GPU precision")
    plan.drop(
        "args.moe-grouped-gemm",
        "grouped GEMM kernels are GPU-only (the local implementation builds SequentialMLP experts)",
    )
    plan.drop("args.use-distributed-optimizer", "the distributed optimizer's buffers need CUDA")
    plan.drop("args.overlap-grad-reduce", "overlapped gradient reduction needs CUDA streams")
    plan.drop("args.overlap-param-gather", "needs the distributed optimizer")
    cpu = {
        "distributed-backend": ("gloo", "NCCL is GPU-only"),
        "transformer-impl": ("local", "Transformer Engine is GPU-only"),
        "use-cpu-initialization": (True, "weights initialised on the host"),
        "no-gradient-accumulation-fusion": (True, "the fused wgrad accumulation is an apex/CUDA kernel"),
        "no-persist-layer-norm": (True, "the persistent LayerNorm kernel is apex/CUDA"),
        "no-bias-swiglu-fusion": (True, "the fused bias-SwiGLU is a CUDA kernel"),
        "no-rope-fusion": (True, "the fused RoPE is a Transformer Engine kernel"),
        "no-masked-softmax-fusion": (True, "the fused masked softmax is a CUDA kernel"),
    }
    for flag, (value, reason) in cpu.items():
        plan.set(f"args.{flag}", value, reason)
    if script is not None:
        plan.set(
            "script",
            script,
            "no Megatron-LM checkout given (--megatron-lm-dir): the megatron-core wheel's "
            "megatron.training with this repository's example script",
        )


def _script(recipe: Recipe, megatron_lm_dir: str | None) -> str | None:
    """None when the recipe's own script exists in the Megatron-LM checkout; else the repository's
    example trainer."""
    base = megatron_lm_dir or os.environ.get("MEGATRON_LM_DIR")
    script = recipe.data.get("script", "pretrain_gpt.py")
    if base and (Path(base) / script).is_file():
        return None
    if not _REPO_EXAMPLE.is_file():
        raise RecipeError(
            "rehearsing a Megatron-LM recipe needs a trainer: pass --megatron-lm-dir (a Megatron-LM core_r0.19 checkout "
            f"with {script}), or run from a checkout of elastic-moe-plugin (examples/megatron_lm/pretrain_gpt_moe.py)."
        )
    return str(_REPO_EXAMPLE)


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
    plan = _Plan(original)
    family = _family(original)
    tiny_dir = str(work / "tiny" / (family or "tokenizer"))
    _tiny_model(plan, tiny_dir if family else f"tiny-{original.model.name}")
    world = _tiny_layout(plan, nproc)
    _tiny_batch(plan)
    dataset = str(work / "tiny" / "train.jsonl")
    script = None
    if original.launcher == "swift_sft":
        _olmoe_args(plan, dataset, steps, world)
    elif original.launcher == "megatron_sft":
        _megatron_sft_args(plan, dataset, steps, world)
    else:
        script = _script(original, megatron_lm_dir)
        _megatron_lm_args(plan, tiny_dir, steps, script)
    recipe = load_recipe(recipe_path, [*overrides, *plan.overrides])
    assets = _build_assets(recipe, family, work, steps, world) if build_assets else {}
    topology = Topology(
        nnodes=1,
        nproc_per_node=world,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=_free_port(),
        sources=dict.fromkeys(("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port"), "rehearsal"),
    )
    command = render(recipe, topology, list(extra_args), megatron_lm_dir=megatron_lm_dir)
    _adapt_command(command, recipe, work)
    return Rehearsal(original, recipe, command, plan.replacements, work, steps, assets)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _build_assets(recipe: Recipe, family: str | None, work: Path, steps: int, world: int) -> dict[str, str]:
    """The tiny checkpoint (or tokenizer) and data the rehearsal's recipe names, under ``work``."""
    from elastic_moe_plugin.tools.recipes import tiny_assets

    rng = random.Random(0)
    tokenizer = tiny_assets.train_tokenizer(rng)
    model = recipe.model
    tiny = work / "tiny"
    batch = recipe.batch
    if family is None:  # Megatron-LM: a tokenizer and an indexed dataset at the recipe's own paths
        (tiny / "tokenizer").mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(tiny / "tokenizer")
        needed = batch["global"] * (steps + 2) * batch["seq_length"]  # tokens: train steps + validation
        documents, total = [], 0
        while total < 2 * needed:
            documents.append(" ".join(tiny_assets.sentence(rng, rng.randint(10, 30)) for _ in range(8)))
            total += 8 * 25
        written = {}
        with _importable_megatron_core():
            for key in ("train-data-path", "valid-data-path", "test-data-path", "data-path"):
                for prefix in recipe.args.get(key) or []:
                    if isinstance(prefix, str) and not os.path.isabs(prefix):
                        written[prefix] = tiny_assets.write_indexed_dataset(work / prefix, tokenizer, documents)
        return {"tokenizer": str(tiny / "tokenizer"), **{f"data {k}": f"{v} tokens" for k, v in written.items()}}
    config = {
        "hidden_size": model.hidden_size,
        "intermediate_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": 2 * batch["seq_length"],
        "tie_word_embeddings": not model.untied_embeddings,
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.topk,
        "router_aux_loss_coef": 0.01,
        # the checkpoints' own gate conventions: OLMoE keeps the softmax weights of the kept experts,
        # Qwen3-MoE renormalises them (config.json norm_topk_prob of the real checkpoints)
        "norm_topk_prob": family == "qwen3_moe",
    }
    if family == "qwen3_moe":
        config["moe_intermediate_size"] = model.moe_ffn_hidden_size
    else:
        config["intermediate_size"] = model.moe_ffn_hidden_size
    tiny_assets.write_model(tiny / family, family, tokenizer, config)
    rows = tiny_assets.chat_rows(rng, batch["global"] * (steps + 1), sentences=2, words=(20, 30))
    tiny_assets.write_chat_dataset(tiny / "train.jsonl", rows)
    return {"model": str(tiny / family), "dataset": f"{tiny / 'train.jsonl'} ({len(rows)} rows)"}


@contextlib.contextmanager
def _importable_megatron_core() -> Iterator[None]:
    """megatron-core 0.19 imports triton unconditionally; without triton, its CPU stand-in (the CPU
    runtime, on for the block) lets this process import ``megatron.core.datasets``."""
    if importlib.util.find_spec("triton") is not None:
        yield
        return
    from elastic_moe_plugin import cpu_runtime

    with cpu_runtime.enabled():
        yield


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
    if recipe.launcher == "megatron_sft":
        env["PYTHONPATH"] = os.pathsep.join([str(cpu_bootstrap_dir()), *filter(None, [os.environ.get("PYTHONPATH")])])
        command.notes.append(
            f"CPU runtime: {cpu_bootstrap_dir()} first on PYTHONPATH switches "
            "elastic_moe_plugin.cpu_runtime.megatron_swift on in every process megatron sft starts"
        )
    elif recipe.launcher == "megatron_lm":
        argv = command.argv
        index = argv.index(MEGATRON_LM_ENTRY)
        argv[index] = MEGATRON_LM_CPU_ENTRY
        argv[: argv.index("--nnodes")] = [sys.executable, "-m", "torch.distributed.run"]
        command.notes.append(
            f"CPU runtime: -m {MEGATRON_LM_CPU_ENTRY} switches elastic_moe_plugin.cpu_runtime on, then "
            f"runs -m {MEGATRON_LM_ENTRY} (the recipe's entry point) unchanged"
        )


# ================================================================================== running
def rehearse(rehearsal: Rehearsal) -> int:
    """Run a planned rehearsal, streaming the launcher's output; its exit status, or 1 when it
    finished without logging ``elastic_moe/`` metrics for its training steps."""
    command = rehearsal.command
    argv = list(command.argv)
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
    found = _logged_metrics(rehearsal, "".join(output))
    if found < rehearsal.steps:
        print(
            f"rehearsal: {found} of {rehearsal.steps} training steps logged elastic_moe/ metrics: the plugin did not "
            f"log routing metrics (is it loaded?).",
            flush=True,
        )
        return 1
    print(
        f"rehearsal: OK: {rehearsal.steps} steps of {display_path(rehearsal.original.path)} through "
        f"{rehearsal.command.argv[0] if rehearsal.original.launcher != 'megatron_lm' else 'Megatron-LM'}, "
        f"elastic_moe/ metrics logged at every step; work folder {rehearsal.work}",
        flush=True,
    )
    return 0


def _logged_metrics(rehearsal: Rehearsal, output: str) -> int:
    """How many training steps logged an ``elastic_moe/`` metric."""
    if rehearsal.recipe.launcher == "megatron_lm":
        return sum(1 for line in output.splitlines() if " iteration " in line and "elastic_moe/" in line)
    steps = 0
    for path in rehearsal.work.rglob("logging.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "loss" in row and "train_runtime" not in row and any(k.startswith("elastic_moe/") for k in row):
                steps += 1
    return steps
