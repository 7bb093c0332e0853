"""megatron-core 0.19's ``HybridModel`` on the CPU with the plugin: the CPU runtime's local stack spec
(``elastic_moe_plugin.cpu_runtime.hybrid``), its final-norm redirection, and elastic routing by
pattern position.

A tiny model of pattern ``*E*E-E*E`` (attention, MoE and MLP layers; MoE layers 1, 3, 5, 7: every
symbol is a layer), 4 experts top-2, hidden 32, built with the plugin applied by
``mcore.patched(ElasticConfig(schedule="1-3", layers="3-5"))``: layers 3 and 5 route elastically,
1 and 7 stay top-2. Checked against the same model built without the plugin (same seed): the static
schedule and evaluation are stock bit for bit; in training κ is the drawn κ on 3 and 5, follows the
schedule's pmf there, and is k on 1 and 7. Skipped where ``megatron.core.models.hybrid`` does not
exist (megatron-core 0.16.1 has only ``models/mamba``).
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, cpu_runtime, mcore
from elastic_moe_plugin.megatron_lm import CPU_HYBRID_SPEC, cpu_megatron_args

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]
if importlib.util.find_spec("megatron.core.models.hybrid") is None:
    pytestmark.append(pytest.mark.skip(reason="this megatron-core has no megatron.core.models.hybrid (HybridModel: 0.19+)"))

PATTERN = "*E*E-E*E"
MOE_LAYERS, ELASTIC_LAYERS, STATIC_LAYERS = (1, 3, 5, 7), (3, 5), (1, 7)
HIDDEN, VOCAB, EXPERTS, TOPK = 32, 64, 4, 2
BATCH, SEQ = 4, 32
ELASTIC = ElasticConfig(schedule="1-3", layers="3-5")


def _hybrid(make_config, pattern=PATTERN, seed=0):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from elastic_moe_plugin.cpu_runtime import hybrid

    config = make_config(num_layers=len(pattern), hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64,
                         moe_ffn_hidden_size=32, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                         moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01, hidden_dropout=0.0,
                         attention_dropout=0.0)
    torch.manual_seed(seed)
    return HybridModel(config=config, hybrid_stack_spec=hybrid.hybrid_stack_spec, vocab_size=VOCAB,
                       max_sequence_length=SEQ, hybrid_layer_pattern=pattern, position_embedding_type="rope")


def _batch(seed=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    # An explicit causal mask (True = masked): Megatron's default mask is allocated on "cuda".
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return tokens[:, :-1], torch.arange(SEQ).expand(BATCH, SEQ), causal, tokens[:, 1:]


def _loss_and_grads(model, batch):
    """Per-token losses [B, S] of one training forward, and every parameter's gradient after backward."""
    tokens, positions, mask, labels = batch
    model.zero_grad(set_to_none=True)
    losses = model(tokens, positions, mask, labels=labels)
    losses.sum().backward()
    return losses.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _capture_maps(model):
    """{layer: [routing_map [T, E] per forward]} for the routers of the model's MoE layers."""
    maps: dict[int, list[torch.Tensor]] = {}
    for index, layer in enumerate(model.decoder.layers):
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            router.register_forward_hook(
                lambda module, inputs, outputs, index=index: maps.setdefault(index, []).append(outputs[1].detach()))
    return maps


