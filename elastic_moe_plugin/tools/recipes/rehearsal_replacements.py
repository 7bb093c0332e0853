"""What a rehearsal replaces in a recipe, and why (:mod:`~elastic_moe_plugin.tools.recipes.rehearse`).

:func:`tiny_settings` scales a recipe to this machine: the ``--set`` overrides of the tiny recipe
(the model of the same family at :data:`TINY_LAYERS` layers, the elastic layer range scaled to it,
one node of at most 2-way parallelism, the tiny batch, the launcher's CPU flags and local assets)
and the :class:`Replacement` shown to the user for each setting that cannot apply here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_moe_plugin.core.config import parse_layers
from elastic_moe_plugin.tools.recipes.recipe import Recipe
from elastic_moe_plugin.tools.recipes.schema import RecipeError

__all__ = ["TINY_LAYERS", "Replacement", "TinySettings", "scaled_layers", "tiny_settings"]

TINY_LAYERS = 4
TINY_HIDDEN, TINY_HEADS, TINY_HEAD_DIM, TINY_EXPERT_FFN = 64, 4, 16, 32
SEQ_LENGTH = 256
_REPO_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "megatron_lm" / "pretrain_gpt_moe.py"


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


def _family(recipe: Recipe) -> str | None:
    """The transformers family of the recipe's checkpoint (``None``: Megatron-LM or torchtitan builds
    the model itself)."""
    if recipe.launcher in ("megatron_lm", "torchtitan"):
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


def scaled_layers(spec: str | None, depth: int) -> str | None:
    """``spec`` (0-based layers of a ``depth``-layer model) mapped onto :data:`TINY_LAYERS` layers."""
    if spec is None:
        return None
    runs: list[list[int]] = []  # consecutive layers
    for layer in sorted({index * TINY_LAYERS // depth for index in parse_layers(spec)}):
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


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
    _scale_layers(plan)
    return tiny


def _scale_layers(plan: _Plan) -> None:
    layers, depth = plan.recipe.elastic.layers, plan.recipe.model.num_layers
    if layers is not None:
        plan.set(
            "elastic.layers",
            scaled_layers(layers, depth),
            f"the recipe's layer range on {depth} layers, scaled to the tiny model's {TINY_LAYERS}",
        )


def _tiny_titan_model(plan: _Plan) -> None:
    """The tiny config of :mod:`.titan_models` of the recipe's variant, and its ``model:`` facts."""
    from elastic_moe_plugin.tools.recipes import titan_models

    recipe = plan.recipe
    config = recipe.data["args"]["config"]
    if recipe.data["args"]["module"] != titan_models.MODULE:
        raise RecipeError(
            f"{recipe.file_of('args', 'module')}: args.module={recipe.data['args']['module']!r}: the rehearsal scales "
            f"down the models of {titan_models.MODULE} only (their tiny configs); rehearse with one of those."
        )
    tiny = titan_models.tiny_variant(config)
    facts = titan_models.CONFIGS[tiny].facts
    for key, value in {**facts, "name": tiny}.items():
        plan.set(f"model.{key}", value, "", show=False)
    model = recipe.model
    plan.set(
        "args.config",
        tiny,
        f"{model.name}: {model.num_layers} layers, hidden {model.hidden_size}, {model.num_experts} experts needs GPUs; "
        f"the same family, router and top-{model.training_topk} at {facts['num_layers']} layers, hidden "
        f"{facts['hidden_size']}, {facts['num_experts']} experts",
    )
    _scale_layers(plan)


def _vocab_size() -> int:
    from elastic_moe_plugin.tools.recipes.tiny_assets import VOCAB

    return VOCAB


