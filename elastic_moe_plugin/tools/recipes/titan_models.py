"""The paper's pretraining model as a torchtitan 0.3 model registry: ``--module`` this module,
``--config`` one of :data:`CONFIGS` (``configs/pretrain_titan/``, docs/recipes.md).

torchtitan's ``ConfigManager`` takes ``--module`` as a short name of its own models or as any
importable module, and ``--config`` as a function of it that returns a ``Trainer.Config``
(``torchtitan/config/manager.py``, ``_load_config``). The model itself is no command-line setting
(``Trainer.Config.model_spec`` is suppressed from the command line), so a model of our own size
needs such a module::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module elastic_moe_plugin.tools.recipes.titan_models --config eer_1p42b_a365m ...

The family is torchtitan's Qwen3-MoE (``torchtitan.models.qwen3``): the plain softmax top-k MoE of
Megatron-LM's recipe (``configs/pretrain/``): scores softmax(z) over every expert, top-k,
renormalised over the kept (``route_norm``), which keeps and weighs exactly what Megatron's
``--moe-router-score-function softmax`` (top-k of the logits, softmax over the kept) does; no
shared expert, no expert groups; SwiGLU experts, RMSNorm (ε 1e-6), QK-norm, RoPE, no biases,
untied embeddings, init std 0.02 with Megatron's scaled init of the residual outputs. DeepSeek-V3's
family adds groups, shared experts and sigmoid scores, which the paper's model does not have.
The one change from torchtitan's Qwen3-MoE configs: RoPE base 10,000 (Megatron-LM's recipe) rather
than Qwen3's 1,000,000. torchtitan has no auxiliary load-balancing loss; its balancing is the
aux-loss-free expert bias (``MoE.Config.load_balance_coeff``, 1e-3 as its Qwen3-MoE configs), which
the ``*_no_expert_bias`` variants leave out (the door's top-p mode ranks by the softmax probability
alone and refuses a bias).

Each name of :data:`CONFIGS` is one function here; the rest of the run (batch, steps, optimizer,
data, parallelism) is command-line flags, which the recipe renders: the functions hold the same
paper values as defaults. :data:`ARCHITECTURES` is the architecture in the recipe's ``model:``
spelling, readable without torchtitan (the recipe validation compares it with the ``model:`` block);
:func:`parameter_counts` counts a built model's parameters.

Importing this module imports no torchtitan (the recipes load without it); each function does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "CONFIGS",
    "FINEWEB_EDU",
    "MODULE",
    "TINY",
    "TitanModel",
    "config_name",
    "eer_1p42b_a365m",
    "eer_1p42b_a365m_no_expert_bias",
    "eer_1p42b_a365m_top9",
    "eer_1p42b_a365m_top10",
    "eer_tiny",
    "eer_tiny_no_expert_bias",
    "eer_tiny_top9",
    "eer_tiny_top10",
    "model_spec",
    "parameter_counts",
    "tiny_variant",
    "trainer_config",
]

#: what ``--module`` names
MODULE = __name__
#: the dataset name this module registers in torchtitan's ``DATASETS``: FineWeb-Edu's ``text``
#: column, streamed from ``--dataloader.dataset_path`` (a local folder of its parquet or json files,
#: e.g. ``sample/100BT`` of a download, or the hub id ``HuggingFaceFW/fineweb-edu``)
FINEWEB_EDU = "fineweb_edu"
#: the architecture of the tiny rehearsal model
TINY = "eer_tiny"

#: architecture name -> the recipe's ``model:`` keys (docs/recipes.md, "Budget arithmetic")
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "eer_1p42b_a365m": {
        "num_layers": 20,
        "hidden_size": 768,
        "num_attention_heads": 24,
        "num_query_groups": 6,
        "head_dim": 64,
        "num_experts": 128,
        "topk": 8,
        "moe_ffn_hidden_size": 192,
        "vocab_size": 151936,
        "untied_embeddings": True,
    },
    # the same family at the rehearsal's size: 4 layers, grouped-query heads, 20 experts (room for
    # top-10 and a 5-11 schedule), a vocabulary of the rehearsal's tokenizer
    TINY: {
        "num_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "head_dim": 16,
        "num_experts": 20,
        "topk": 8,
        "moe_ffn_hidden_size": 32,
        "vocab_size": 1024,
        "untied_embeddings": True,
    },
}
#: RoPE base and the longest sequence RoPE is built for (RMSNorm's ε 1e-6 is torchtitan's Qwen3 norm's)
ROPE_THETA, MAX_SEQ_LEN = 10000.0, 4096
#: torchtitan's aux-loss-free balancing rate (its Qwen3-MoE configs' ``load_balance_coeff``)
EXPERT_BIAS_RATE = 1e-3
#: the paper's run (Appendix A.4), the defaults of every function here
LR, WARMUP_STEPS, STEPS, WEIGHT_DECAY = 1.09516e-3, 251, 25034, 0.01
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, EXPERT_PARALLEL = 256, 4, 4096, 4


@dataclass(frozen=True)
class TitanModel:
    """One ``--config`` of this module: an architecture of :data:`ARCHITECTURES`, the top-k it trains
    with (``train_topk``, None: the architecture's), and whether it balances by the expert bias."""

    architecture: str
    train_topk: int | None = None
    expert_bias: bool = True

    @property
    def facts(self) -> dict[str, Any]:
        """The recipe's ``model:`` keys of this config (``train_topk`` among them)."""
        return {**ARCHITECTURES[self.architecture], "train_topk": self.train_topk}

    @property
    def training_topk(self) -> int:
        return self.train_topk if self.train_topk is not None else int(ARCHITECTURES[self.architecture]["topk"])


#: ``--config`` name -> what it builds
CONFIGS: dict[str, TitanModel] = {
    f"{architecture}{suffix}": TitanModel(architecture, train_topk, bias)
    for architecture in ARCHITECTURES
    for suffix, train_topk, bias in (("", None, True), ("_top9", 9, True), ("_top10", 10, True),
                                     ("_no_expert_bias", None, False))
}  # fmt: skip


def config_name(model: TitanModel) -> str | None:
    """The ``--config`` name that builds ``model`` (None: none does)."""
    return next((name for name, other in CONFIGS.items() if other == model), None)


def tiny_variant(name: str) -> str:
    """The rehearsal's config of ``--config name``: the same variant of the tiny architecture."""
    variant = CONFIGS[name]
    tiny = config_name(TitanModel(TINY, variant.train_topk, variant.expert_bias))
    assert tiny is not None, name  # every variant exists for every architecture
    return tiny


# ================================================================================== torchtitan
def model_spec(name: str) -> Any:
    """torchtitan's ``ModelSpec`` of ``--config name``: a Qwen3-MoE decoder of its architecture.

    Raises:
        KeyError: ``name`` is not in :data:`CONFIGS`.
        ImportError: torchtitan's Qwen3 builders moved (a torchtitan outside 0.3).
    """
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    try:  # the Qwen3 builders of torchtitan 0.3 (private names)
        from torchtitan.models.qwen3 import (
            _EMBEDDING_INIT,
            _LINEAR_INIT,
            _build_qwen3_moe_layers,
            _qwen3_norm,
            parallelize_qwen3,
        )
    except ImportError as error:
        raise ImportError(
            f"{MODULE} builds its models with torchtitan.models.qwen3's _build_qwen3_moe_layers, _qwen3_norm, "
            f"_LINEAR_INIT and _EMBEDDING_INIT of torchtitan 0.3 ({error}); install torchtitan>=0.3,<0.4 "
            "(pip install 'elastic-moe-plugin[titan]')."
        ) from error
    from torchtitan.models.qwen3.model import Qwen3Model
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    from torchtitan.protocols.model_spec import ModelSpec

    variant = CONFIGS[name]
    arch = ARCHITECTURES[variant.architecture]
    dim, vocab, head_dim = arch["hidden_size"], arch["vocab_size"], arch["head_dim"]
    layers = _build_qwen3_moe_layers(
        fuse_qkv=True,
        n_layers=arch["num_layers"],
        dim=dim,
        n_heads=arch["num_attention_heads"],
        n_kv_heads=arch["num_query_groups"],
        head_dim=head_dim,
        moe_hidden_dim=arch["moe_ffn_hidden_size"],
        num_experts=arch["num_experts"],
        top_k=variant.training_topk,
        attn_backend="flex",
        moe_comm_backend="standard",  # torchtitan's all-to-all dispatcher, the paper's
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=MAX_SEQ_LEN, theta=ROPE_THETA),
    )
    for layer in layers:
        layer.moe.load_balance_coeff = EXPERT_BIAS_RATE if variant.expert_bias else None
    config = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=not arch["untied_embeddings"],
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )
    return ModelSpec(
        name="qwen3",
        flavor=name,
        model=config,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=Qwen3StateDictAdapter,
    )


