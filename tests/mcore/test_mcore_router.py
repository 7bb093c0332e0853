"""Elastic routing inside Megatron-core's real ``TopKRouter`` (issue 4), on CPU.

Every expectation is a hand-written reference: stock megatron-core itself (bitwise, where the issue
claims bitwise equality), ``torch.sort`` for the selected set, closed forms for the gate weights,
the realised-assignment aux losses and the top-1 derivatives of docs/gates.md#gate-conventions, and scipy's chi-square test
for the budget distribution.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from packaging.version import Version

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.mcore import budget_rng
from elastic_moe_plugin.core.config import ConfigError
from elastic_moe_plugin.mcore import (
    LayerPlan,
    RoutingRecord,
    UnsupportedMegatronError,
    elastic_routing,
)
from elastic_moe_plugin.mcore import patch as patch_module
from elastic_moe_plugin.mcore import routing as routing_module
from elastic_moe_plugin.core.schedule import BudgetSchedule
from counters import OpCounter, host_syncs
from megatron_support import force_budgets

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

S, B, H = 6, 3, 16  # [seq, batch, hidden] of the router inputs
AUX_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
TRACKED = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


def _topk_router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter


def _padding_mask(seq=S, bsz=B):
    """[S, B] bool, True = padding (Megatron's polarity): a ragged tail per sequence."""
    mask = torch.zeros(seq, bsz, dtype=torch.bool)
    for b in range(bsz):
        mask[seq - b :, b] = True  # sequence b has b padded positions
    return mask


def _run(router, x, padding_mask, grad_probs, tracker, seed=7):
    """One training forward + backward through ``router.forward``; everything the issue compares."""
    x = x.detach().clone().requires_grad_()
    router.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    probs, routing_map = router(x, padding_mask=padding_mask) if padding_mask is not None else router(x)
    (probs * grad_probs).sum().backward()
    out = {
        "probs": probs.detach(),
        "routing_map": routing_map,
        "input_grad": x.grad,
        "weight_grad": router.weight.grad,
    }
    for name in TRACKED:
        out["tracker:" + name] = tracker.values(name)
    for buffer in ("local_tokens_per_expert", "expert_bias", "global_tokens_per_expert"):
        value = getattr(router, buffer, None)
        out["buffer:" + buffer] = None if value is None else value.detach().clone()
    return out


def _assert_all_equal(stock, other):
    assert stock.keys() == other.keys()
    for key in stock:
        if stock[key] is None:
            assert other[key] is None, key
        else:
            assert other[key] is not None, key
            assert other[key].dtype == stock[key].dtype and other[key].shape == stock[key].shape, key
            assert torch.equal(stock[key], other[key]), f"{key} differs from stock"


# ======================================================================== point mass == stock
#: σ of a schedule {k−1..k+1} whose outer budgets have probability exactly 0 (exp(−1/(2σ²))
#: underflows), so κ ≡ k is drawn through the elastic code path with candidate width b = k + 1
POINT_MASS_SIGMA = 1e-3


def point_mass_config(topk: int) -> ElasticConfig:
    """κ ≡ k through ``elastic_routing`` (not the static short-cut), with b = k + 1 ≠ k, so that
    anything sized from b instead of k shows."""
    return ElasticConfig(schedule=f"{topk - 1}-{topk + 1}", sigma=POINT_MASS_SIGMA)


STOCK_CASES = {
    "softmax_post": {},
    "softmax_pre": dict(moe_router_pre_softmax=True),
    "sigmoid_expert_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "group_limited": dict(num_moe_experts=8, moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=2),
    # b // group_topk = 4 // 2 differs from k // group_topk = 3 // 2: groups must be scored with k
    "group_limited_top3": dict(num_moe_experts=16, moe_router_num_groups=4, moe_router_group_topk=2,
                               moe_router_topk=3, moe_router_score_function="sigmoid"),
    "capacity_drop": dict(moe_expert_capacity_factor=1.0),
    "capacity_drop_position": dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position"),
    "drop_and_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    "drop_and_pad_position": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                                  moe_token_drop_policy="position"),
    "top8_capacity_drop": dict(num_moe_experts=16, moe_router_topk=8, moe_expert_capacity_factor=1.0),
    "aux_loss": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01),
    "global_aux_loss": dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01),
    "z_loss": dict(moe_z_loss_coeff=1e-3),
    "everything_pre_softmax": dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                                   moe_expert_capacity_factor=1.5, moe_router_topk_scaling_factor=2.0),
}


@pytest.mark.parametrize("route", ["static_shortcut", "point_mass_elastic"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
@pytest.mark.parametrize("case", list(STOCK_CASES))
def test_static_schedule_is_bitwise_stock(case, masked, route, make_config, make_router, moe_tracker):
    """Through the patched ``router.forward``: ``schedule="static"`` (which runs stock code) and a
    point mass drawn by the elastic code path both reproduce stock bit for bit: probs, map,
    gradients, aux/z-loss logs and the expert-bias and aux-loss buffers."""
    if masked and case == "sigmoid_expert_bias":
        pytest.skip("stock Megatron's _apply_expert_bias cannot take a padding mask ([T,E] & [T] broadcast)")
    config = make_config(**STOCK_CASES[case])
    torch.manual_seed(123)
    x = torch.randn(S, B, H)
    grad_probs = torch.randn(S * B, config.num_moe_experts)
    mask = _padding_mask() if masked else None

    stock_router = make_router(config, weight_std=1.0)
    if config.moe_router_enable_expert_bias:
        with torch.no_grad():
            stock_router.expert_bias.copy_(torch.linspace(-0.3, 0.3, config.num_moe_experts))
    patched_router = make_router(config, weight_std=1.0)
    patched_router.load_state_dict(stock_router.state_dict())

    stock = [_run(stock_router, x, mask, grad_probs, moe_tracker, seed=s) for s in (7, 8)]
    moe_tracker.reset()
    point_mass = route == "point_mass_elastic"
    with mcore.patched(point_mass_config(config.moe_router_topk) if point_mass else ElasticConfig(schedule="static")):
        assert mcore.is_applied()
        patched = [_run(patched_router, x, mask, grad_probs, moe_tracker, seed=s) for s in (7, 8)]
        records = mcore.routing_records(patched_router)
    for a, b in zip(stock, patched):
        _assert_all_equal(a, b)
    if point_mass:  # it really took the elastic path, with b = k + 1
        assert records[0].expert_ids.shape[1] == config.moe_router_topk + 1
        assert torch.equal(records[0].budgets, torch.full((S * B,), config.moe_router_topk))
    else:
        assert records == {}
    # The comparison is not vacuous: the aux losses and z-loss cases really logged something.
    if config.moe_aux_loss_coeff or config.moe_z_loss_coeff:
        assert any(stock[-1]["tracker:" + n] is not None and stock[-1]["tracker:" + n].abs().sum() > 0 for n in TRACKED)


ELASTIC_PATH_CASES = {
    "softmax_post": dict(),
    "softmax_pre": dict(moe_router_pre_softmax=True),
    "softmax_post_aux": dict(moe_aux_loss_coeff=0.01),
    "softmax_pre_aux": dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01),
    "softmax_pre_seq_aux": dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01,
                                moe_router_load_balancing_type="seq_aux_loss"),
    "softmax_post_global_aux": dict(moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="global_aux_loss"),
}


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
@pytest.mark.parametrize("case", list(ELASTIC_PATH_CASES))
def test_elastic_code_path_with_point_mass_is_bitwise_stock(case, masked, make_config, make_router, moe_tracker):
    """elastic_routing itself (not the static short-cut) with κ ≡ k reproduces stock bit for bit."""
    config = make_config(**ELASTIC_PATH_CASES[case])
    plan = LayerPlan(schedule=BudgetSchedule.static(config.moe_router_topk),
                     gate="full_softmax" if config.moe_router_pre_softmax else "renormalized",
                     sampling="iid", layer_index=0)
    stock_router, elastic_router = make_router(config), make_router(config)
    torch.manual_seed(5)
    logits0 = torch.randn(S, B, config.num_moe_experts) * 2
    grad_probs = torch.randn(S * B, config.num_moe_experts)
    mask = _padding_mask() if masked else None

    def run(route, router):
        results = []
        for step in range(2):  # two micro-batches: global aux accumulates
            logits = (logits0 + step).requires_grad_()
            probs, routing_map = route(router, logits)
            (probs * grad_probs).sum().backward()
            results.append({"probs": probs.detach(), "routing_map": routing_map, "logits_grad": logits.grad,
                            **{"tracker:" + n: moe_tracker.values(n) for n in TRACKED}})
        return results

    stock = run(lambda r, z: r.routing(z, padding_mask=mask), stock_router)
    moe_tracker.reset()
    elastic = run(lambda r, z: elastic_routing(r, plan, z, mask), elastic_router)
    for a, b in zip(stock, elastic):
        _assert_all_equal(a, b)
    if config.moe_aux_loss_coeff:
        assert any(stock[-1]["tracker:" + n] is not None for n in TRACKED)


