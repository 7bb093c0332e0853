"""The demo's model: a tiny megatron-core ``GPTModel``, described by a JSON-able dict.

:func:`model_config` writes the description (``TransformerConfig`` kwargs, ``GPTModel`` kwargs and
the layer spec: local spec, ``SequentialMLP`` experts, allgather dispatcher, an MoE in every
layer, aux-loss load balancing, no dropout, no biases); ``model_config.json`` stores it next to the
trained state dicts, and :func:`build_model` / :func:`load_trained` rebuild the model from it.
Building needs Megatron's model-parallel state (on CPU: ``cpu_runtime.enable();
cpu_runtime.initialize_model_parallel()``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from elastic_moe_plugin.tools.demo.settings import DemoSettings


def model_config(settings: DemoSettings, vocab_size: int) -> dict[str, Any]:
    """The JSON-able description ``model_config.json`` stores and :func:`build_model` reads."""
    return {
        "transformer_config": dict(
            num_layers=settings.num_layers,
            hidden_size=settings.hidden_size,
            num_attention_heads=settings.num_attention_heads,
            ffn_hidden_size=settings.expert_ffn_hidden_size,
            moe_ffn_hidden_size=settings.expert_ffn_hidden_size,
            num_moe_experts=settings.num_experts,
            moe_router_topk=settings.topk,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=settings.aux_loss_coeff,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            add_bias_linear=False,
            use_cpu_initialization=True,
        ),
        "gpt_model": dict(vocab_size=vocab_size, max_sequence_length=settings.seq_len),
        "layer_spec": {
            "function": "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec",
            "kwargs": {"num_experts": settings.num_experts, "moe_grouped_gemm": False},
        },
    }


def build_model(config: dict[str, Any]):
    """A fresh ``GPTModel`` from :func:`model_config`'s dict. Needs Megatron's model-parallel
    state (on CPU: ``cpu_runtime.enable(); cpu_runtime.initialize_model_parallel()``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = get_gpt_layer_local_spec(**config["layer_spec"]["kwargs"])
    return GPTModel(
        config=TransformerConfig(**config["transformer_config"]), transformer_layer_spec=spec, **config["gpt_model"]
    )


def load_trained(out_dir: str | os.PathLike[str], run: str = "elastic"):
    """Rebuild the demo's ``run`` model ("static" or "elastic") from ``out_dir`` and load its weights.

    Returns ``(model, model_config_dict)``; the model is in eval mode (static top-k routing, as
    deployed). Needs Megatron's model-parallel state (see :func:`build_model`).
    """
    out = Path(out_dir)
    config = json.loads((out / "model_config.json").read_text())
    model = build_model(config)
    state = torch.load(out / config["runs"][run]["checkpoint"], map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval(), config


def causal_mask(seq_len: int) -> torch.Tensor:
    """[1, 1, S, S] bool, True = masked (GPTModel's default mask is built on device="cuda")."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
