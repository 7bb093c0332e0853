"""A tiny Megatron ``GPTModel`` (4 MoE layers) trained on CPU with elastic routing in some layers."""

from __future__ import annotations

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.mcore import budget_rng

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

LAYERS, HIDDEN, VOCAB, E, K = 4, 32, 64, 8, 2
BATCH, SEQ = 2, 16


def _gpt(make_config, seed=0, **overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    values = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64,
                  moe_ffn_hidden_size=64, num_moe_experts=E, moe_router_topk=K, moe_aux_loss_coeff=0.01,
                  moe_z_loss_coeff=1e-3)
    values.update(overrides)
    config = make_config(**values)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _batch(seed=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    # An explicit causal mask (True = masked): Megatron's default mask is allocated on "cuda".
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return tokens[:, :-1], torch.arange(SEQ).expand(BATCH, SEQ), causal, tokens[:, 1:]


def _routers(model):
    return [layer.mlp.router for layer in model.decoder.layers]


def _capture_maps(model):
    maps: dict[int, list[torch.Tensor]] = {}

    def hook(index):
        return lambda module, inputs, outputs: maps.setdefault(index, []).append(outputs[1].detach())

    for index, router in enumerate(_routers(model)):
        router.register_forward_hook(hook(index))
    return maps


def test_per_layer_ranges_in_a_tiny_gpt_trained_with_adam(make_config):
    mcore.apply(ElasticConfig(schedule="1-3", layers="1-2"))
    model = _gpt(make_config)
    assert [router.layer_number for router in _routers(model)] == [1, 2, 3, 4]  # Megatron: 1-based
    maps = _capture_maps(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    tokens, positions, mask, labels = _batch()
    before = [p.detach().clone() for p in model.parameters()]
    steps, losses = 4, []
    torch.manual_seed(10)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(tokens, positions, attention_mask=mask, labels=labels).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        records = mcore.routing_records(model)
        assert sorted(records) == [1, 2]  # 0-based decoder layers
        for index in (1, 2):
            assert torch.equal(maps[index][-1].sum(dim=1), records[index].budgets)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    num_tokens = BATCH * SEQ
    for index in (0, 3):  # static layers: exactly k experts per token, every step
        assert all(torch.equal(m.sum(dim=1), torch.full((num_tokens,), K)) for m in maps[index])
    for index in (1, 2):  # elastic layers: κ varies over {1, 2, 3}
        counts = torch.cat([m.sum(dim=1) for m in maps[index]])
        assert set(counts.tolist()) == {1, 2, 3}
    histograms = mcore.budget_histograms(model)
    assert sorted(histograms) == [1, 2]
    for histogram in histograms.values():
        assert histogram.shape == (4,) and int(histogram.sum()) == steps * num_tokens
    # evaluation is static top-k everywhere
    model.eval()
    with torch.no_grad():
        model(tokens, positions, attention_mask=mask)
    assert all(torch.equal(maps[i][-1].sum(dim=1), torch.full((num_tokens,), K)) for i in range(LAYERS))


def test_moe_recompute_replays_the_budgets(make_config):
    """Selective recompute of the MoE layer replays the budget stream (a state of Megatron's RNG
    tracker, which the checkpoint snapshots), so the budgets (and the gradients) equal those of a
    run without recompute, and histograms count each token once."""
    elastic = ElasticConfig(schedule="1-3")
    tokens, positions, mask, labels = _batch(seed=3)
    runs = []
    for recompute in (False, True):
        # Dropout off: with dropout, even stock Megatron's recompute differs from no recompute
        # under the CPU emulation (its dropout and the checkpoint share one generator there).
        overrides = dict(hidden_dropout=0.0, attention_dropout=0.0)
        if recompute:
            overrides.update(recompute_granularity="selective", recompute_modules=["moe"])
        with mcore.patched(elastic):
            model = _gpt(make_config, seed=5, **overrides)
            torch.manual_seed(21)
            budget_rng.reset()  # both runs draw κ from a stream seeded with 21
            loss = model(tokens, positions, attention_mask=mask, labels=labels).mean()
            loss.backward()
            runs.append((loss.detach(), [p.grad for p in model.parameters()],
                         {i: r.budgets for i, r in mcore.routing_records(model).items()},
                         {i: h.clone() for i, h in mcore.budget_histograms(model).items()}))
    (loss_a, grads_a, budgets_a, hist_a), (loss_b, grads_b, budgets_b, hist_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert sorted(budgets_a) == sorted(budgets_b) == [0, 1, 2, 3]
    assert all(torch.equal(budgets_a[i], budgets_b[i]) for i in budgets_a)
    assert all(torch.equal(hist_a[i], hist_b[i]) and int(hist_b[i].sum()) == BATCH * SEQ for i in hist_a)
    torch.testing.assert_close(grads_a, grads_b, rtol=0, atol=0)