# ====================================================================================== the CPU spec
@pytest.mark.parametrize("pattern", [PATTERN, "*E*E*E*E"])
def test_the_cpu_spec_builds_one_local_layer_per_symbol(make_config, pattern):
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    with mcore.patched(ELASTIC):
        model = _hybrid(make_config, pattern)
    assert isinstance(model.decoder, HybridStack)
    layers = model.decoder.layers
    assert len(layers) == len(pattern)
    for index, (symbol, layer) in enumerate(zip(pattern, layers)):
        assert layer.layer_number == index + 1, index
        if symbol == "*":
            assert type(layer) is TransformerLayer and isinstance(layer.self_attention, SelfAttention)
            assert isinstance(layer.self_attention.core_attention, DotProductAttention)
            assert isinstance(layer.input_layernorm, torch.nn.LayerNorm)
        elif symbol == "-":
            assert type(layer) is MLPLayer and isinstance(layer.pre_mlp_layernorm, torch.nn.LayerNorm)
        else:
            assert type(layer) is MoETransformerLayer and isinstance(layer.mlp.experts, SequentialMLP)
            assert isinstance(layer.pre_mlp_layernorm, torch.nn.LayerNorm)
            assert layer.mlp.router.layer_number == index + 1  # the plugin's layer index is layer_number - 1
    # the final norm: the torch norm the runtime puts where HybridStack names Transformer Engine's TENorm
    assert type(model.decoder.final_norm) is torch.nn.LayerNorm
    assert not [name for name, module in model.named_modules() if type(module).__module__.startswith("transformer_engine")]


def test_the_final_norm_redirection_is_scoped_to_the_runtime():
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    assert hybrid_block.TENorm is WrappedTorchNorm
    cpu_runtime.disable()
    try:
        assert hybrid_block.TENorm is TENorm  # restored by identity
    finally:
        cpu_runtime.enable(force=True)
    assert hybrid_block.TENorm is WrappedTorchNorm


@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is not None, reason="mamba_ssm imports: M is built here")
def test_a_mamba_symbol_is_refused_naming_the_symbol_the_pattern_and_what_is_supported(make_config):
    with pytest.raises(cpu_runtime.MegatronCPUError) as caught:
        _hybrid(make_config, pattern="*EM-E")
    message = str(caught.value)
    for part in ("'*EM-E'", "symbol 'M' (Mamba) at layer 2", "mamba_ssm", "'*' attention, '-' MLP, 'E' MoE",
                 "elastic_moe_plugin.cpu_runtime.hybrid.hybrid_stack_spec"):
        assert part in message, message


def test_megatrons_spec_loader_finds_the_spec_and_importing_it_imports_no_megatron():
    from megatron.core.transformer.spec_utils import import_module

    from elastic_moe_plugin.cpu_runtime import hybrid

    # Megatron-LM's --spec MODULE NAME: import_module reads vars(module)[NAME]
    assert import_module(list(CPU_HYBRID_SPEC[1:])) is hybrid.hybrid_stack_spec
    code = textwrap.dedent("""
        import sys
        import elastic_moe_plugin.cpu_runtime.hybrid
        import elastic_moe_plugin.megatron_lm
        loaded = sorted(name for name in sys.modules if name.split(".")[0] == "megatron")
        assert not loaded, loaded
        print("no megatron")
    """)
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0 and "no megatron" in result.stdout, result.stderr[-3000:]


def test_the_front_door_adds_the_cpu_spec_to_a_hybrid_run_without_one():
    base = ["--num-experts", "4"]
    assert CPU_HYBRID_SPEC == ("--spec", "elastic_moe_plugin.cpu_runtime.hybrid", "hybrid_stack_spec")
    assert cpu_megatron_args([*base, "--hybrid-layer-pattern", "*E"]) == [*base, "--hybrid-layer-pattern", "*E",
                                                                          *CPU_HYBRID_SPEC]
    assert cpu_megatron_args(["--hybrid-layer-pattern=*E"])[-3:] == list(CPU_HYBRID_SPEC)
    assert cpu_megatron_args(["--hybrid-override-pattern", "*E"])[-3:] == list(CPU_HYBRID_SPEC)  # the deprecated name
    own = ["--hybrid-layer-pattern", "*E", "--spec", "my.module", "my_spec"]
    assert cpu_megatron_args(own) == own  # the user's spec is left alone
    assert cpu_megatron_args(base) == base  # a GPT model has no stack spec to add


