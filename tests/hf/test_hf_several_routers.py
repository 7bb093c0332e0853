"""Layers that hold several routers: ERNIE-4.5-VL's text and vision routers in one decoder layer, and
DiffusionGemma's encoder and decoder stacks, whose routers share their layer numbers.

- The readers key every router of such a model by (layer, part): records, κ histograms and logged
  metrics (``elastic_moe/layer_0.vision_moe/...``), and the plan line names both parts.
- ERNIE-4.5-VL's load-balancing loss reads one logits tensor per layer that its MoE block merged
  from the two routers by token type: its counts are the realised assignments of both routers,
  merged the same way (against a hand-written loss over the records), and a static schedule is
  bitwise the stock model, loss included.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core.layer_keys import RouterKey

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_clean")]

PARTS = ("text_moe", "vision_moe")


def _ernie_vl():
    """A tiny ERNIE-4.5-VL (2 sparse layers, 8 experts, top-2; a one-block vision tower) in training
    mode, and inputs whose last 3 tokens per sequence are vision tokens, with labels."""
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as modeling
    from transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe import Ernie4_5_VLMoeConfig

    config = Ernie4_5_VLMoeConfig(
        text_config={"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "moe_num_experts": 8, "moe_k": 2,
                     "moe_intermediate_size": [32, 16], "moe_num_shared_experts": 1,
                     "mlp_layer_types": ["sparse", "sparse"], "router_aux_loss_coef": 0.01,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]}},
        vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64})
    torch.manual_seed(0)
    model = modeling.Ernie4_5_VLMoeForConditionalGeneration(config).train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a selection bias that ranks, in both routers
        for name, buffer in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    ids = torch.randint(3, 128, (2, 8), generator=generator)
    vision = (torch.arange(8) >= 5).int().expand(2, 8)
    return model, {"input_ids": ids, "labels": ids, "moe_mm_token_type_ids": vision, "use_cache": False}


def test_ernie_vl_keys_both_routers_of_a_layer_and_its_plan_line_names_both():
    model, inputs = _ernie_vl()
    hf.apply(ElasticConfig(schedule="1-3"), model=model)
    assert hf.log_plan(model) == (
        "elastic-moe plan (transformers, 2 MoE layers, 4 routers): elastic 1-3 around k=2 (σ=1.5), ernie4_5_vl_moe "
        "softmax_bias_floor rule, renormalized gate, iid sampling: layers 0-1 (text_moe), 0-1 (vision_moe); "
        "static: none")
    model(**inputs)
    records = hf.routing_records(model)
    assert sorted(records) == [RouterKey(layer, part) for layer in (0, 1) for part in PARTS]
    for layer in (0, 1):  # the text router routed the 10 text tokens, the vision router the 6 others
        assert records[RouterKey(layer, "text_moe")].budgets.numel() == 10
        assert records[RouterKey(layer, "vision_moe")].budgets.numel() == 6
    metrics = hf.routing_metrics(model)
    for layer in (0, 1):
        for part in PARTS:
            assert 1.0 <= metrics[f"elastic_moe/layer_{layer}.{part}/mean_kappa"] <= 3.0
    assert set(hf.budget_histograms(model)) == set(records)


def test_ernie_vl_static_schedule_is_bitwise_stock_loss_included():
    model, inputs = _ernie_vl()
    with torch.no_grad():
        stock = model(**inputs, output_router_logits=True)
        hf.apply(ElasticConfig(schedule="static"), model=model)
        static = model(**inputs, output_router_logits=True)
    assert torch.equal(static.logits, stock.logits)
    assert torch.equal(static.aux_loss, stock.aux_loss) and torch.equal(static.loss, stock.loss)


def test_ernie_vl_aux_loss_counts_the_realised_assignments_of_both_routers(hand_aux):
    """transformers' loss reads, per layer, the [T, E] logits the block merged from its two routers
    (text rows from the text router, vision rows from the vision one): its counts are the kept slots
    each token's own router dispatched, merged by the same token types."""
    model, inputs = _ernie_vl()
    hf.apply(ElasticConfig(schedule="1-3"), model=model)
    torch.manual_seed(0)
    out = model(**inputs, output_router_logits=True)
    records = hf.routing_records(model)
    vision = inputs["moe_mm_token_type_ids"].bool().reshape(-1)
    merged = []
    for layer in (0, 1):
        ids = torch.empty(16, 3, dtype=torch.long)
        ids[~vision] = records[RouterKey(layer, "text_moe")].expert_ids
        ids[vision] = records[RouterKey(layer, "vision_moe")].expert_ids
        merged.append(ids)
    assert any(bool((ids >= 0).sum(-1).ne(2).any()) for ids in merged)  # κ ≠ k somewhere: not the stock counts
    expected = hand_aux(out.router_logits, merged, 8)
    torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-6, atol=0)


