"""The ``swift sft`` rows of ``elastic-moe bench --only e2e`` (and the model and runs of ``--only swift-profile``).

A tiny OLMoE-shaped model (4 layers, hidden 256, 64 experts of width 256, top-8,
``norm_topk_prob=False``, the full-softmax gate; row ``swift_sft``) or a tiny DeepSeek-V3 (4 MoE
layers, hidden 256, MLA attention, 64 routed experts of width 256 in 8 groups of which each token's
top 4 are eligible, top-8, sigmoid scores with the correction bias, renormalised, × 2.5, one shared
expert; row ``swift_sft_deepseek_v3``, :data:`DEEPSEEK_V3_MODEL`), built offline with the recipes' tiny-asset builders
(:mod:`elastic_moe_plugin.tools.recipes.tiny_assets`: the byte-level BPE tokenizer and the 64-row
chat dataset the ms-swift tests use), trained by real ``swift sft``: full fine-tuning, the plugin
file with ``--callbacks elastic_moe`` (the documented fallback form), batch 8, transformers' default
experts implementation (``grouped_mm``) unless ``experts_impl`` names one, gradient checkpointing as
ms-swift defaults, ``ELASTIC_MOE_SCHEDULE=static`` against ``6-10``. ms-swift's model type and
template: ``olmoe`` / ``olmoe``, and ``deepseek_v3`` / ``deepseek_v2_5`` (the template ms-swift
registers for DeepSeek-V3); the OLMoE row adds the aux loss (``--router_aux_loss_coef 0.01``),
DeepSeek-V3 has none (its correction bias balances the load).

Steps/s are steady-state, from ms-swift's logged cumulative ``train_speed(s/it)`` (seconds since the
first step began over steps done): ``(last - warmup) / (last·s_last - warmup·s_warmup)``.

``elastic-moe bench --only swift-profile`` (:mod:`.swift_profile`) runs each schedule once under
torch.profiler instead (a second plugin file, :data:`CALLBACKS_PLUGIN`: :func:`command`'s ``profile``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from elastic_moe_plugin.tools.bench.e2e_child import Command, RunReading, child_env, console_script

if TYPE_CHECKING:
    from elastic_moe_plugin.tools.bench.e2e_interleaved import InterleavedReading

#: OLMoE-shaped routing (64 experts, top-8, full-softmax gate), tiny width and depth
MODEL = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
    "vocab_size": None,
    "max_position_embeddings": 512,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
}
#: DeepSeek-V3's block and routing (n_group 8, topk_group 4, × 2.5, one shared expert, sigmoid
#: scores renormalised), tiny width and depth: every layer MoE (``first_k_dense_replace=0``), MLA
#: attention at small ranks
DEEPSEEK_V3_MODEL = {
    "num_hidden_layers": 4,
    "first_k_dense_replace": 0,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 64,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "vocab_size": None,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
#: ``--quick``'s DeepSeek-V3 (2 layers, H=64, experts of width 64): its row adds one ``swift sft``
#: start-up and a few steps to CI, whose times say nothing anyway (the OLMoE row keeps its model)
DEEPSEEK_V3_QUICK = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 64}
#: family (``tiny_assets.FAMILIES``) -> (its tiny model's config, ms-swift's ``--model_type``,
#: ``--template``, the config fields of the expert FFN width and of the expert count)
FAMILIES: dict[str, tuple[dict, str, str, str, str]] = {
    "olmoe": (MODEL, "olmoe", "olmoe", "intermediate_size", "num_experts"),
    "deepseek_v3": (DEEPSEEK_V3_MODEL, "deepseek_v3", "deepseek_v2_5", "moe_intermediate_size", "n_routed_experts"),
}
SCHEDULES = ("static", "6-10")
DATASET_ROWS, BATCH_SIZE = 64, 8
#: the bench's callbacks (profiler, sync counter), alone in its folder: ms-swift puts a plugin's
#: folder first on sys.path, and this package's modules would shadow top-level ones there
CALLBACKS_PLUGIN = Path(__file__).resolve().parent / "swift_plugin" / "bench_callbacks.py"


def build(work: Path, model: dict, family: str = "olmoe") -> tuple[Path, Path]:
    """The ``family`` model directory (OLMoE-shaped by default) and the chat dataset, under ``work``
    (seeded: the same tokenizer and rows as ``tests/swift/_tiny_assets.py``, weights from
    ``torch.manual_seed(0)``)."""
    from elastic_moe_plugin.tools.recipes import tiny_assets

    rng = random.Random(0)
    tokenizer = tiny_assets.train_tokenizer(rng)
    config = {**model, "vocab_size": model["vocab_size"] or tiny_assets.VOCAB}
    experts_field = FAMILIES[family][4]
    model_dir = tiny_assets.write_model(
        work / f"{family}_e{model[experts_field]}_k{model['num_experts_per_tok']}", family, tokenizer, config
    )
    dataset = tiny_assets.write_chat_dataset(work / "train.jsonl", tiny_assets.chat_rows(rng, DATASET_ROWS))
    return model_dir, dataset


def command(
    model_dir: Path,
    dataset: Path,
    schedule: str,
    steps: int,
    out: Path,
    experts_impl: str | None = None,
    *,
    profile: str | None = None,
    sync_step: int | None = None,
    family: str = "olmoe",
) -> Command:
    """One ``swift sft`` run writing under ``out``. ``profile`` ("first:count"): the profiler's table in
    ``out / "profile.json"``; ``sync_step``: the host syncs of that step in ``out / "syncs.json"``;
    ``family``: the model's (:data:`FAMILIES`: ms-swift's model type and template)."""
    from elastic_moe_plugin.swift import plugin_path

    env = child_env(
        HF_DATASETS_CACHE=str(out / "hf_datasets"),
        MODELSCOPE_CACHE=str(out / "modelscope"),
        ELASTIC_MOE_SCHEDULE=schedule,
    )
    plugins, callbacks = [str(plugin_path())], ["elastic_moe"]
    if profile is not None:
        callbacks.append("sft_profile")
        env.update(SWIFT_SFT_PROFILE_STEPS=profile, SWIFT_SFT_PROFILE_OUT=str(out / "profile.json"))
    if sync_step is not None:
        callbacks.append("sft_syncs")
        from elastic_moe_plugin.tools.bench.e2e_child import SYNC_OUT_ENV, SYNC_STEP_ENV

        env.update({SYNC_STEP_ENV: str(sync_step), SYNC_OUT_ENV: str(out / "syncs.json")})
    if len(callbacks) > 1:
        plugins.append(str(CALLBACKS_PLUGIN))
    _, model_type, template, *_ = FAMILIES[family]
    # the OLMoE row trains with the model's aux loss; DeepSeek-V3 has none (its correction bias balances)
    aux_loss = ["--router_aux_loss_coef", "0.01"] if family == "olmoe" else []
    argv = [
        console_script("swift"),
        "sft",
        "--model",
        str(model_dir),
        "--model_type",
        model_type,
        "--template",
        template,
        "--dataset",
        str(dataset),
        "--check_model",
        "false",
        "--external_plugins",
        *plugins,
        "--callbacks",
        *callbacks,
        "--tuner_type",
        "full",
        "--max_steps",
        str(steps),
        "--logging_steps",
        "1",
        *aux_loss,
        "--per_device_train_batch_size",
        str(BATCH_SIZE),
        "--gradient_accumulation_steps",
        "1",
        "--max_length",
        "512",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--dataloader_num_workers",
        "0",
        "--dataset_num_proc",
        "1",
        "--output_dir",
        str(out / "run"),
        "--add_version",
        "false",
    ]
    if experts_impl is not None:
        argv += ["--experts_impl", experts_impl]
    return Command(argv, env, out)


def logged_rows(out: Path) -> list[dict]:
    """ms-swift's ``logging.jsonl`` rows of training steps."""
    path = out / "run" / "logging.jsonl"
    if not path.exists():
        raise RuntimeError(f"{path} is missing: swift sft logged no training step")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if "loss" in row and "train_speed(s/it)" in row]