@pytest.mark.parametrize("schedule", ["1-3", "static"])
@pytest.mark.parametrize("case", ["softmax_post", "softmax_pre", "sigmoid_expert_bias", "aux_loss"])
def test_eval_is_bitwise_stock_for_any_schedule(case, schedule, make_config, make_router, moe_tracker):
    config = make_config(**STOCK_CASES[case])
    torch.manual_seed(11)
    x = torch.randn(S, B, H)
    stock_router, patched_router = make_router(config, weight_std=1.0), make_router(config, weight_std=1.0)
    stock_router.eval()
    patched_router.eval()
    with torch.no_grad():
        stock_no_grad = stock_router(x)
    stock_grad = stock_router(x)
    with mcore.patched(ElasticConfig(schedule=schedule)):
        with torch.no_grad():
            patched_no_grad = patched_router(x)
        patched_grad = patched_router(x)
        patched_router.train()  # and back in training the same router is elastic
        _, train_map = patched_router(x)
    for stock, patched in ((stock_no_grad, patched_no_grad), (stock_grad, patched_grad)):
        assert torch.equal(stock[0], patched[0]) and torch.equal(stock[1], patched[1])
    if schedule != "static":
        assert set(train_map.sum(dim=1).tolist()) == {1, 2, 3}
    assert mcore.routing_records(patched_router).keys() == ({0} if schedule != "static" else set())


# ======================================================================== the plan follows the router
ROUTER_CHANGES = {
    # what Megatron's own router tests change on a built router (stock honours the first and the
    # pre-softmax flag at forward time, and reads moe_router_score_function only at construction)
    "router.score_function": lambda router: setattr(router, "score_function", "sigmoid"),
    "config.moe_router_score_function": lambda router: setattr(router.config, "moe_router_score_function", "sigmoid"),
    "both_score_functions": lambda router: (setattr(router, "score_function", "sigmoid"),
                                            setattr(router.config, "moe_router_score_function", "sigmoid")),
    "config.moe_router_pre_softmax": lambda router: setattr(router.config, "moe_router_pre_softmax", True),
}


@pytest.mark.parametrize("when", ["after_construction", "between_forwards"])
@pytest.mark.parametrize("change", list(ROUTER_CHANGES))
def test_the_plan_follows_a_router_changed_after_construction(change, when, make_config, make_router, moe_tracker):
    """A point mass drawn by the elastic path stays bitwise stock when the router's score function
    or pre-softmax flag changes on a built router: the plan is resolved from the router as it is
    at each forward, not from the config at construction (a plan resolved from the changed config
    while the router still scored with softmax raised KeyError ('softmax', 'sigmoid_auto'))."""
    torch.manual_seed(123)
    x = torch.randn(S, B, H)
    grad_probs = torch.randn(S * B, 8)
    change_before_step = 0 if when == "after_construction" else 1

    def run(router):
        results = []
        for step in range(2):
            if step == change_before_step:
                ROUTER_CHANGES[change](router)
            results.append(_run(router, x, None, grad_probs, moe_tracker))
        return results

    stock = run(make_router(make_config(moe_aux_loss_coeff=0.01), weight_std=1.0))
    moe_tracker.reset()
    with mcore.patched(point_mass_config(2)):
        router = make_router(make_config(moe_aux_loss_coeff=0.01), weight_std=1.0)
        elastic = run(router)
        assert mcore.routing_records(router)[0].expert_ids.shape[1] == 3  # the elastic path ran
    for a, b in zip(stock, elastic):
        _assert_all_equal(a, b)
    if when == "between_forwards":  # the change mattered to stock, except the one stock ignores
        changed = not torch.equal(stock[0]["probs"], stock[1]["probs"])
        assert changed == (change != "config.moe_router_score_function")


def test_a_plan_for_another_score_function_is_refused_with_the_fix(make_config, make_router):
    router = make_router(make_config())
    plan = LayerPlan(schedule=BudgetSchedule.static(2), gate="sigmoid_auto", sampling="iid", layer_index=0)
    with pytest.raises(UnsupportedMegatronError,
                       match=r"LayerPlan.gate='sigmoid_auto' cannot weigh a router whose score_function is 'softmax'"
                             r".*Accepted gates for 'softmax': full_softmax, renormalized"):
        elastic_routing(router, plan, torch.randn(S * B, 8))


def test_an_option_enabled_on_a_built_router_is_refused_at_its_next_forward(make_config, make_router):
    """Options refused at construction are refused when switched on later, not silently ignored."""
    mcore.apply(ElasticConfig(schedule="1-3"))
    router = make_router(make_config())
    router(torch.randn(S, B, H))
    router.config.moe_enable_routing_replay = True
    with pytest.raises(UnsupportedMegatronError, match="moe_enable_routing_replay=True"):
        router(torch.randn(S, B, H))


# ======================================================================== apply / remove / patched
def test_remove_restores_identity_and_stock_behaviour(make_config, make_router):
    cls = _topk_router_class()
    original_routing, original_init = cls.__dict__["routing"], cls.__dict__["__init__"]
    mcore.apply(ElasticConfig(schedule="1-3"))
    assert cls.__dict__["routing"] is not original_routing and cls.__dict__["__init__"] is not original_init
    assert cls.__dict__["routing"].__wrapped__ is original_routing
    router = make_router(make_config())  # built while patched
    torch.manual_seed(0)
    _, elastic_map = router(torch.randn(S, B, H))
    assert set(elastic_map.sum(dim=1).tolist()) > {2}
    mcore.remove()
    assert cls.__dict__["routing"] is original_routing and cls.__dict__["__init__"] is original_init
    assert not mcore.is_applied() and mcore.active_config() is None
    _, stock_map = router(torch.randn(S, B, H))
    assert stock_map.sum(dim=1).tolist() == [2] * (S * B)
    mcore.remove()  # a no-op
    assert cls.__dict__["routing"] is original_routing


