"""NVIDIA's fast paths with the plugin, on one CUDA GPU (``scripts/gpu_check.sh``; skipped elsewhere).

Run alone (``pytest tests/gpu``): the CPU tests of the other folders switch the opt-in CPU runtime on
for their session, which a GPU run must never load.

1. ``moe_router_fusion`` with Transformer Engine's real fused router: a 4-layer TE-spec MoE GPT,
   layers 1-2 elastic 6-10 around top-8. One training forward calls each of TE's three fused
   functions exactly twice (static layers 0 and 3; the elastic layers none); an evaluation forward
   calls the fused top-k once per layer; the static layers' (probs, routing_map) equal the fused
   path without the plugin bit for bit.
2. CUDA graphs: an elastic router's training forward under ``torch.cuda.graph`` is refused (the run
   time backstop); the same router in evaluation (stock static top-k) captures and replays equal to
   eager; the start-up check refuses ``cuda_graph_modules=['moe_router']`` and accepts ``['attn']``.
3. ``HybridModel`` with Megatron's own Transformer Engine hybrid stack spec (``*E*E*E*E``):
   ``layers="3-5"`` routes κ over the schedule on layers 3 and 5 and k on 1 and 7, and the training
   step's gradients are finite.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)"),
]


@pytest.fixture(scope="module", autouse=True)
def nccl_world():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.distributed.init_process_group("nccl", world_size=1, rank=0)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def unpatched():
    from elastic_moe_plugin import mcore

    yield
    mcore.remove()


FUSED = ("fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss")


def test_te_fused_router_serves_the_static_layers_and_evaluation_only():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    from elastic_moe_plugin import ElasticConfig, mcore

    real = {name: getattr(moe_utils, name, None) for name in FUSED}
    if any(function is None for function in real.values()):
        pytest.skip("Transformer Engine's fused router is not installed")
    calls: collections.Counter = collections.Counter()

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    for name, function in real.items():
        setattr(moe_utils, name, counted(name, function))
    try:
        mcore.apply(ElasticConfig(schedule="6-10", layers="1-2"))
        config = TransformerConfig(
            num_layers=4, hidden_size=1024, num_attention_heads=8, num_moe_experts=64, moe_router_topk=8,
            moe_ffn_hidden_size=512, moe_router_fusion=True, moe_aux_loss_coeff=0.01,
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16,
            hidden_dropout=0.0, attention_dropout=0.0,
        )
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=64, moe_grouped_gemm=True)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=1024, max_sequence_length=512).cuda()
        seen = {}
        for index in (0, 3):
            model.decoder.layers[index].mlp.router.register_forward_hook(
                lambda module, inputs, output, index=index: seen.setdefault(
                    index, (inputs[0].detach().clone(), output[0].detach(), output[1].detach())
                )
            )
        tokens = torch.randint(0, 1024, (2, 512), device="cuda")
        positions = torch.arange(512, device="cuda").expand(2, 512)
        model(tokens, positions, attention_mask=None, labels=tokens).float().mean().backward()
        assert dict(calls) == dict.fromkeys(FUSED, 2)  # static layers 0 and 3 only
        assert sorted(mcore.routing_records(model)) == [1, 2]
        model.eval()
        with torch.no_grad():
            model(tokens, positions, attention_mask=None)
        assert calls["fused_topk_with_score_function"] == 2 + 4  # evaluation: every layer, fused
        assert "moe_router_fusion" in mcore.log_plan(model)
        mcore.remove()
        model.train()
        for index, (router_input, probs, routing_map) in seen.items():
            stock_probs, stock_map = model.decoder.layers[index].mlp.router(router_input)
            assert torch.equal(stock_probs, probs) and torch.equal(stock_map, routing_map), index
    finally:
        for name, function in real.items():
            setattr(moe_utils, name, function)


def test_a_graph_of_an_elastic_router_is_refused_and_an_eval_graph_replays():
    from megatron.core.transformer import enums
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from elastic_moe_plugin import ElasticConfig, mcore
    from elastic_moe_plugin.core.errors import UnsupportedMegatronError

    config = TransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=4, num_moe_experts=16, moe_router_topk=4,
        moe_ffn_hidden_size=256, moe_aux_loss_coeff=0.0, add_bias_linear=False,
    )
    hidden = torch.randn(64, 2, 256, device="cuda")
    with mcore.patched(ElasticConfig(schedule="2-6")):
        router = TopKRouter(config=config, pg_collection=get_default_pg_collection()).cuda()
        router.set_layer_number(1)
        router(hidden)  # eager, elastic
        with pytest.raises(UnsupportedMegatronError, match="being captured into a CUDA graph"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                router(hidden)
        torch.cuda.synchronize()
        router.eval()
        with torch.no_grad():
            eager = router(hidden)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = router(hidden)
            graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(eager, captured))
        config.cuda_graph_impl = "transformer_engine"
        config.cuda_graph_modules = [enums.CudaGraphModule.moe_router]
        with pytest.raises(UnsupportedMegatronError, match="drop 'moe_router'"):
            TopKRouter(config=config, pg_collection=get_default_pg_collection())
        config.cuda_graph_modules = [enums.CudaGraphModule.attn]
        TopKRouter(config=config, pg_collection=get_default_pg_collection())


def test_hybrid_model_with_megatrons_te_spec_routes_kappa_on_the_selected_layer_numbers():
    pytest.importorskip("transformer_engine")
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from elastic_moe_plugin import ElasticConfig, mcore

    mcore.apply(ElasticConfig(schedule="1-3", layers="3-5"))
    config = TransformerConfig(
        num_layers=8, hidden_size=256, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
        moe_ffn_hidden_size=256, moe_aux_loss_coeff=0.01, moe_grouped_gemm=True, bf16=True,
        params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
    )
    model = HybridModel(
        config=config, hybrid_stack_spec=hybrid_stack_spec, vocab_size=512, max_sequence_length=256,
        hybrid_layer_pattern="*E*E*E*E",
    ).cuda()
    experts_per_token = {}
    for layer in (1, 3, 5, 7):
        model.decoder.layers[layer].mlp.router.register_forward_hook(
            lambda module, inputs, output, layer=layer: experts_per_token.__setitem__(layer, output[1].sum(-1))
        )
    tokens = torch.randint(0, 512, (4, 256), device="cuda")
    positions = torch.arange(256, device="cuda").expand(4, 256)
    model(tokens, positions, attention_mask=None, labels=tokens).float().mean().backward()
    for layer in (1, 7):
        assert set(experts_per_token[layer].tolist()) == {2}, layer
    for layer in (3, 5):
        assert set(experts_per_token[layer].tolist()) == {1, 2, 3}, layer  # 1024 tokens: every budget drawn
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert "layers 3, 5 (MoE layers 1-2)" in mcore.log_plan(model)
