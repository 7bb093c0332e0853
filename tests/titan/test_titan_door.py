"""The torchtitan door in one process, on torchtitan's own DeepSeek-V3 debug model and its MoE layers.

References: the stock forward (bitwise, where the door claims equivalence: a static schedule, and
κ ≡ k through the elastic path without ``route_norm``); stock top-κ_t per token (the elastic output
of a token that keeps κ_t experts is what stock top-κ_t computes for it); closed forms of the
dispatch (rows = Σκ, realised counts).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import debug_model, forward, tokens

from elastic_moe_plugin import ElasticConfig, titan
from elastic_moe_plugin.core.budget_stream import BudgetStream
from elastic_moe_plugin.core.errors import ConfigError, UnsupportedTorchtitanError
from elastic_moe_plugin.core.patching import is_patched, unwrap
from elastic_moe_plugin.core.records import routing_records
from elastic_moe_plugin.core.router_state import state_of
from elastic_moe_plugin.titan import budget_rng
from elastic_moe_plugin.titan.routing import DROPPED, kept_pairs_reorder, realised_counts

pytestmark = [pytest.mark.titan, pytest.mark.usefixtures("titan_clean")]

#: a point mass at the debug model's k = 3 reached through the elastic path (κ ≡ 3, width 4)
POINT_MASS = ElasticConfig(schedule="2-4", sigma=1e-3)
#: router options beyond the debug model's (softmax, no route_norm): sigmoid scores ranked with the
#: bias inside 2 of 4 expert groups, scaled (DeepSeek-V3's full router) -- with and without route_norm
SIGMOID_GROUPED = {"score_func": "sigmoid", "num_expert_groups": 4, "num_limited_groups": 2, "route_scale": 2.5}


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = forward(model, tokens()).float().pow(2).mean()
    loss.backward()
    return loss.detach(), [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]


def _moe(seed: int = 0, **router) -> tuple[torch.nn.Module, torch.Tensor]:
    """Layer 1's MoE of the debug model, its aux-loss-free bias set to non-zero values (so it ranks),
    and an input [2, 16, D]."""
    model = debug_model(seed, **router)
    titan.tag_layers(model)  # a model built before apply
    moe = model.layers["1"].moe
    with torch.no_grad():
        moe.expert_bias_E.copy_(torch.linspace(-0.02, 0.02, moe.expert_bias_E.numel()))
    x = torch.randn(2, 16, moe.router.gate.weight.shape[1], generator=torch.Generator().manual_seed(2))
    return moe, x


@pytest.mark.parametrize("config", [ElasticConfig(schedule="static"), POINT_MASS], ids=["static", "point_mass"])
def test_static_and_point_mass_train_as_stock_bitwise(config):
    stock_loss, stock_grads = _loss_and_grads(debug_model())
    titan.apply(config)
    loss, grads = _loss_and_grads(debug_model())
    assert torch.equal(loss, stock_loss)
    assert len(grads) == len(stock_grads) and all(map(torch.equal, grads, stock_grads))
    titan.apply(ElasticConfig(schedule="1-5"))
    elastic_loss, _ = _loss_and_grads(debug_model())
    assert not torch.equal(elastic_loss, stock_loss)  # the comparison can fail


@pytest.mark.parametrize("route_norm", [False, True])
def test_point_mass_equals_stock_under_bias_groups_and_scale(route_norm):
    moe, x = _moe(**SIGMOID_GROUPED, route_norm=route_norm)
    stock = moe(x)
    titan.apply(POINT_MASS)
    elastic = moe(x)
    if route_norm:  # Σ of the k kept scores in rank order, stock's in topk(sorted=False) order
        torch.testing.assert_close(elastic, stock, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(elastic, stock)


@pytest.mark.parametrize("router", [{}, {**SIGMOID_GROUPED, "route_norm": True}], ids=["softmax", "sigmoid_grouped"])
def test_each_token_gets_what_stock_top_kappa_computes_for_it(router):
    moe, x = _moe(**router)
    titan.apply(ElasticConfig(schedule="2-4" if router else "1-5"))
    elastic = moe(x).detach()
    budgets = state_of(moe).latest_draw.budgets.view(2, 16)
    titan.remove()
    dispatcher = moe.routed_experts.token_dispatcher
    for budget in budgets.unique().tolist():
        moe.router.top_k = dispatcher.top_k = budget
        stock = moe(x).detach()
        mask = budgets == budget
        torch.testing.assert_close(elastic[mask], stock[mask], rtol=1e-5, atol=1e-6)
    assert len(budgets.unique()) >= 3  # several budgets met, so the check compares different top-κ


def test_experts_multiply_the_kept_pairs_and_the_bias_counts_them():
    moe, x = _moe()
    rows: list[int] = []
    hook = moe.routed_experts.inner_experts.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    titan.apply(ElasticConfig(schedule="1-5"))
    moe.tokens_per_expert_E.zero_()
    moe(x)
    hook.remove()
    drawn = state_of(moe).latest_draw
    record = routing_records(titan.moe_sites([moe]))[1]
    kept_ids = record.expert_ids[record.expert_ids >= 0]
    assert rows == [drawn.total] and drawn.total == int(record.budgets.sum()) < 32 * 5
    expected = torch.bincount(kept_ids, minlength=moe.router.num_experts).float()
    assert torch.equal(moe.tokens_per_expert_E, expected)


def test_dispatch_helpers_closed_forms():
    ids = torch.tensor([[2, 0, DROPPED], [1, DROPPED, DROPPED], [0, 2, 1]])
    assert realised_counts(ids, 3).tolist() == [2, 2, 2]
    scores = torch.arange(9, dtype=torch.float32).view(3, 3)
    x = torch.arange(3, dtype=torch.float32).view(3, 1) * 10

    class Dispatcher:
        top_k = 2  # the config's k; the kept-pairs path divides by the width instead

    dispatcher = Dispatcher()
    dispatcher.__dict__["_elastic_kept_pairs"] = 6
    rows, token_indices, kept_scores = kept_pairs_reorder(lambda *args: None)(dispatcher, x, scores, ids)
    # by expert, each expert's pairs in token order: e0: t0, t2; e1: t1, t2; e2: t0, t2
    assert token_indices.tolist() == [0, 2, 1, 2, 0, 2]
    assert kept_scores.tolist() == [1.0, 6.0, 3.0, 8.0, 0.0, 7.0]
    assert rows.view(-1).tolist() == [0.0, 20.0, 10.0, 20.0, 0.0, 20.0]


def test_a_recompute_replays_the_forwards_kappa():
    titan.apply(ElasticConfig(schedule="1-5"))

    def grads(checkpointed: bool) -> tuple[list[torch.Tensor], int]:
        moe, x = _moe()
        budget_rng.STREAM.replace(BudgetStream(123, 0))
        x.requires_grad_(True)
        run = (lambda y: torch.utils.checkpoint.checkpoint(moe, y, use_reentrant=False)) if checkpointed else moe
        run(x).square().sum().backward()
        return [x.grad, *(p.grad for p in moe.parameters() if p.grad is not None)], budget_rng.STREAM.load().counter

    plain, plain_draws = grads(False)
    recomputed, recomputed_draws = grads(True)
    assert plain_draws == recomputed_draws == 1
    assert all(map(torch.equal, plain, recomputed))


def test_the_stream_state_round_trips_and_restarts_from_the_seed():
    budget_rng.start(seed=7, tensor_parallel=1)
    assert budget_rng.StreamState().state_dict() == {"seed": 2_147_483_647 + 7, "counter": 0}
    budget_rng.StreamState().load_state_dict({"seed": 11, "counter": 5})
    assert budget_rng.STREAM.load() == BudgetStream(11, 5)
    budget_rng.start(seed=None, tensor_parallel=2)
    assert budget_rng.STREAM.load() == BudgetStream(2_147_483_647, 0) and budget_rng.token_shard() == 0


def test_apply_is_idempotent_and_remove_restores_by_identity():
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.common.moe import MoE
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    originals = [(owner, name, vars(owner)[name]) for owner, name in
                 [(MoE, "forward"), (LocalTokenDispatcher, "_local_reorder"), (Decoder, "__init__")]]  # fmt: skip
    titan.apply(POINT_MASS)
    assert all(is_patched(vars(owner)[name]) and unwrap(vars(owner)[name]) is stock for owner, name, stock in originals)
    symbols = titan.patched_symbols()
    titan.apply(POINT_MASS)
    assert titan.patched_symbols() == symbols
    titan.remove()
    assert all(vars(owner)[name] is stock for owner, name, stock in originals)
    assert titan.patched_symbols() == []


def test_an_untested_torchtitan_is_refused(monkeypatch):
    import torchtitan

    monkeypatch.setattr(torchtitan, "__version__", "0.4.0")
    with pytest.raises(UnsupportedTorchtitanError, match=r"torchtitan >=0\.3,<0\.4, found 0\.4\.0.*ALLOW_UNSUPPORTED"):
        titan.apply(POINT_MASS)
    assert not titan.is_applied()


def test_layers_tag_the_decoder_and_keep_the_others_stock():
    titan.apply(ElasticConfig(schedule="1-5", layers="2-3"))
    model = debug_model()
    forward(model, tokens())
    plans = {index: plan for index, plan in titan.model_plans(model)[0].items()}
    assert [index for index, plan in plans.items() if plan is not None] == [2, 3]
    assert sorted(routing_records(titan.moe_sites(model))) == [2, 3]


def test_group_reach_and_top_p_and_forced_balance_are_refused_naming_the_fix():
    titan.apply(ElasticConfig(schedule="1-5"))
    with pytest.raises(ConfigError, match=r"num_limited_groups=2 of num_expert_groups=4.*schedule='2-4'"):
        debug_model(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2)  # reach 4 < b = 5
    titan.apply(ElasticConfig(mode="top_p"))
    with pytest.raises(ConfigError, match=r"p plus the aux-loss-free expert bias.*mode='elastic'"):
        debug_model()
    titan.apply(POINT_MASS)
    with pytest.raises(ConfigError, match="--debug.moe_force_load_balance"):
        debug_model(_debug_force_load_balance=True)


def test_top_p_routes_a_softmax_router_without_bias():
    moe, x = _moe()
    moe.expert_bias_E = None
    titan.apply(ElasticConfig(mode="top_p", top_p=0.5))
    rows: list[int] = []
    moe.routed_experts.inner_experts.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    moe(x)
    record = routing_records(titan.moe_sites([moe]))[1]
    probabilities = torch.softmax(moe.router.gate(x).view(32, -1).float(), -1).sort(-1, descending=True).values
    preceding = probabilities.cumsum(-1) - probabilities
    assert torch.equal(record.budgets, (preceding < 0.5).sum(-1).clamp(min=1))
    assert rows == [int(record.budgets.sum())]


def test_the_override_entry_applies_the_config_and_spells_errors_in_json(monkeypatch):
    from torchtitan.models.deepseek_v3 import model_registry

    monkeypatch.setenv("ELASTIC_MOE_SIGMA", "2.0")
    moe_config = next(layer.moe for layer in model_registry("debugmodel").model.layers if layer.moe is not None)
    assert titan.elastic_moe(moe_config, schedule="6-10", center=8) is moe_config
    assert titan.active_config() == ElasticConfig(schedule="6-10", center=8, sigma=2.0)
    with pytest.raises(ConfigError, match=r'unknown key\(s\) \'schedul\'.*"schedule": "6-10"'):
        titan.elastic_moe(moe_config, schedul="6-10")


def test_trainer_options_that_would_freeze_kappa_are_refused(monkeypatch):
    from torchtitan.trainer import Trainer

    def refusal(**changes) -> str:
        config = Trainer.Config()
        for path, value in changes.items():
            section, name = path.split("__")
            setattr(getattr(config, section), name, value)
        with pytest.raises(UnsupportedTorchtitanError) as caught:
            titan.trainer.check_trainer_config(config)
        return str(caught.value)

    assert "--compile.components loss" in refusal(compile__enable=True)
    assert "--parallelism.pipeline_parallel_degree 1" in refusal(parallelism__pipeline_parallel_degree=2)
    assert "--parallelism.tensor_parallel_degree 1" in refusal(parallelism__tensor_parallel_degree=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "Set --training.disable_cuda_graphs" in refusal()
    monkeypatch.undo()
    titan.trainer.check_trainer_config(dataclasses.replace(Trainer.Config()))  # the defaults pass on a CPU


def test_deepep_and_hybridep_configs_are_refused_by_name():
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.trainer import Trainer

    for backend, name in [("deepep", "DeepEPTokenDispatcher"), ("hybridep", "HybridEPTokenDispatcher")]:
        config = Trainer.Config(model_spec=model_registry("debugmodel", moe_comm_backend=backend))
        config.training.disable_cuda_graphs = True
        with pytest.raises(UnsupportedTorchtitanError, match=rf"layers\.1\.moe.*{name}"):
            titan.trainer.check_trainer_config(config)


def test_metrics_follow_log_metrics_and_restart_the_histograms():
    titan.apply(ElasticConfig(schedule="1-5", log_metrics="means"))
    model = debug_model()
    forward(model, tokens())
    means = titan.logged_metrics([model])
    assert means and all(name.count("/") == 1 for name in means)
    assert means["elastic_moe/mean_kappa"] == pytest.approx(
        np.mean([routing_records(titan.moe_sites(model))[i].budgets.float().mean().item() for i in range(1, 6)])
    )
    titan.apply(ElasticConfig(schedule="1-5", log_metrics="off"))
    assert titan.logged_metrics([model]) == {}