def test_apply_is_idempotent_and_a_new_config_replaces_the_old(make_config, make_router):
    cls = _topk_router_class()
    original_routing = cls.__dict__["routing"]
    first = ElasticConfig(schedule="1-3")
    mcore.apply(first)
    patched_routing, patched_init = cls.__dict__["routing"], cls.__dict__["__init__"]
    mcore.apply(ElasticConfig(schedule="1-3"))  # equal config, new object
    assert cls.__dict__["routing"] is patched_routing and cls.__dict__["__init__"] is patched_init
    router = make_router(make_config())
    torch.manual_seed(0)
    router(torch.randn(S, B, H))
    assert mcore.routing_records(router)[0].expert_ids.shape[1] == 3

    mcore.apply(ElasticConfig(schedule="static"))  # replaces: the same router now routes static top-2
    assert mcore.active_config() == ElasticConfig(schedule="static")
    assert cls.__dict__["routing"].__wrapped__ is original_routing  # not a wrapper of the wrapper
    _, routing_map = router(torch.randn(S, B, H))
    assert routing_map.sum(dim=1).tolist() == [2] * (S * B)
    mcore.remove()
    assert cls.__dict__["routing"] is original_routing


def test_patched_restores_the_previous_state():
    cls = _topk_router_class()
    original_routing = cls.__dict__["routing"]
    outer, inner = ElasticConfig(schedule="1-3"), ElasticConfig(schedule="static", layers="0")
    with mcore.patched(outer):
        assert mcore.active_config() == outer
        with mcore.patched(inner):
            assert mcore.active_config() == inner
        assert mcore.active_config() == outer and mcore.is_applied()
        assert cls.__dict__["routing"].__wrapped__ is original_routing
    assert not mcore.is_applied() and cls.__dict__["routing"] is original_routing
    with pytest.raises(RuntimeError, match="boom"), mcore.patched(outer):
        raise RuntimeError("boom")
    assert not mcore.is_applied() and cls.__dict__["routing"] is original_routing


def test_a_second_copy_of_the_patch_module_does_not_wrap_the_first(monkeypatch):
    """ms-swift imports plugin files under a hashed module name: a second module object of
    ``patch`` must take the stock functions as its originals, not the first copy's wrappers."""
    import importlib.util

    cls = _topk_router_class()
    original_routing = cls.__dict__["routing"]
    spec = importlib.util.spec_from_file_location("elastic_moe_copy_of_patch", patch_module.__file__)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, copy)
    spec.loader.exec_module(copy)
    mcore.apply(ElasticConfig(schedule="1-3"))
    try:
        copy.apply(ElasticConfig(schedule="static"))
        assert cls.__dict__["routing"].__wrapped__ is original_routing
        copy.remove()
        assert cls.__dict__["routing"] is original_routing
    finally:
        copy.remove()


# ======================================================================== budgets and selection
def _rank_scores(config, router, logits):
    """The score stock Megatron ranks experts by (selection only), −inf outside the groups stock
    top-k keeps."""
    if config.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits.double())
        if router.expert_bias is not None:
            scores = scores + router.expert_bias.double()
    else:
        scores = torch.softmax(logits.double(), dim=-1)  # same order as the logits
    if config.moe_router_group_topk:
        # group score = sum of its top (k // group_topk) scores; keep the best group_topk groups
        groups = scores.view(scores.shape[0], config.moe_router_num_groups, -1)
        per_group = config.moe_router_topk // config.moe_router_group_topk
        group_scores = groups.sort(dim=-1, descending=True).values[..., :per_group].sum(-1)
        best = group_scores.sort(dim=-1, descending=True).indices[:, : config.moe_router_group_topk]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
        scores = torch.where(keep.unsqueeze(-1).expand_as(groups), groups, float("-inf")).view_as(scores)
    return scores


def _hand_top_kappa(rank_scores, budgets, width):
    """(map [T, E], ids [T, b] −1 padded) of the top-κ_t experts, by torch.sort."""
    num_tokens, num_experts = rank_scores.shape
    order = torch.sort(rank_scores, dim=1, descending=True, stable=True).indices
    keep = torch.arange(num_experts).unsqueeze(0) < budgets.unsqueeze(1)
    ref_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, order, keep)
    ref_ids = torch.where(keep[:, :width], order[:, :width], -1)
    return ref_map, ref_ids


def _hand_weights(config, gate, logits, ref_map, budgets):
    """The kept experts' gate weights, fp64, before the scaling factor."""
    z = logits.double()
    if config.moe_router_score_function == "sigmoid":
        values = torch.sigmoid(z) * ref_map
        renorm = values / values.sum(dim=1, keepdim=True)
        if gate == "auto":  # Megatron's rule with κ_t for k
            return torch.where((budgets > 1).unsqueeze(1), renorm, values)
        return renorm if gate == "renormalized" else values
    probs = torch.softmax(z, dim=-1) * ref_map
    if gate == "auto":
        gate = "full_softmax" if config.moe_router_pre_softmax else "renormalized"
    return probs / probs.sum(dim=1, keepdim=True) if gate == "renormalized" else probs


CHI_SQUARE_CASES = [
    # schedule, k, E, tokens
    ("1-3", 2, 8, 20_000),
    ("6-10", 8, 64, 20_000),
]


@pytest.mark.parametrize(("schedule", "topk", "num_experts", "num_tokens"), CHI_SQUARE_CASES)
def test_budgets_follow_the_pmf_and_selection_is_the_top_kappa(schedule, topk, num_experts, num_tokens,
                                                               make_config, make_router):
    stats = pytest.importorskip("scipy.stats")
    config = make_config(num_moe_experts=num_experts, moe_router_topk=topk)
    mcore.apply(ElasticConfig(schedule=schedule))
    router = make_router(config)
    torch.manual_seed(2024)
    logits = torch.randn(num_tokens, 1, num_experts) * 2
    with torch.no_grad():
        probs, routing_map = router.routing(logits)
    budget_schedule = BudgetSchedule.parse(schedule, topk)
    record = mcore.routing_records(router)[0]
    counts = routing_map.sum(dim=1)
    assert torch.equal(counts, record.budgets)
    observed = torch.bincount(counts - budget_schedule.low, minlength=len(budget_schedule.budgets))
    assert observed.numel() == len(budget_schedule.budgets)  # nothing outside the support
    expected = [q * num_tokens for q in budget_schedule.pmf]
    p_value = stats.chisquare(observed.double().numpy(), expected).pvalue
    assert p_value > 1e-3, (observed.tolist(), expected)
    # The mean budget is the model's top-k (compute-matched), within 4 standard errors.
    assert abs(counts.double().mean().item() - topk) < 4 * budget_schedule.std / math.sqrt(num_tokens)

    ref_map, ref_ids = _hand_top_kappa(logits.view(num_tokens, -1).double(), record.budgets, budget_schedule.high)
    assert torch.equal(routing_map, ref_map)
    assert torch.equal(record.expert_ids, ref_ids)
    ref_weights = _hand_weights(config, "auto", logits.view(num_tokens, -1), ref_map, record.budgets)
    torch.testing.assert_close(probs.double(), ref_weights, rtol=1e-5, atol=1e-7)


