"""``moe_router_fusion=True`` under elastic routing: Transformer Engine's fused top-k (and the fused
aux-loss scores and loss) stays on the static layers and in evaluation; elastic layers in training
route unfused.

On the CPU, Transformer Engine is absent and ``cpu_runtime.enable()`` installs its fused router as
megatron-core's own unfused code (``elastic_moe_plugin.cpu_runtime.fused_router``). A counter around
each of the three fused functions counts the calls exactly: per training forward a static router
calls each once (softmax aux loss on), an elastic router none; in evaluation every router calls the
fused top-k once. Static layers equal the unpatched fused path bit for bit.
"""

from __future__ import annotations

import collections

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.cpu_runtime import fused_router
from elastic_moe_plugin.mcore import patch as patch_module

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

LAYERS, HIDDEN, VOCAB, E, K = 4, 32, 64, 8, 2
BATCH, SEQ = 2, 16
ELASTIC_LAYERS = (1, 2)  # 0-based; layers 0 and 3 stay static
S, B, H = 6, 3, 16  # router-level inputs


@pytest.fixture
def fused_calls(monkeypatch) -> collections.Counter:
    """Counts the calls of the three fused router functions ``moe_utils`` holds (the CPU stand-ins)."""
    from megatron.core.transformer.moe import moe_utils

    calls: collections.Counter = collections.Counter()
    for name in fused_router.FUSED_ROUTER_FUNCTIONS:
        function = getattr(moe_utils, name)
        if not fused_router.is_stand_in(function):
            pytest.skip("Transformer Engine's fused router is installed: tests/mcore runs the CPU stand-in")

        def counted(*args, _name=name, _function=function, **kwargs):
            calls[_name] += 1
            return _function(*args, **kwargs)

        monkeypatch.setattr(moe_utils, name, counted)
    return calls


def _counts(topk, scores, aux):
    return {"fused_topk_with_score_function": topk, "fused_compute_score_for_moe_aux_loss": scores,
            "fused_moe_aux_loss": aux}


def _gpt(make_config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = make_config(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64,
                         moe_ffn_hidden_size=64, num_moe_experts=E, moe_router_topk=K, moe_aux_loss_coeff=0.01,
                         moe_z_loss_coeff=1e-3, moe_router_fusion=True, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _batch():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return tokens[:, :-1], torch.arange(SEQ).expand(BATCH, SEQ), causal, tokens[:, 1:]


def _record_static_routers(model):
    """{layer: [(router input, probs, routing_map)]} of the static layers' router forwards."""
    seen: dict[int, list] = {}
    for index, layer in enumerate(model.decoder.layers):
        if index in ELASTIC_LAYERS:
            continue

        def hook(module, inputs, outputs, index=index):
            seen.setdefault(index, []).append((inputs[0].detach().clone(), outputs[0].detach(), outputs[1].detach()))

        layer.mlp.router.register_forward_hook(hook)
    return seen


def test_a_tiny_gpt_trains_with_fusion_on_static_layers_and_unfused_elastic_layers(make_config, fused_calls):
    mcore.apply(ElasticConfig(schedule="1-3", layers="1-2"))
    model = _gpt(make_config)
    routers = [layer.mlp.router for layer in model.decoder.layers]
    line = mcore.log_plan(model)
    assert patch_module.ROUTER_FUSION_NOTE in line and "elastic 1-3" in line, line
    seen = _record_static_routers(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens, positions, mask, labels = _batch()

    # a training forward: each static router calls each fused function once, the elastic ones none
    torch.manual_seed(10)
    loss = model(tokens, positions, attention_mask=mask, labels=labels).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert dict(fused_calls) == _counts(topk=2, scores=2, aux=2)
    assert sorted(mcore.routing_records(model)) == list(ELASTIC_LAYERS)  # the elastic layers did route elastically

    # evaluation: every router, elastic layers included, runs stock's fused top-k; no aux loss
    model.eval()
    with torch.no_grad():
        model(tokens, positions, attention_mask=mask)
    assert dict(fused_calls) == _counts(topk=2 + LAYERS, scores=2, aux=2)

    # the static layers' training forward equals the unpatched fused path, bit for bit
    train_records = {index: records[0] for index, records in seen.items()}
    mcore.remove()
    model.train()
    for index, (router_input, probs, routing_map) in train_records.items():
        torch.manual_seed(11)
        stock_probs, stock_map = routers[index](router_input)
        assert torch.equal(stock_probs, probs) and torch.equal(stock_map, routing_map), index
    assert fused_calls["fused_topk_with_score_function"] == 2 + LAYERS + 2  # the replays fused too

    # and the step trains every layer's router, the elastic ones included
    before = [router.weight.detach().clone() for router in routers]
    optimizer.step()
    assert all(not torch.equal(a, router.weight) for a, router in zip(before, routers))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_an_elastic_router_under_fusion_calls_no_fused_function_in_training(score_function, make_config,
                                                                            make_router, fused_calls):
    overrides = dict(moe_router_fusion=True, moe_aux_loss_coeff=0.01, moe_router_score_function=score_function,
                     moe_router_load_balancing_type="seq_aux_loss" if score_function == "sigmoid" else "aux_loss")
    if score_function == "sigmoid":
        overrides.update(moe_router_enable_expert_bias=True)
    config = make_config(**overrides)
    x = torch.randn(S, B, H)
    with mcore.patched(ElasticConfig(schedule="1-3")):
        router = make_router(config, weight_std=0.5)
        probs, routing_map = router(x)
        assert fused_calls.total() == 0
        assert set(routing_map.sum(dim=1).tolist()) <= {1, 2, 3}
        router.eval()
        with torch.no_grad():
            eval_probs, eval_map = router(x)
        assert dict(fused_calls) == {"fused_topk_with_score_function": 1}
        assert torch.equal(eval_map.sum(dim=1), torch.full((S * B,), K))
    # the point mass is stock: the fused path, in training too
    router.train()
    with mcore.patched(ElasticConfig(schedule="static")):
        router(x)
    assert fused_calls["fused_topk_with_score_function"] == 2
    assert fused_calls["fused_compute_score_for_moe_aux_loss"] == 1
    assert fused_calls["fused_moe_aux_loss"] == 1


def test_the_plan_line_has_no_fusion_note_without_an_elastic_layer(make_config):
    mcore.apply(ElasticConfig(schedule="static"))
    model = _gpt(make_config)
    assert patch_module.ROUTER_FUSION_NOTE not in mcore.log_plan(model)
