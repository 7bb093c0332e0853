"""Live routing metrics of a tiny Megatron ``GPTModel`` through Megatron's own MoE metrics tracker.

A 4-layer GPT (layers 1-2 elastic, schedule 1-3 around top-2) trains two steps with the aux loss
on; then ``tracking.log_routing_metrics`` writes through Megatron's report path into a recording
writer, and every value read back is checked against a hand computation from the routing records
and κ histograms (no elastic_moe_plugin.core.metrics code in the reference). Runs on megatron-core
0.16.1 (``save_to_aux_losses_tracker`` / ``track_moe_metrics``) and 0.19.2 (``MoEMetricsTracker``).
"""

from __future__ import annotations

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.mcore import tracking

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

LAYERS, HIDDEN, VOCAB, E, K = 4, 32, 64, 8, 2
BATCH, SEQ, STEPS = 2, 16, 2
ELASTIC_LAYERS = (1, 2)


class RecordingWriter:
    """A TensorBoard ``SummaryWriter`` stand-in: ``add_scalar(tag, value, step)`` into a dict."""

    def __init__(self):
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (float(value), step)


def _trained_gpt(make_config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    mcore.apply(ElasticConfig(schedule="1-3", layers="1-2"))
    config = make_config(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64,
                         moe_ffn_hidden_size=64, num_moe_experts=E, moe_router_topk=K, moe_aux_loss_coeff=0.01)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    # explicit causal mask (True = masked): GPTModel's default one is allocated on "cuda"
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(2)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(tokens[:, :-1], positions, attention_mask=mask, labels=tokens[:, 1:]).mean().backward()
        optimizer.step()
    return model


def _hand_layer(record, histogram) -> dict[str, float]:
    """The metrics of one layer, from their definitions (float64)."""
    counts = histogram.double()
    budgets = torch.arange(counts.numel(), dtype=torch.float64)
    share = counts / counts.sum()
    per_expert = torch.zeros(E, dtype=torch.float64)
    for row in record.expert_ids.tolist():
        for expert in row:
            if expert >= 0:
                per_expert[expert] += 1
    values = {
        "mean_kappa": float((share * budgets).sum()),
        "retained_weight_sum_mean": float(record.retained_weight_sums.double().mean()),
        "retained_weight_sum_min": float(record.retained_weight_sums.double().min()),
        "tokens_per_expert_max_over_mean": float(per_expert.max() / per_expert.mean()),
        "tokens_per_expert_cv": float(per_expert.std(unbiased=False) / per_expert.mean()),
        "topk_set_changed_frac": float((record.budgets != K).double().mean()),
    }
    for budget in (1, 2, 3):
        values[f"kappa_frac_{budget}"] = float(share[budget])
    for rank in (1, 2, 3):
        values[f"exposure_rank_{rank}"] = float(share[rank:].sum())
    return values


def test_log_routing_metrics_writes_hand_checked_values_through_megatrons_tracker(make_config, moe_tracker):
    model = _trained_gpt(make_config)
    records, histograms = mcore.routing_records(model), mcore.budget_histograms(model)
    assert sorted(records) == sorted(histograms) == list(ELASTIC_LAYERS)
    assert all(int(h.sum()) == STEPS * BATCH * SEQ for h in histograms.values())
    # Nothing of ours reached the tracker during training: metrics run only when logging asks.
    assert not any(name.startswith(tracking.TRACKER_PREFIX) for name in moe_tracker.names())
    aux_before = moe_tracker.values("load_balancing_loss")
    assert aux_before is not None and float(aux_before.sum()) > 0

    hand = {layer: _hand_layer(records[layer], histograms[layer]) for layer in ELASTIC_LAYERS}
    writer = RecordingWriter()
    returned = tracking.log_routing_metrics(model, iteration=7, writer=writer)

    for name in hand[1]:
        for layer in range(LAYERS):
            tag = f"moe/elastic_moe/{name}_layer_{layer}"
            expected = hand[layer][name] if layer in hand else 0.0  # non-elastic layers stay 0
            assert writer.scalars[tag][0] == pytest.approx(expected, rel=1e-6, abs=1e-6), tag
            assert writer.scalars[tag][1] == 7
        mean = sum(hand[layer][name] for layer in ELASTIC_LAYERS) / len(ELASTIC_LAYERS)
        assert writer.scalars[f"elastic_moe/{name}"][0] == pytest.approx(mean, rel=1e-6, abs=1e-6), name
        assert returned[f"elastic_moe/layer_1/{name}"] == pytest.approx(hand[1][name], rel=1e-12, abs=1e-12)
    # the schedule's survival a(r) (Eq. 7) rides along as a reference line: a(3) = q(3) for 1-3 around 2
    assert writer.scalars["moe/elastic_moe/survival_rank_3_layer_1"][0] == pytest.approx(0.3078, abs=1e-4)
    # this step's aux losses in the global tracker are untouched (not synced, written or cleared)
    assert torch.equal(moe_tracker.values("load_balancing_loss"), aux_before)
    assert not any(name.startswith(tracking.TRACKER_PREFIX) for name in moe_tracker.names())
    # histograms reset after logging
    assert all(int(h.sum()) == 0 for h in mcore.budget_histograms(model).values())
    assert tracking.log_routing_metrics(model, iteration=8, writer=writer)  # records still there


def test_record_routing_metrics_fills_the_global_tracker_for_megatrons_own_report(make_config, moe_tracker):
    model = _trained_gpt(make_config)
    records, histograms = mcore.routing_records(model), mcore.budget_histograms(model)
    hand = {layer: _hand_layer(records[layer], histograms[layer]) for layer in ELASTIC_LAYERS}
    names = tracking.record_routing_metrics(model, loss_scale=0.5)
    assert "elastic_moe/mean_kappa" in names and "load_balancing_loss" not in names
    values = moe_tracker.values("elastic_moe/mean_kappa")
    assert values.shape == (LAYERS,)
    # stored / loss_scale, so Megatron's report (x loss_scale) gives the value back
    expected = torch.tensor([0.0, hand[1]["mean_kappa"] / 0.5, hand[2]["mean_kappa"] / 0.5, 0.0])
    torch.testing.assert_close(values.double(), expected.double(), rtol=1e-6, atol=1e-6)
    assert moe_tracker.values("load_balancing_loss") is not None  # still beside ours


def test_routing_metrics_is_empty_without_elastic_routing(make_config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = make_config(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    assert tracking.routing_metrics(model) == {}
    assert tracking.record_routing_metrics(model) == []
    assert tracking.log_routing_metrics(model, 1, writer=RecordingWriter()) == {}


@pytest.mark.parametrize("switch", [False, True])
def test_per_layer_logging_is_the_routers_switch_with_or_without_the_patch(make_config, switch):
    """The megatron sft callback caches the switch at its first log, which may come while the patch
    is removed (the bench's static block): the answer must not depend on the patch."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = make_config(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=E,
                         moe_router_topk=K, moe_per_layer_logging=switch)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    assert tracking.per_layer_logging(model) is switch
    with mcore.patched(ElasticConfig(schedule="1-3")):
        assert tracking.per_layer_logging(model) is switch
    dense_config = make_config(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4)
    dense = GPTModel(config=dense_config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    assert tracking.per_layer_logging(dense) is False


def test_model_chunks_count_together_and_mtp_routers_are_not_decoder_layers(make_config, make_router):
    """Two virtual-pipeline chunks (layer 0 static, layer 1 elastic) plus an MTP router that 0.16
    numbers after the decoder (layer_number = num_layers + 1): records, static layers, plans and
    metrics are keyed by the global decoder layer, and the MTP router is none of them."""
    mcore.apply(ElasticConfig(schedule="1-3", layers="1"))
    config = make_config(num_layers=2, mtp_num_layers=1)
    first, second, mtp = (make_router(config, layer_number=number, weight_std=0.5).train() for number in (1, 2, 3))
    chunks = [torch.nn.ModuleList([first]), torch.nn.ModuleList([second, mtp])]
    for router in (first, second, mtp):
        router(torch.randn(16, 1, config.hidden_size))
    assert list(mcore.routing_records(chunks)) == [1]
    assert mcore.static_layers(chunks) == tracking.static_layers(chunks) == {0: config.moe_router_topk}
    plans, topk = mcore.model_plans(chunks)
    assert sorted(plans) == sorted(topk) == [0, 1] and plans[0] is None and plans[1].layer_index == 1
    assert mcore.log_plan(chunks).startswith("elastic-moe plan (megatron-core, 2 MoE layers): elastic 1-3")
    layers = {key.split("/")[1] for key in tracking.routing_metrics(chunks) if key.startswith("elastic_moe/layer_")}
    assert layers == {"layer_0", "layer_1"}
    assert set(tracking.per_layer_metrics(chunks)) == {1}  # the tracker path: elastic layers only


@pytest.mark.parametrize("log_metrics, per_layer_logging, layout", [
    ("layers", True, "layers"), ("layers", False, "means"), ("means", True, "means"), ("off", True, "off"),
])
def test_log_routing_metrics_of_48_moe_layers_writes_what_log_metrics_says(log_metrics, per_layer_logging, layout,
                                                                            make_config, make_router):
    """A loop's own ``log_routing_metrics`` on 48 MoE layers (schedule 6-10 around top-8, tiny hidden size)
    into a recording writer: ``layers`` follows the loop's ``per_layer_logging`` (31 names x (48 layers +
    the layer mean)), ``means`` writes the 21 layer means whatever it says (<= 40 scalars), ``off`` nothing."""
    from elastic_moe_plugin.core import metrics

    mcore.apply(ElasticConfig(schedule="6-10", log_metrics=log_metrics))
    config = make_config(num_layers=48, num_moe_experts=16, moe_router_topk=8)
    routers = torch.nn.ModuleList(make_router(config, layer_number=number, weight_std=0.5).train() for number in range(1, 49))
    for router in routers:
        router(torch.randn(16, 1, config.hidden_size))
    writer = RecordingWriter()
    returned = tracking.log_routing_metrics(routers, iteration=3, writer=writer, per_layer_logging=per_layer_logging)

    names = metrics.metric_names(ElasticConfig(schedule="6-10").budget_schedule(8), 16)
    means = [name for name in names if not metrics.is_schedule_constant(name)]
    expected = {"layers": len(names) * 49, "means": len(means), "off": 0}[layout]
    assert (len(names), len(means), len(writer.scalars)) == (31, 21, expected)
    if layout == "means":
        assert set(writer.scalars) == {f"elastic_moe/{name}" for name in means} and len(writer.scalars) <= 40
    assert bool(returned) == (layout != "off")
    if layout == "off":  # nor is anything recorded for a report of the loop's own
        assert tracking.record_routing_metrics(routers) == []