def test_balanced_sampling_dispatches_exactly_t_times_k(make_config, make_router):
    config = make_config(num_moe_experts=64, moe_router_topk=8)
    mcore.apply(ElasticConfig(schedule="6-10", sampling="balanced"))
    router = make_router(config)
    torch.manual_seed(3)
    num_tokens = 4096
    with torch.no_grad():
        _, routing_map = router.routing(torch.randn(num_tokens, 1, 64))
    counts = routing_map.sum(dim=1)
    assert int(counts.sum()) == num_tokens * 8
    expected = BudgetSchedule.parse("6-10", 8).balanced_counts(num_tokens)
    assert {k: int((counts == k).sum()) for k in expected} == expected


GATE_CASES = {
    # name: (model overrides, ElasticConfig.gate)
    "pre_softmax_auto": (dict(moe_router_pre_softmax=True), "auto"),
    "post_softmax_auto": (dict(), "auto"),
    "pre_softmax_renormalized": (dict(moe_router_pre_softmax=True), "renormalized"),
    "post_softmax_full_softmax": (dict(), "full_softmax"),
    "post_softmax_auto_scaled": (dict(moe_router_topk_scaling_factor=2.5), "auto"),
    "sigmoid_auto": (dict(moe_router_score_function="sigmoid"), "auto"),
    "sigmoid_bias_auto": (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), "auto"),
    "sigmoid_renormalized": (dict(moe_router_score_function="sigmoid"), "renormalized"),
    "sigmoid_full_softmax": (dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=1.5), "full_softmax"),
    "group_limited_post_softmax": (dict(moe_router_num_groups=4, moe_router_group_topk=2), "auto"),
    "group_limited_pre_softmax": (dict(moe_router_pre_softmax=True, moe_router_num_groups=4, moe_router_group_topk=2), "auto"),
}


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_selection_and_weights_match_the_hand_reference(case, make_config, make_router):
    overrides, gate = GATE_CASES[case]
    config = make_config(**overrides)
    mcore.apply(ElasticConfig(schedule="1-3", gate=gate))
    router = make_router(config)
    if router.expert_bias is not None:
        with torch.no_grad():  # large enough to reorder the selection against the raw scores
            router.expert_bias.copy_(torch.tensor([0.4, -0.4, 0.0, 0.3, -0.2, 0.1, -0.1, 0.2]))
    torch.manual_seed(17)
    logits = (torch.randn(64, 4, 8) * 1.5).requires_grad_()
    probs, routing_map = router.routing(logits)
    record = mcore.routing_records(router)[0]
    z = logits.detach().view(-1, 8)
    ref_map, ref_ids = _hand_top_kappa(_rank_scores(config, router, z), record.budgets, 3)
    assert set(record.budgets.tolist()) == {1, 2, 3}
    assert torch.equal(routing_map, ref_map)
    assert torch.equal(record.expert_ids, ref_ids)
    weights = _hand_weights(config, gate, z, ref_map, record.budgets)
    scale = config.moe_router_topk_scaling_factor or 1.0
    torch.testing.assert_close(probs.double(), weights * scale, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(record.retained_weight_sums.double(), weights.sum(dim=1), rtol=1e-5, atol=1e-7)
    assert probs.dtype == logits.dtype and probs.shape == (256, 8)
    if router.expert_bias is not None:  # the bias really changed the choice somewhere
        unbiased_map, _ = _hand_top_kappa(torch.sigmoid(z.double()), record.budgets, 3)
        assert not torch.equal(unbiased_map, routing_map)


def test_group_limited_routing_keeps_the_groups_of_stock_top_k(make_config, make_router):
    """6-10 around top-8 with group_topk = 3: groups are scored by their top 8 // 3 = 2 experts, as
    stock top-8 scores them (not by 10 // 3 = 3), then every token takes its top-κ inside them.
    Tokens with κ = 8 therefore route exactly as stock top-8."""
    config = make_config(num_moe_experts=32, moe_router_topk=8, moe_router_num_groups=8, moe_router_group_topk=3,
                         moe_router_score_function="sigmoid")
    x = torch.randn(64, 4, H, generator=torch.Generator().manual_seed(8))
    _, stock_map = make_router(config, weight_std=0.3)(x)  # sigmoid scores well clear of fp32 ties at 1
    mcore.apply(ElasticConfig(schedule="6-10"))
    router = make_router(config, weight_std=0.3)
    _, routing_map = router(x)
    record = mcore.routing_records(router)[0]
    z = (x.view(-1, H) @ router.weight.detach().t()).float()
    ref_map, ref_ids = _hand_top_kappa(_rank_scores(config, router, z), record.budgets, 10)
    assert torch.equal(routing_map, ref_map) and torch.equal(record.expert_ids, ref_ids)
    at_k = record.budgets == 8
    assert at_k.any() and torch.equal(routing_map[at_k], stock_map[at_k])
    # not vacuous: scoring the groups by their top 3 would pick other groups for some tokens
    groups = torch.sigmoid(z.double()).view(-1, 8, 4).sort(dim=-1, descending=True).values
    assert not torch.equal(groups[..., :2].sum(-1).topk(3).indices.sort().values,
                           groups[..., :3].sum(-1).topk(3).indices.sort().values)


# ======================================================================== realised aux losses
def _hand_aux(kind, logits, routing_map, padding_mask, coeff, seq_length, bsz, accumulated_counts=None):
    """Load-balancing loss on the realised assignments, fp64 (see module docstring of mcore).

    aux:        E·coeff·Σ_i P_i·c_i / Σκ,  P_i = mean over valid tokens of the full softmax
    seq_aux:    E·coeff/B·Σ_s Σ_i P_si·c_si / Σ_{t∈s}κ_t,  P_si = Σ_{t∈s} p_ti / n̄ with n̄ the
                sequence length (no mask) or the mean valid tokens per sequence (stock's convention)
    global_aux: E·coeff·Σ_i P_i·C_i / Σ_i C_i with C the counts accumulated over micro-batches
    """
    num_experts = logits.shape[-1]
    probs = torch.softmax(logits.reshape(-1, num_experts).double(), dim=-1)
    valid = torch.ones(probs.shape[0], dtype=torch.float64) if padding_mask is None else (~padding_mask.reshape(-1)).double()
    counts_map = routing_map.double() * valid.unsqueeze(1)
    num_valid = valid.sum()
    if kind in ("aux_loss", "global_aux_loss"):
        mean_p = (probs * valid.unsqueeze(1)).sum(dim=0) / num_valid
        counts = counts_map.sum(dim=0) if accumulated_counts is None else accumulated_counts.double()
        return num_experts * coeff * (mean_p * counts).sum() / counts.sum()
    per_seq_tokens = num_valid / bsz if padding_mask is not None else torch.tensor(float(seq_length), dtype=torch.float64)
    p = (probs * valid.unsqueeze(1)).view(seq_length, bsz, num_experts).sum(dim=0) / per_seq_tokens  # [B, E]
    c = counts_map.view(seq_length, bsz, num_experts).sum(dim=0)  # [B, E]
    return num_experts * coeff / bsz * ((p * c).sum(dim=1) / c.sum(dim=1)).sum()


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
@pytest.mark.parametrize("kind", AUX_TYPES)
def test_aux_losses_use_the_realised_assignments(kind, masked, make_config, make_router, moe_tracker):
    coeff = 0.01
    config = make_config(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff)
    mcore.apply(ElasticConfig(schedule="1-3"))
    router = make_router(config)
    seq_length, bsz = 8, 3
    mask = _padding_mask(seq_length, bsz) if masked else None
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
            "global_aux_loss": "global_load_balancing_loss"}[kind]
    torch.manual_seed(29)
    accumulated = torch.zeros(8, dtype=torch.float64)
    logged = 0.0
    for micro_batch in range(2):
        logits = (torch.randn(seq_length, bsz, 8) * 2).requires_grad_()
        probs, routing_map = router.routing(logits, padding_mask=mask)
        budgets = mcore.routing_records(router)[0].budgets
        assert torch.equal(routing_map.sum(dim=1), budgets) and len(set(budgets.tolist())) > 1
        valid = torch.ones(seq_length * bsz, dtype=torch.bool) if mask is None else ~mask.reshape(-1)
        accumulated += (routing_map & valid.unsqueeze(1)).sum(dim=0).double()
        hand_logits = logits.detach().double().requires_grad_()
        hand = _hand_aux(kind, hand_logits, routing_map, mask, coeff, seq_length, bsz,
                         accumulated_counts=accumulated if kind == "global_aux_loss" else None)
        logged += hand.item() / coeff
        # the value Megatron's tracker logged (loss / coeff, accumulated per layer) ...
        torch.testing.assert_close(moe_tracker.values(name)[0].double(), torch.tensor(logged, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-9)
        # ... and the gradient the aux loss sends into the logits (the task loss contributes 0 here)
        (probs * 0).sum().backward()
        (hand_grad,) = torch.autograd.grad(hand, hand_logits)
        torch.testing.assert_close(logits.grad.double(), hand_grad, rtol=1e-4, atol=1e-9)
        assert logits.grad.abs().sum() > 0
        if mask is not None:  # padding tokens get no aux gradient at all
            assert torch.count_nonzero(logits.grad[mask]) == 0


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
@pytest.mark.parametrize("kind", AUX_TYPES)
def test_top_p_mode_aux_losses_use_the_realised_assignments(kind, masked, make_config, make_router, moe_tracker):
    """mode='top_p' has no fixed budget (κ comes from the probabilities): its aux losses normalise
    by the realised Σκ, not by T·k, although its plan's schedule is the point mass at k."""
    coeff = 0.01
    config = make_config(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff)
    mcore.apply(ElasticConfig(mode="top_p", top_p=0.4))
    router = make_router(config)
    mask = _padding_mask() if masked else None
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
            "global_aux_loss": "global_load_balancing_loss"}[kind]
    logits = (torch.randn(S, B, 8, generator=torch.Generator().manual_seed(3)) * 2).requires_grad_()
    _, routing_map = router.routing(logits, padding_mask=mask)
    assert int(routing_map.sum()) != S * B * config.moe_router_topk
    hand = _hand_aux(kind, logits.detach(), routing_map, mask, coeff, S, B)
    torch.testing.assert_close(moe_tracker.values(name)[0].double(), hand / coeff, rtol=1e-5, atol=1e-9)