def trainer_config(name: str) -> Any:
    """torchtitan's ``Trainer.Config`` of ``--config name``: the model, and the paper's run as defaults
    (the recipe renders each of them as a flag again); registers :data:`FINEWEB_EDU`."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    _register_fineweb_edu()
    spec = model_spec(name)
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size)),
        hf_assets_path="./assets/hf/Qwen3-0.6B-Base",
        model_spec=spec,
        metrics=MetricsProcessor.Config(log_freq=10),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=FINEWEB_EDU, dataset_path="data/fineweb-edu/train"),
        optimizer=default_adamw(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WEIGHT_DECAY),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=WARMUP_STEPS, decay_ratio=0.0),
        training=TrainingConfig(
            local_batch_size=MICRO_BATCH,
            global_batch_size=GLOBAL_BATCH,
            seq_len=SEQ_LEN,
            steps=STEPS,
            max_norm=1.0,
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(expert_parallel_degree=EXPERT_PARALLEL),
        checkpoint=CheckpointManager.Config(interval=2500, last_save_model_only=False),
        activation_checkpoint=None,
    )


def _register_fineweb_edu() -> None:
    """Add :data:`FINEWEB_EDU` to torchtitan's datasets (its documented way to add one), once."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    if FINEWEB_EDU not in DATASETS:
        DATASETS[FINEWEB_EDU] = DatasetConfig(
            path="HuggingFaceFW/fineweb-edu", loader=_stream_text, sample_processor=_text
        )


