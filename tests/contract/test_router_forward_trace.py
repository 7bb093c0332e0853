"""The hot path of both doors, traced: one training forward of a patched router enters at most five
modules of the package, and resolves nothing (its state was resolved once, at its first forward).

``sys.settrace`` records every call into a module of the package (the CPU runtime aside: it stands
in for CUDA and is no part of a GPU run) during one elastic training forward, after warm-up, of a
Megatron ``TopKRouter`` with an aux loss (the realised load balancing runs) and of an OLMoE router.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

import elastic_moe_plugin
from elastic_moe_plugin import ElasticConfig
from elastic_moe_plugin.core.records import latest_record

PACKAGE = os.path.dirname(elastic_moe_plugin.__file__)
RUNTIME = os.path.join(PACKAGE, "cpu_runtime")
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
T, H, E, K = 64, 32, 16, 4


def _traced_calls(forward) -> set[tuple[str, str]]:
    """(module path relative to the package, function name) of every call ``forward()`` makes into the package."""
    calls: set[tuple[str, str]] = set()

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(PACKAGE) and not path.startswith(RUNTIME):
            calls.add((os.path.relpath(path, PACKAGE), frame.f_code.co_name))
        return None

    previous = sys.gettrace()  # coverage's tracer, under `make coverage`: it must go on afterwards
    sys.settrace(tracer)
    try:
        forward()
    finally:
        sys.settrace(previous)
    return calls


def _assert_hot_path(calls: set[tuple[str, str]], door: str) -> None:
    modules = sorted({module for module, _ in calls})
    assert len(modules) <= 5, modules
    assert f"{door}/routing.py" in modules and "core/routing.py" in modules, modules
    resolving = {name for _, name in calls if name.startswith("resolve") or name in ("validate_router", "resolve_plan")}
    assert not resolving, f"a steady-state forward resolved its plan again: {resolving}"


@pytest.mark.megatron
@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core")
def test_a_megatron_training_forward_enters_at_most_five_modules(mcore_env, make_config, make_router):
    from elastic_moe_plugin import mcore

    config = make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H, moe_aux_loss_coeff=0.01,
                         moe_token_dispatcher_type="alltoall")
    mcore.apply(ElasticConfig(schedule="2-6"))
    router = make_router(config)
    x = torch.randn(T // 2, 2, H)
    for _ in range(3):
        router(x)
    calls = _traced_calls(lambda: router(x))
    assert latest_record(router).budgets.numel() == T  # the elastic path ran
    _assert_hot_path(calls, "mcore")
    assert ("mcore/aux_loss.py", "apply_realised_aux_losses") in calls


@pytest.mark.hf
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs transformers")
def test_a_transformers_training_forward_enters_at_most_five_modules():
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeForCausalLM

    from elastic_moe_plugin import hf

    hf.apply(ElasticConfig(schedule="2-6"))
    try:
        config = OlmoeConfig(vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, num_experts=E, num_experts_per_tok=K)
        router = OlmoeForCausalLM(config).train().model.layers[0].mlp.gate
        hidden = torch.randn(T, H)
        for _ in range(3):
            router(hidden)
        calls = _traced_calls(lambda: router(hidden))
        assert latest_record(router).budgets.numel() == T
        _assert_hot_path(calls, "hf")
    finally:
        hf.remove()