def steady_steps_per_second(rows: list[dict], warmup: int, step_key: str = "global_step/max_steps") -> float:
    """(last - warmup) steps over the time between them, from the cumulative ``train_speed(s/it)``
    (``elapsed / steps done``, ms-swift's and Megatron-SWIFT's) of steps ``warmup`` and last."""
    speeds = {int(str(row[step_key]).split("/")[0]): row["train_speed(s/it)"] for row in rows}
    last = max(speeds)
    if warmup not in speeds or last <= warmup:
        raise RuntimeError(f"steps logged {sorted(speeds)}: need step {warmup} (the warm-up's last) and a later one")
    return (last - warmup) / (speeds[last] * last - speeds[warmup] * warmup)


def logged_mean_kappa(rows: list[dict]) -> float | None:
    """The mean of the runs' logged ``elastic_moe/mean_kappa`` (else of the per-layer means), None
    when the run logged none (static)."""
    means = []
    for row in rows:
        if "elastic_moe/mean_kappa" in row:
            means.append(row["elastic_moe/mean_kappa"])
        else:
            layers = [
                value
                for key, value in row.items()
                if key.startswith("elastic_moe/layer_") and key.endswith("/mean_kappa")
            ]
            if layers:
                means.append(sum(layers) / len(layers))
    return sum(means) / len(means) if means else None