def test_seq_aux_loss_with_a_fully_padded_sequence_is_finite(make_config, make_router, moe_tracker):
    config = make_config(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01)
    mcore.apply(ElasticConfig(schedule="1-3"))
    router = make_router(config)
    mask = torch.zeros(8, 3, dtype=torch.bool)
    mask[:, 1] = True  # sequence 1 is all padding
    torch.manual_seed(1)
    logits = torch.randn(8, 3, 8, requires_grad=True)
    probs, routing_map = router.routing(logits, padding_mask=mask)
    (probs * 0).sum().backward()
    value = moe_tracker.values("seq_load_balancing_loss")[0]
    assert torch.isfinite(value) and torch.isfinite(logits.grad).all()
    hand = _hand_aux_without_empty_sequences(logits.detach(), routing_map, mask, 0.01)
    torch.testing.assert_close(value.double(), hand / 0.01, rtol=1e-5, atol=1e-9)


def _hand_aux_without_empty_sequences(logits, routing_map, mask, coeff):
    seq_length, bsz, num_experts = logits.shape
    probs = torch.softmax(logits.reshape(-1, num_experts).double(), dim=-1)
    valid = (~mask.reshape(-1)).double()
    per_seq_tokens = valid.sum() / bsz
    p = (probs * valid.unsqueeze(1)).view(seq_length, bsz, num_experts).sum(dim=0) / per_seq_tokens
    c = (routing_map.double() * valid.unsqueeze(1)).view(seq_length, bsz, num_experts).sum(dim=0)
    kept = c.sum(dim=1) > 0
    return num_experts * coeff / bsz * ((p * c).sum(dim=1)[kept] / c.sum(dim=1)[kept]).sum()


def test_aux_loss_is_coeff_whatever_the_budgets_when_counts_are_uniform(make_config, make_router, moe_tracker,
                                                                       monkeypatch):
    """With realised counts c_i = Σκ/E the loss is coeff·Σ_i P_i = coeff for any κ (and for stock)."""
    coeff = 0.01
    config = make_config(moe_aux_loss_coeff=coeff)
    num_experts, blocks = 8, 3
    tokens = torch.arange(num_experts * blocks)
    # token t ranks experts t, t+1, ... (mod E): each block of E tokens with one κ hits every expert κ times
    logits = -((torch.arange(num_experts).unsqueeze(0) - tokens.unsqueeze(1)) % num_experts).float()
    logits = logits.view(-1, 1, num_experts) * 0.7
    values = {}
    router = make_router(config)
    router.routing(logits.clone().requires_grad_())
    values["stock static k=2"] = moe_tracker.values("load_balancing_loss")[0]
    mcore.apply(ElasticConfig(schedule="1-3"))
    for pattern in ([1, 3, 2], [3, 3, 1], [1, 1, 1]):
        moe_tracker.reset()
        kappa = torch.tensor(pattern).repeat_interleave(num_experts)
        force_budgets(monkeypatch, lambda n, kappa=kappa: kappa)
        _, routing_map = router.routing(logits.clone().requires_grad_())
        assert torch.equal(routing_map.sum(dim=1), kappa)
        assert len(set(routing_map.sum(dim=0).tolist())) == 1  # uniform realised counts
        values[f"elastic {pattern}"] = moe_tracker.values("load_balancing_loss")[0]
    for label, value in values.items():
        assert value.item() == pytest.approx(1.0, rel=1e-6), label  # logged as loss / coeff