# ====================================================================================== against stock
def test_the_static_schedule_is_stock_bit_for_bit_forward_and_backward(make_config):
    batch = _batch()
    stock_losses, stock_grads = _loss_and_grads(_hybrid(make_config, seed=3), batch)
    with mcore.patched(ElasticConfig(schedule="static", layers="3-5")):
        losses, grads = _loss_and_grads(_hybrid(make_config, seed=3), batch)
    assert torch.equal(losses, stock_losses)
    assert sorted(grads) == sorted(stock_grads) and any(".mlp.experts." in name for name in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, stock_grads[name]), name


def test_evaluation_is_stock_bit_for_bit(make_config):
    tokens, positions, mask, _ = _batch(seed=2)
    stock = _hybrid(make_config, seed=4).eval()
    with torch.no_grad():
        expected = stock(tokens, positions, mask)
    with mcore.patched(ELASTIC):
        model = _hybrid(make_config, seed=4).eval()
        maps = _capture_maps(model)
        with torch.no_grad():
            logits = model(tokens, positions, mask)
    assert torch.equal(logits, expected)
    assert sorted(maps) == list(MOE_LAYERS)
    assert all(torch.equal(m[-1].sum(dim=1), torch.full((BATCH * SEQ,), TOPK)) for m in maps.values())


# ====================================================================================== training κ
def test_training_kappa_is_the_drawn_kappa_on_3_and_5_follows_the_pmf_and_is_k_on_1_and_7(make_config):
    """Per forward the experts per token (routing-map row sums) on layers 3 and 5 equal κ as drawn
    (``mcore.routing_records``), and the plugin's histograms count exactly those; layers 1 and 7 route
    k = 2 to every token. Over 8 forwards x 128 tokens x 2 layers (2048 draws) each κ's share is
    within 4 binomial standard deviations of the pmf: κ is i.i.d. from the pmf (``sampling="iid"``),
    so a correct draw fails this bound with probability < 1e-4 per share; the stream is seeded, so
    the outcome is fixed. Every gradient is finite and the elastic layers' experts get gradients."""
    schedule = ELASTIC.budget_schedule(TOPK)
    forwards, tokens_per_forward = 8, BATCH * SEQ
    with mcore.patched(ELASTIC):
        model = _hybrid(make_config, seed=5)
        maps = _capture_maps(model)
        torch.manual_seed(11)
        for step in range(forwards):
            _, grads = _loss_and_grads(model, _batch(seed=100 + step))
            records = mcore.routing_records(model)
            assert sorted(records) == list(ELASTIC_LAYERS)
            for layer in ELASTIC_LAYERS:
                assert torch.equal(maps[layer][-1].sum(dim=1), records[layer].budgets), (step, layer)
            assert all(torch.isfinite(grad).all() for grad in grads.values())
        histograms = mcore.budget_histograms(model)
        assert mcore.static_layers(model) == dict.fromkeys(STATIC_LAYERS, TOPK)
    for layer in STATIC_LAYERS:
        assert all(torch.equal(m.sum(dim=1), torch.full((tokens_per_forward,), TOPK)) for m in maps[layer])
    counts = torch.zeros(schedule.high + 1, dtype=torch.long)
    for layer in ELASTIC_LAYERS:
        per_token = torch.cat([m.sum(dim=1) for m in maps[layer]])
        layer_counts = torch.bincount(per_token, minlength=schedule.high + 1)
        assert torch.equal(histograms[layer].long(), layer_counts), layer
        counts += layer_counts
    draws = int(counts.sum())
    assert draws == forwards * tokens_per_forward * len(ELASTIC_LAYERS) and counts[0] == 0
    for budget, probability in zip(schedule.budgets, schedule.pmf):
        share, sd = counts[budget].item() / draws, math.sqrt(probability * (1 - probability) / draws)
        assert abs(share - probability) < 4 * sd, f"κ={budget}: {share:.4f} vs {probability:.4f}"
    experts = [name for name in grads if ".mlp.experts." in name]
    assert {int(name.split(".")[2]) for name in experts} == set(MOE_LAYERS)