def test_diffusion_gemma_keys_its_encoder_and_decoder_routers_apart():
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as modeling
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import (
        DiffusionGemmaConfig,
        DiffusionGemmaTextConfig,
    )

    text = DiffusionGemmaTextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=8, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, layer_types=["sliding_attention", "full_attention"])
    vision = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "position_embedding_size": 64,
              "patch_size": 4}
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=8, boi_token_id=125,
                                  eoi_token_id=126, image_token_id=127)
    hf.apply(ElasticConfig(schedule="1-3"))
    torch.manual_seed(0)
    model = modeling.DiffusionGemmaForBlockDiffusion(config).train()
    assert hf.log_plan(model) == (
        "elastic-moe plan (transformers, 2 MoE layers, 4 routers): elastic 1-3 around k=2 (σ=1.5), diffusion_gemma "
        "softmax_topk rule, renormalized gate, iid sampling: layers 0-1 (decoder), 0-1 (encoder); static: none")
    generator = torch.Generator().manual_seed(1)
    model(input_ids=torch.randint(3, 120, (2, 8), generator=generator),
          decoder_input_ids=torch.randint(3, 120, (2, 8), generator=generator))
    assert sorted(hf.routing_records(model)) == [RouterKey(layer, part) for layer in (0, 1)
                                                 for part in ("decoder", "encoder")]


# ------------------------------------------------------------------------------- routers run once per pass
def test_a_looped_router_draws_per_pass_and_a_checkpoint_recompute_replays_each_pass(tiny):
    """Inkling-2-Loop runs layer 1 twice per forward with the same router: each pass draws its own κ,
    and under gradient checkpointing backward recomputes the passes last first, each with its own
    κ: the gradients are those of the same κ without checkpointing."""
    if "inkling2_loop" not in {family.name for family in hf.covered_router_classes().values()}:
        pytest.skip("this transformers has no Inkling-2-Loop")
    inputs = tiny.inputs("inkling2_loop")
    gradients = []
    for checkpointing in (False, True):
        hf.remove()
        hf.apply(ElasticConfig(schedule="1-3"))
        model = tiny.model("inkling2_loop")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(0)  # the same κ stream for both runs
        model(**inputs).loss.backward()
        looped = model.model.layers[1].mlp.gate
        assert hf.budget_histograms(model)[1].sum() == 2 * 16  # two passes of 16 tokens, each drawn once
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        assert looped.weight.grad is not None
    without, with_checkpointing = gradients
    assert without.keys() == with_checkpointing.keys()
    for name, grad in without.items():
        torch.testing.assert_close(with_checkpointing[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_ernie_vl_text_only_batch_counts_the_text_router_and_forgets_the_vision_record(hand_aux):
    """A batch without vision tokens runs the text router only: the loss counts its realised slots
    (the block reshapes its logits into the tensor the loss reads), and the vision routers' records
    of the earlier mixed batch are forgotten rather than logged as this step's."""
    model, inputs = _ernie_vl()
    hf.apply(ElasticConfig(schedule="1-3"), model=model)
    model(**inputs)
    assert RouterKey(0, "vision_moe") in hf.routing_records(model)
    text_only = {**inputs, "moe_mm_token_type_ids": torch.zeros_like(inputs["moe_mm_token_type_ids"])}
    out = model(**text_only, output_router_logits=True)
    records = hf.routing_records(model)
    assert sorted(records) == [RouterKey(0, "text_moe"), RouterKey(1, "text_moe")]
    assert "elastic_moe/layer_0.vision_moe/retained_weight_sum_mean" not in hf.routing_metrics(model)
    ids = [records[RouterKey(layer, "text_moe")].expert_ids for layer in (0, 1)]
    assert any(bool((layer_ids >= 0).sum(-1).ne(2).any()) for layer_ids in ids)
    torch.testing.assert_close(out.aux_loss.double(), hand_aux(out.router_logits, ids, 8), rtol=1e-6, atol=0)


def test_router_parts_name_each_stack_the_same_at_every_depth():
    """Qwen3-Omni's thinker and talker stacks differ in depth: every router of a stack gets the same
    part, including the thinker's layers the talker does not have."""
    from elastic_moe_plugin.core.records import RouterSite
    from elastic_moe_plugin.hf.records import router_parts

    def site(name: str, layer: int) -> RouterSite:
        return RouterSite(name, torch.nn.Identity(), layer, 2, 8)

    sites = [site(f"thinker.model.layers.{i}.mlp.gate", i) for i in range(4)]
    sites += [site(f"talker.model.layers.{i}.mlp.gate", i) for i in range(2)]
    parts = router_parts(sites)
    assert parts == {s.name: s.name.split(".")[0] for s in sites}
    assert router_parts(sites[:4]) == {}  # one router per layer: plain layer indices