def read_syncs(path: Path) -> int | None:
    """The sync count a probe wrote (``{"syncs": n}``), None if it wrote none."""
    return json.loads(path.read_text())["syncs"] if path.exists() else None


class SwiftSft:
    """``swift sft`` on a tiny model of ``family`` (the OLMoE-shaped one, or DeepSeek-V3's): static
    top-8 against elastic 6-10."""

    static, elastic = SCHEDULES
    default_steps, default_warmup = 20, 4
    timing = "from ms-swift's logged cumulative train_speed(s/it)"
    # separate runs: switched in one run (hf.remove / hf.apply between steps), the static steps ran
    # slower than a static run's (docs/performance.md), an effect of the switch not yet explained,
    # which would flatter elastic
    interleaves = False
    interleave_block = interleave_pairs = 0
    #: family -> (row key, label)
    ROWS: ClassVar[dict[str, tuple[str, str]]] = {
        "olmoe": ("swift_sft", "swift sft"),
        "deepseek_v3": ("swift_sft_deepseek_v3", "swift sft DSv3"),
    }

    def __init__(
        self, hidden: int | None = None, experts_impl: str | None = None, family: str = "olmoe", quick: bool = False
    ) -> None:
        if family not in FAMILIES:
            raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}.")
        self.family = family
        self.key, self.label = self.ROWS[family]
        model, _, _, self.ffn_field, self.experts_field = FAMILIES[family]
        self.model = dict(model)
        if quick and family == "deepseek_v3":
            self.model.update(DEEPSEEK_V3_QUICK)
        if hidden is not None:
            self.model.update({"hidden_size": hidden, self.ffn_field: hidden})
        self.experts_impl = experts_impl
        self.model_dir: Path | None = None
        self.dataset: Path | None = None

    def describe(self) -> str:
        m = self.model
        if self.family == "deepseek_v3":
            shape = (
                f"DeepSeek-V3, {m['num_hidden_layers']} MoE layers, H={m['hidden_size']}, {m['n_routed_experts']} "
                f"experts of width {m['moe_intermediate_size']} in {m['n_group']} groups (top {m['topk_group']}), "
                f"top-{m['num_experts_per_tok']}, x{m['routed_scaling_factor']}, {m['n_shared_experts']} shared"
            )
        else:
            shape = (
                f"OLMoE-shaped, {m['num_hidden_layers']} layers, H={m['hidden_size']}, {m['num_experts']} experts of "
                f"width {m['intermediate_size']}, top-{m['num_experts_per_tok']}"
            )
        return f"{shape}, batch {BATCH_SIZE}, experts {self.experts_impl or 'grouped_mm (default)'}"

    def prepare(self, work: Path, steps: int) -> None:
        self.model_dir, self.dataset = build(work, self.model, self.family)

    def command(
        self, schedule: str, steps: int, out: Path, sync_step: int, interleave_block: int | None = None
    ) -> Command:
        if interleave_block is not None:
            raise ValueError("swift sft does not interleave: its rounds are separate static and elastic runs")
        assert self.model_dir is not None and self.dataset is not None, "prepare() builds them first"
        return command(
            self.model_dir,
            self.dataset,
            schedule,
            steps,
            out,
            self.experts_impl,
            sync_step=sync_step,
            family=self.family,
        )

    def read_interleaved(
        self, out: Path, output: str, warmup: int
    ) -> tuple[InterleavedReading, dict[str, float | None]]:
        raise NotImplementedError("swift sft does not interleave: its rounds are separate static and elastic runs")

    def read(self, out: Path, output: str, warmup: int) -> RunReading:
        rows = logged_rows(out)
        return RunReading(steady_steps_per_second(rows, warmup), logged_mean_kappa(rows), len(rows))

    def syncs(self, out: Path) -> int | None:
        return read_syncs(out / "syncs.json")


__all__ = [
    "CALLBACKS_PLUGIN",
    "DEEPSEEK_V3_MODEL",
    "DEEPSEEK_V3_QUICK",
    "FAMILIES",
    "MODEL",
    "SCHEDULES",
    "SwiftSft",
    "build",
    "command",
    "logged_mean_kappa",
    "logged_rows",
    "read_syncs",
    "steady_steps_per_second",
]