def _stream_text(path: str) -> Any:
    """A local folder of parquet/json(l) files, or a hub dataset id, streamed (its ``train`` split)."""
    from datasets import load_dataset

    return load_dataset(path, split="train", streaming=True)


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def parameter_counts(model: Any, topk: int) -> dict[str, int]:
    """``{"total", "active", "norms"}`` of a built torchtitan MoE decoder (on any device, ``meta``
    included): every parameter, those a token uses at ``topk`` of the experts (every expert tensor
    ``[E, ...]`` counted at ``topk / E``), and the norm weights among them."""
    total = active = norms = 0
    for name, parameter in model.named_parameters():
        count = parameter.numel()
        total += count
        if "norm" in name.rsplit(".", 2)[-2]:
            norms += count
        if ".moe.routed_experts." in f".{name}":
            active += count // parameter.shape[0] * topk
        else:
            active += count
    return {"total": total, "active": active, "norms": norms}


# ================================================================================== --config names
def eer_1p42b_a365m() -> Any:
    """1.42B-A365M (paper A.4): 20 layers, hidden 768, 128 experts of 192, top-8, expert bias."""
    return trainer_config("eer_1p42b_a365m")


def eer_1p42b_a365m_top9() -> Any:
    """1.42B-A365M trained at a static top-9 (evaluate at top-8; the paper's Table 6 control)."""
    return trainer_config("eer_1p42b_a365m_top9")


def eer_1p42b_a365m_top10() -> Any:
    """1.42B-A365M trained at a static top-10 (evaluate at top-8; the paper's Table 6 control)."""
    return trainer_config("eer_1p42b_a365m_top10")


def eer_1p42b_a365m_no_expert_bias() -> Any:
    """1.42B-A365M without the aux-loss-free expert bias (the top-p control routes by p alone)."""
    return trainer_config("eer_1p42b_a365m_no_expert_bias")


def eer_tiny() -> Any:
    """The rehearsal's model of the same family: 4 layers, hidden 64, 20 experts of 32, top-8."""
    return trainer_config("eer_tiny")


def eer_tiny_top9() -> Any:
    """The rehearsal's model trained at top-9."""
    return trainer_config("eer_tiny_top9")


def eer_tiny_top10() -> Any:
    """The rehearsal's model trained at top-10."""
    return trainer_config("eer_tiny_top10")


def eer_tiny_no_expert_bias() -> Any:
    """The rehearsal's model without the expert bias."""
    return trainer_config("eer_tiny_no_expert_bias")