# ======================================================================== gate conventions (docs/gates.md): gradients
def _separated_logits(num_tokens, num_experts, seed, dtype=torch.float64):
    """Logits whose sorted gaps are all >= 0.3 (no ties, no rank crossing within ±0.1)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_tokens):
        levels = torch.arange(num_experts, dtype=dtype) * 0.45 - 1.5
        rows.append(levels[torch.randperm(num_experts, generator=generator)])
    return torch.stack(rows)


@pytest.mark.parametrize("route", ["static_patch", "elastic_path"])
def test_top1_full_softmax_gate_gradient_matches_closed_form(route, make_config, make_router):
    """y = Σ_e w_te·F_e with w the selected full-softmax probability (Switch, docs/gates.md#gate-conventions):
    dy/dz_a = p_a(1−p_a)F_a and dy/dz_j = −p_a·p_j·F_a."""
    config = make_config(moe_router_topk=1, moe_router_pre_softmax=True, moe_router_dtype="fp64")
    router = make_router(config)
    logits = _separated_logits(12, 8, seed=0).view(12, 1, 8).requires_grad_()
    F = torch.linspace(-2.0, 3.0, 8, dtype=torch.float64)
    if route == "static_patch":
        mcore.apply(ElasticConfig(schedule="static"))
        probs, routing_map = router.routing(logits)
    else:
        plan = LayerPlan(schedule=BudgetSchedule.static(1), gate="full_softmax", sampling="iid", layer_index=0)
        probs, routing_map = elastic_routing(router, plan, logits)
    (probs * F).sum().backward()

    z = logits.detach().view(12, 8)
    p = torch.softmax(z, dim=-1)
    a = z.argmax(dim=-1)
    assert torch.equal(routing_map.float().argmax(dim=-1), a) and routing_map.sum().item() == 12
    p_a, F_a = p.gather(1, a.unsqueeze(1)), F[a].unsqueeze(1)
    expected = -p_a * p * F_a
    expected.scatter_(1, a.unsqueeze(1), p_a * (1 - p_a) * F_a)
    # Megatron computes the softmax in fp32 even for an fp64 router, hence the fp32 tolerance.
    torch.testing.assert_close(logits.grad.view(12, 8), expected, rtol=1e-6, atol=1e-7)


def test_top1_gradient_through_the_real_router_weight(make_config, make_router):
    """Through router.forward: dL/dW = Σ_t (dy/dz_t) x_tᵀ with the closed-form dy/dz."""
    config = make_config(moe_router_topk=1, moe_router_pre_softmax=True, moe_router_dtype="fp64")
    router = make_router(config, weight_std=1.0)
    mcore.apply(ElasticConfig(schedule="static"))
    torch.manual_seed(4)
    x = torch.randn(10, 1, H, dtype=torch.float64)
    F = torch.linspace(1.0, 2.0, 8, dtype=torch.float64)
    probs, _ = router(x)
    (probs * F).sum().backward()
    z = x.view(10, H) @ router.weight.detach().double().t()
    p = torch.softmax(z, dim=-1)
    a = z.argmax(dim=-1, keepdim=True)
    dz = -p.gather(1, a) * p * F[a]
    dz.scatter_(1, a, (p.gather(1, a) * (1 - p.gather(1, a)) * F[a]))
    # Megatron's softmax runs in fp32 for an fp64 router: each term of Σ_t dz_t x_t carries fp32 rounding
    # (~1e-7 of p·F·|x| ≈ 1), and a sum of such terms that nearly cancels keeps that absolute error.
    torch.testing.assert_close(router.weight.grad.double(), dz.t() @ x.view(10, H), rtol=1e-5, atol=1e-6)


def test_renormalized_top1_has_exactly_zero_gate_gradient(make_config, make_router):
    """Megatron refuses post-softmax top-1; the elastic path with gate='renormalized' and κ ≡ 1
    gives weight exactly 1 and a gate gradient exactly 0 (docs/gates.md#gate-conventions), also on a pre-softmax model."""
    for pre_softmax in (True, False):
        config = make_config(moe_router_topk=2, moe_router_pre_softmax=pre_softmax, moe_router_dtype="fp64")
        router = make_router(config)
        plan = LayerPlan(schedule=BudgetSchedule.static(1), gate="renormalized", sampling="iid", layer_index=0)
        logits = _separated_logits(12, 8, seed=1).view(12, 1, 8).requires_grad_()
        probs, routing_map = elastic_routing(router, plan, logits)
        (probs * torch.linspace(-2.0, 3.0, 8, dtype=torch.float64)).sum().backward()
        assert torch.equal(probs[routing_map], torch.ones(12, dtype=torch.float64))
        assert torch.count_nonzero(logits.grad) == 0


def test_elastic_renormalized_tokens_with_budget_one_get_no_gate_gradient(make_config, make_router):
    config = make_config()  # post-softmax, renormalized
    mcore.apply(ElasticConfig(schedule="1-3"))
    router = make_router(config)
    logits = _separated_logits(60, 8, seed=2, dtype=torch.float32).view(60, 1, 8).requires_grad_()
    probs, _ = router.routing(logits)
    (probs * torch.linspace(-2.0, 3.0, 8)).sum().backward()
    budgets = mcore.routing_records(router)[0].budgets
    grads = logits.grad.view(60, 8)
    assert torch.count_nonzero(grads[budgets == 1]) == 0
    assert (grads[budgets > 1].abs().sum(dim=1) > 1e-4).all()


@pytest.mark.parametrize("route", ["stock", "elastic_kappa3"])
def test_selection_changes_across_the_rank_boundary(route, make_config, make_router, monkeypatch):
    """Boundary test (docs/gates.md#gate-conventions): moving one logit across the κ/κ+1 margin swaps exactly one expert
    in and one out, asserted directly instead of with a finite difference across the jump."""
    config = make_config(moe_router_topk=2)
    router = make_router(config)
    kappa = 2 if route == "stock" else 3
    if route != "stock":
        mcore.apply(ElasticConfig(schedule="1-3"))
        force_budgets(monkeypatch, lambda n: torch.full((n,), 3))
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])  # expert e has rank e
    last_kept, first_dropped = kappa - 1, kappa
    below, above = base.clone(), base.clone()
    below[first_dropped] = base[last_kept] - 0.01
    above[first_dropped] = base[last_kept] + 0.01
    (_, map_below), (_, map_above) = (router.routing(row.view(1, 1, 8).requires_grad_()) for row in (below, above))
    map_below, map_above = map_below[0], map_above[0]
    assert map_below.nonzero().flatten().tolist() == list(range(kappa))
    entered = (map_above & ~map_below).nonzero().flatten().tolist()
    left = (map_below & ~map_above).nonzero().flatten().tolist()
    assert entered == [first_dropped] and left == [last_kept]
    assert int(map_above.sum()) == kappa


# ======================================================================== sync-free
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
@pytest.mark.parametrize("sampling", ["iid", "balanced"])
@pytest.mark.parametrize("kind", AUX_TYPES)
def test_elastic_router_forward_and_backward_are_sync_free(kind, sampling, masked, make_config, make_router):
    config = make_config(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                         moe_expert_capacity_factor=1.5)
    torch.manual_seed(0)
    x = torch.randn(S, B, H)
    mask = _padding_mask() if masked else None
    counts = {}
    for label in ("stock", "elastic"):
        if label == "elastic":
            mcore.apply(ElasticConfig(schedule="1-3", sampling=sampling))
        router = make_router(config)
        with host_syncs(megatron=True) as counter:
            probs, routing_map = router(x, padding_mask=mask)
            forward = counter.count
            (probs * torch.ones_like(probs)).sum().backward()
        counts[label] = (forward, counter.count)
        if label == "elastic":
            assert len(set(routing_map.sum(dim=1).tolist())) > 1  # really elastic
    assert counts["elastic"] == (0, 0), counts
    assert counts["elastic"][0] - counts["stock"][0] <= 0


# ======================================================================== start-up errors
def test_schedule_beyond_the_expert_count_fails_at_router_construction(make_config, make_router):
    mcore.apply(ElasticConfig(schedule="6-10"))
    with pytest.raises(ConfigError, match=r"reaches budget 10.*only 8 experts"):
        make_router(make_config(num_moe_experts=8, moe_router_topk=8))
    make_router(make_config(num_moe_experts=16, moe_router_topk=8))  # fits