def _tiny_layout(plan: _Plan, nproc: int | None) -> int:
    parallel = plan.recipe.parallel
    pp, ep = min(parallel["pp"], 2), min(parallel["ep"], 2)
    for key, value in (("tp", 1), ("cp", 1), ("etp", 1), ("pp", pp), ("ep", ep)):
        plan.set(f"parallel.{key}", value, "", show=False)
    if nproc is not None:
        world = nproc
    elif plan.recipe.launcher == "swift_sft":
        world = 2  # pure data parallelism: 2 ranks, so that DeepSpeed ZeRO or FSDP has a partition to shard
    else:
        world = pp * ep
    changed = {
        k: (parallel[k], v) for k, v in (("tp", 1), ("pp", pp), ("cp", 1), ("ep", ep), ("etp", 1)) if parallel[k] != v
    }
    if changed or world != plan.recipe.cluster.get("nnodes", 1) * plan.recipe.cluster.get("nproc_per_node", 1):
        plan.replacements.append(
            Replacement(
                "cluster/parallel",
                f"{plan.recipe.cluster.get('nnodes', 1)} node(s) x "
                f"{plan.recipe.cluster.get('nproc_per_node', 1)} GPUs, "
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
    plan.set("args.dataloader_num_workers", 0, "data loader workers of a small machine")
    if world > 1:
        plan.set("args.ddp_backend", "gloo", "NCCL is GPU-only")
    plan.set(
        "args.use_cpu",
        True,
        "no CUDA here: accelerate's CPU processes over gloo; without it DeepSpeed sizes its batch for a world of 1",
    )
    plan.set(
        "args.fp16",
        False,
        "ms-swift turns fp16 on for float32 weights, and DeepSpeed's CPU accelerator refuses fp16; float32 here",
    )


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


def _titan_args(plan: _Plan, work: Path, steps: int) -> None:
    """torchtitan's flags that cannot apply here; the datasets are written at the recipe's relative paths."""
    plan.set("args.hf_assets_path", str(work / "tiny" / "tokenizer"), "a hub tokenizer; the tiny local one")
    for key in ("dataloader", "validator.dataloader"):
        path = _value(plan.recipe, f"args.{key}.dataset_path")
        if isinstance(path, str) and os.path.isabs(path):
            plan.set(f"args.{key}.dataset_path", str(work / "tiny" / key), "the recipe's data; a tiny local corpus")
    plan.set("args.training.steps", steps, "the rehearsal's length (--steps)")
    plan.set("args.training.mixed_precision_param", "float32", "bf16 is a GPU precision")
    if (_value(plan.recipe, "args.metrics.log_freq") or 1) > 1:
        plan.set("args.metrics.log_freq", 1, "log every step, so the routing metrics of each show")
    if (_value(plan.recipe, "args.validator.steps") or 1) > 1:
        plan.set(
            "args.validator.steps", 1, "one validation batch exercises the path; a full pass outlasts the rehearsal"
        )


def _value(recipe: Recipe, key: str) -> Any:
    try:
        return recipe.get(key)
    except KeyError:
        return None


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
            "rehearsing a Megatron-LM recipe needs a trainer: pass --megatron-lm-dir (a Megatron-LM core_r0.19 "
            f"checkout with {script}), or run from a checkout of elastic-moe-plugin "
            "(examples/megatron_lm/pretrain_gpt_moe.py)."
        )
    return str(_REPO_EXAMPLE)


@dataclass(frozen=True)
class TinySettings:
    """A recipe scaled to this machine: the ``overrides`` (``KEY=VALUE``, after the user's), the
    ``replacements`` shown, the checkpoint ``family`` (``None``: Megatron-LM builds its GPT) and the
    ``world`` size of the one node."""

    overrides: list[str]
    replacements: list[Replacement]
    family: str | None
    world: int


def tiny_settings(
    original: Recipe, work: Path, steps: int, nproc: int | None, megatron_lm_dir: str | None
) -> TinySettings:
    """What the rehearsal of ``original`` changes, with its tiny assets under ``work / "tiny"``.

    Raises:
        RecipeError: the recipe's family cannot be rehearsed, or a Megatron-LM recipe has no trainer.
    """
    plan = _Plan(original)
    family = _family(original)
    tiny_dir = str(work / "tiny" / (family or "tokenizer"))
    if original.launcher == "torchtitan":
        _tiny_titan_model(plan)
    else:
        _tiny_model(plan, tiny_dir if family else f"tiny-{original.model.name}")
    world = _tiny_layout(plan, nproc)
    _tiny_batch(plan)
    dataset = str(work / "tiny" / "train.jsonl")
    if original.launcher == "swift_sft":
        _olmoe_args(plan, dataset, steps, world)
    elif original.launcher == "megatron_sft":
        _megatron_sft_args(plan, dataset, steps, world)
    elif original.launcher == "torchtitan":
        _titan_args(plan, work, steps)
    else:
        _megatron_lm_args(plan, tiny_dir, steps, _script(original, megatron_lm_dir))
    return TinySettings(plan.overrides, plan.replacements, family, world)