def test_schedule_centred_elsewhere_fails_at_router_construction(make_config, make_router):
    mcore.apply(ElasticConfig(schedule="6-10", center=8))
    with pytest.raises(ConfigError, match=r"center=8, but the model routes to top-2.* Set center=None and "
                                          r"schedule='1-3' \(the model's top-k\)"):
        make_router(make_config(num_moe_experts=16, moe_router_topk=2))


def test_layers_beyond_the_model_fail_at_router_construction(make_config, make_router):
    mcore.apply(ElasticConfig(schedule="1-3", layers="1-3"))
    with pytest.raises(ConfigError, match=r"layer\(s\) \[2, 3\].*2 decoder layers"):
        make_router(make_config(num_layers=2))
    make_router(make_config(num_layers=4))


@pytest.mark.parametrize(("overrides", "needle"), [
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0), "sinkhorn"),
    (dict(moe_enable_routing_replay=True), "routing replay"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1), "group-limited"),
], ids=["sinkhorn", "routing_replay", "groups_too_few"])
def test_unsupported_options_are_refused_at_construction(overrides, needle, make_config, make_router):
    config = make_config(**overrides)
    with mcore.patched(ElasticConfig(schedule="1-3")):
        with pytest.raises(UnsupportedMegatronError, match=needle):
            make_router(config)
    with mcore.patched(ElasticConfig(schedule="static")):
        make_router(config)  # the point mass is stock, so stock options stay allowed


@pytest.mark.parametrize("version", ["0.15.2", "0.20.0", "1.0.0rc1"])
def test_version_guard(version, monkeypatch, make_config, make_router):
    monkeypatch.setattr(patch_module, "megatron_core_version", lambda: Version(version))
    monkeypatch.delenv(mcore.ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(UnsupportedMegatronError, match=rf"{mcore.SUPPORTED_MCORE_RANGE}.*found {version}"):
        mcore.apply(ElasticConfig(schedule="1-3"))
    assert not mcore.is_applied()
    with pytest.raises(UnsupportedMegatronError):
        make_router(make_config(), cls=mcore.ElasticTopKRouter.with_config(ElasticConfig(schedule="1-3")))
    monkeypatch.setenv(mcore.ALLOW_UNSUPPORTED_ENV, "1")
    mcore.apply(ElasticConfig(schedule="1-3"))
    assert mcore.is_applied()


def test_installed_version_is_supported():
    found = mcore.check_megatron_version()
    assert Version("0.16") <= Version(found.base_version) < Version("0.20")


def test_layers_need_a_layer_number(make_config, make_router):
    mcore.apply(ElasticConfig(schedule="1-3", layers="0"))
    router = make_router(make_config(), layer_number=None)
    with pytest.raises(ConfigError, match="layer number"):
        router(torch.randn(S, B, H))


# ======================================================================== explicit router class
def test_elastic_topk_router_class_equals_the_monkey_patch(make_config, make_router):
    config = make_config(moe_aux_loss_coeff=0.01)
    elastic_config = ElasticConfig(schedule="1-3")
    torch.manual_seed(8)
    x = torch.randn(S, B, H)
    grad_probs = torch.randn(S * B, 8)

    def run(router):
        xx = x.clone().requires_grad_()
        torch.manual_seed(99)
        budget_rng.reset()  # both routers draw κ from a stream seeded with 99
        probs, routing_map = router(xx)
        (probs * grad_probs).sum().backward()
        return probs.detach(), routing_map, xx.grad, router.weight.grad

    explicit = make_router(config, cls=mcore.ElasticTopKRouter.with_config(elastic_config))
    assert isinstance(explicit, _topk_router_class()) and not mcore.is_applied()
    explicit_out = run(explicit)
    with mcore.patched(elastic_config):
        patched_out = run(make_router(config))
    for a, b in zip(explicit_out, patched_out):
        assert torch.equal(a, b)
    assert len(set(explicit_out[1].sum(dim=1).tolist())) > 1
    explicit.eval()
    stock = make_router(config)
    stock.eval()
    assert all(torch.equal(a, b) for a, b in zip(explicit(x), stock(x)))


# ======================================================================== MTP layers
def test_mtp_routers_stay_stock(make_config, make_router):
    """MTP layers never route elastically: 0.19 flags their routers is_mtp_layer=True; 0.16 has no
    flag and numbers the MTP transformer layer after the decoder (layer_number = num_layers + i + 1)."""
    import inspect

    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    config = make_config(num_layers=2, mtp_num_layers=1)
    mcore.apply(ElasticConfig(schedule="1-3"))
    routers = [make_router(config, layer_number=config.num_layers + 1)]  # 0.16's numbering
    if "is_mtp_layer" in inspect.signature(_topk_router_class().__init__).parameters:
        torch.manual_seed(0)
        mtp_router = _topk_router_class()(config=config, pg_collection=get_default_pg_collection(), is_mtp_layer=True)
        mtp_router.set_layer_number(1)  # 0.19 numbers MTP layers from 1 as well
        routers.append(mtp_router)
    decoder_router = make_router(config, layer_number=2)
    torch.manual_seed(3)
    x = torch.randn(S, B, H)
    for router in routers:
        _, routing_map = router(x)
        assert routing_map.sum(dim=1).tolist() == [2] * (S * B)
        assert mcore.routing_records(router) == {}
    _, routing_map = decoder_router(x)
    assert len(set(routing_map.sum(dim=1).tolist())) > 1


# ======================================================================== records
def test_routing_record_contents(make_config, make_router):
    config = make_config(moe_router_pre_softmax=True, num_layers=4)
    mcore.apply(ElasticConfig(schedule="1-3"))
    router = make_router(config, layer_number=3)
    torch.manual_seed(6)
    probs, routing_map = router(torch.randn(S, B, H))
    records = mcore.routing_records(router)
    assert list(records) == [2]  # 0-based: Megatron's layer_number 3 is decoder layer 2
    record = records[2]
    assert isinstance(record, RoutingRecord)
    assert record.budgets.dtype == torch.long and record.budgets.shape == (S * B,)
    assert record.expert_ids.dtype == torch.long and record.expert_ids.shape == (S * B, 3)
    assert torch.equal((record.expert_ids >= 0).sum(dim=1), record.budgets)
    for t in range(S * B):  # −1 exactly beyond κ_t, and the kept ids are the routed experts
        kappa = int(record.budgets[t])
        assert (record.expert_ids[t, kappa:] == -1).all()
        assert sorted(record.expert_ids[t, :kappa].tolist()) == routing_map[t].nonzero().flatten().tolist()
    # full softmax: retained sums are the kept probabilities, < 1
    torch.testing.assert_close(record.retained_weight_sums, probs.sum(dim=1))
    assert (record.retained_weight_sums < 1).all()
    assert not record.budgets.requires_grad and not record.retained_weight_sums.requires_grad


def test_budget_histograms_stay_bounded(make_config, make_router):
    mcore.apply(ElasticConfig(schedule="1-3"))
    router = make_router(make_config())
    steps = 40
    for step in range(steps):
        router(torch.randn(S, B, H))
    with torch.no_grad():  # recompute's first pass / eval-like calls are not counted
        router(torch.randn(S, B, H))
    histograms = mcore.budget_histograms(router)
    assert list(histograms) == [0]
    histogram = histograms[0]
    assert histogram.shape == (4,) and histogram.dtype == torch.long  # b + 1 slots, whatever the steps
    assert int(histogram.sum()) == steps * S * B and int(histogram[0]) == 0
    mcore.reset_budget_histograms(router)
    assert int(mcore.budget_histograms(router)[0].sum()) == 0


# ------------------------------------------------------------------------------------ top-p control
@pytest.mark.parametrize("pre_softmax,cap", [(True, None), (False, 5)])
def test_top_p_mode_routes_the_smallest_set_reaching_p(make_config, make_router, pre_softmax, cap):
    """mode='top_p' (the paper's nucleus control): κ_t = min{j : Σ_{i≤j} p_(i) ≥ p}, capped,
    with the model's own gate on that set; eval stays static top-k."""
    config = make_config(moe_router_pre_softmax=pre_softmax)
    mcore.apply(ElasticConfig(mode="top_p", top_p=0.4, top_p_max_experts=cap))
    router = make_router(config, weight_std=0.5)
    router.train()
    x = torch.randn(64, 2, 16, generator=torch.Generator().manual_seed(5))
    probs, routing_map = router(x)
    logits = (x.view(-1, 16) @ router.weight.detach().t()).float()
    full = torch.softmax(logits, dim=-1)
    order_probs, order = torch.sort(full, dim=-1, descending=True)
    width = cap or 8
    expected = []
    for row in order_probs.tolist():  # a readable loop reference
        total, count = 0.0, 0
        while count < width and total < 0.4:
            total += row[count]
            count += 1
        expected.append(count)
    assert routing_map.sum(dim=1).tolist() == expected
    assert len(set(expected)) > 1
    kept = torch.arange(8) < torch.tensor(expected)[:, None]
    hand = torch.zeros_like(full).scatter(1, order, torch.where(kept, order_probs, 0.0))
    if not pre_softmax:  # the model's own gate: renormalised over the kept set
        hand = hand / hand.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(probs.detach(), hand, rtol=1e-5, atol=1e-6)
    router.eval()
    assert (router(x)[1].sum(dim=1) == 2).all()


def test_top_p_mode_refusals(make_config, make_router):
    mcore.apply(ElasticConfig(mode="top_p", top_p_max_experts=9))
    with pytest.raises(ConfigError, match=r"top_p_max_experts=9 exceeds the model's 8 experts"):
        make_router(make_config())
    mcore.apply(ElasticConfig(mode="top_p"))
    with pytest.raises(UnsupportedMegatronError, match=r"mode='top_p' reads the budget off full-softmax probabilities"):
        make_router(make_config(moe_router_score_function="sigmoid"))


def _full_softmaxes(num_experts: int) -> OpCounter:
    """Counts softmax kernels over the full expert axis ([T, E] input, E = ``num_experts``)."""
    return OpCounter(torch.ops.aten._softmax.default, where=lambda func, args, kwargs: args[0].shape[-1] == num_experts)


def _top_p_separate_softmaxes(router, plan, logits, padding_mask):
    """mode='top_p' routing as it was composed before it shared its softmax: selection, the top-p
    budgets (their own softmax of ``logits.float()``, no grad) and the aux losses (their own
    softmax) each compute p = softmax(z) themselves."""
    from elastic_moe_plugin.core.routing import RoutingRule, budget_mask, top_p_budgets, weigh
    from elastic_moe_plugin.mcore.aux_loss import apply_realised_aux_losses, realised_assignments

    seq_length, bsz, num_experts = logits.shape
    z = logits.view(-1, num_experts)
    mask = None if padding_mask is None else padding_mask.reshape(-1)
    values, ids = routing_module.select_candidates(z, plan.width, plan.schedule.center, plan.gate,
                                                   use_pre_softmax=router.config.moe_router_pre_softmax)
    with torch.no_grad():
        sorted_probs = torch.softmax(z.float(), dim=-1).gather(1, ids)
    kept = budget_mask(top_p_budgets(sorted_probs, plan.top_p), plan.width)
    rule = RoutingRule(normalization={"full_softmax": "none", "renormalized": "kept_softmax"}[plan.gate])
    weights = weigh(rule, values.float(), kept).type_as(z)
    probs = torch.zeros_like(z).scatter(1, ids, weights)
    routing_map = torch.zeros_like(z, dtype=torch.bool).scatter(1, ids, kept)
    if router.is_aux_loss_enabled():
        assignments = realised_assignments(router, plan, z, routing_map, mask, seq_length, bsz)
        probs = apply_realised_aux_losses(router, assignments, probs)
    return probs, routing_map


TOP_P_SHARING = [(pre, gate, aux) for pre in (False, True) for gate in ("auto", "full_softmax")
                 for aux in ("none", "aux_loss", "seq_aux_loss")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("pre_softmax", "gate", "aux"), TOP_P_SHARING,
                         ids=[f"{'pre' if p else 'post'}-{g}-{a}" for p, g, a in TOP_P_SHARING])
def test_top_p_mode_computes_the_softmax_once_bitwise_as_separate_softmaxes(pre_softmax, gate, aux, dtype,
                                                                          make_config, make_router, moe_tracker):
    """One softmax over [T, E] per top-p forward, shared by the budgets and whichever of selection
    or aux loss also reads it (two only where both backpropagate through it, as stock's routing and
    aux scores are two); probabilities, map, logged losses and the logits' gradient are bit for bit
    those of the composition with a softmax per reader."""
    num_experts = 8
    config = make_config(moe_router_pre_softmax=pre_softmax, moe_router_load_balancing_type=
                         "aux_loss" if aux == "none" else aux, moe_aux_loss_coeff=0.0 if aux == "none" else 0.01)
    elastic = ElasticConfig(mode="top_p", top_p=0.4, top_p_max_experts=5, gate=gate)
    mcore.apply(elastic)
    router = make_router(config)
    plan = patch_module.resolve_plan(router, elastic)
    source = torch.randn(S, B, num_experts, generator=torch.Generator().manual_seed(3)).mul(2).to(dtype)
    grad_probs = torch.randn(S * B, num_experts, generator=torch.Generator().manual_seed(4)).to(dtype)
    mask = _padding_mask()

    results = []
    for route in (lambda z: router.routing(z, padding_mask=mask),
                  lambda z: _top_p_separate_softmaxes(router, plan, z, mask)):
        moe_tracker.reset()
        logits = source.clone().requires_grad_()
        with _full_softmaxes(num_experts) as softmaxes:
            probs, routing_map = route(logits)
        (probs * grad_probs).sum().backward()
        logged = {name: moe_tracker.values(name) for name in sorted(moe_tracker.names())}
        results.append((probs.detach(), routing_map, logits.grad, logged, softmaxes.count))
    (probs, routing_map, grad, logged, count), (ref_probs, ref_map, ref_grad, ref_logged, ref_count) = results

    selection_reads = pre_softmax or plan.gate == "full_softmax"
    assert count == (2 if selection_reads and aux != "none" else 1)
    assert ref_count == count + (1 if selection_reads or aux != "none" else 0)  # what sharing saves
    assert len(set(routing_map.sum(dim=1).tolist())) > 1  # κ varies
    assert torch.equal(routing_map, ref_map) and torch.equal(probs, ref_probs)
    assert torch.equal(grad, ref_grad) and grad.abs().sum() > 0
    assert logged.keys() == ref_logged.keys() and all(torch.equal(logged[n], ref_logged[n]) for n in logged)
    if aux != "none":
        assert logged  # the aux loss ran and was logged
