"""Elastic routing through a real Megatron ``MoELayer`` (dispatcher + SequentialMLP experts) on CPU.

The reference is a dense computation written here: y_t = Σ_e w_te · expert_e(x_t), with every
expert evaluated on every token from the experts' own weights, and w from the router weight and
the realised selection. Tolerances are fp32 (see ``ATOL``/``RTOL``).
"""

from __future__ import annotations

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.mcore import budget_rng
from elastic_moe_plugin.mcore import LayerPlan, elastic_routing
from elastic_moe_plugin.core.schedule import BudgetSchedule

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

S, B, H, E, FFN = 8, 3, 16, 8, 24
# fp32 throughout. The layer permutes tokens per expert, runs each expert on its slice and
# scatter-adds the weighted outputs back, so its sums run in a different order than the dense
# reference's; fp32 rounding then differs by a few ulp of the largest term (|y| ~ 1, ulp ~ 1e-7).
# The bounds below leave ~10x headroom over the largest difference observed (~1e-7 .. 1e-6).
RTOL, ATOL = 1e-5, 1e-6


def _layer_config(make_config, **overrides):
    values = dict(num_moe_experts=E, hidden_size=H, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN)
    values.update(overrides)
    return make_config(**values)


def _alltoall_dispatcher_patched() -> bool:
    """Whether the elastic token-dispatcher fixes are installed on the alltoall dispatcher."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return bool(getattr(MoEAlltoAllTokenDispatcher.__dict__.get("preprocess"), "__elastic_moe_patched__", False))


class _Captured:
    """Forward hook on the router: the (probs, routing_map) the dispatcher received."""

    def __init__(self, router):
        self.probs = self.routing_map = None
        router.register_forward_hook(self)

    def __call__(self, module, inputs, outputs):
        self.probs, self.routing_map = outputs[0].detach(), outputs[1].detach()


def _expert_params(layer):
    experts = layer.experts.local_experts
    return [(expert.linear_fc1.weight, expert.linear_fc2.weight) for expert in experts]


def _dense_reference(config, x, router_weight, expert_params, weights_fn):
    """y [S, B, H] = Σ_e w_te · fc2_e(act(fc1_e(x_t))) with w = weights_fn(logits)."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens.float() @ router_weight.t()
    weights = weights_fn(logits)  # [T, E], zero where not routed
    outputs = torch.stack([torch.nn.functional.linear(config.activation_func(torch.nn.functional.linear(tokens, fc1)), fc2)
                           for fc1, fc2 in expert_params], dim=1)  # [T, E, H]
    return (weights.unsqueeze(-1) * outputs).sum(dim=1).view_as(x)


def _hand_gate(config, gate, routing_map):
    """The gate weights the elastic router must produce on `routing_map` (the realised selection)."""

    def weights_fn(logits):
        if gate == "renormalized":  # softmax over the kept logits = p_e / Σ_kept p
            return torch.softmax(logits.masked_fill(~routing_map, float("-inf")), dim=-1)
        return torch.softmax(logits, dim=-1) * routing_map  # full_softmax

    return weights_fn


def _leaf_copies(layer, x):
    x_ref = x.detach().clone().requires_grad_()
    router_ref = layer.router.weight.detach().clone().requires_grad_()
    experts_ref = [(fc1.detach().clone().requires_grad_(), fc2.detach().clone().requires_grad_())
                   for fc1, fc2 in _expert_params(layer)]
    return x_ref, router_ref, experts_ref


def _assert_layer_matches_reference(layer, x, out, grad_out, x_ref, router_ref, experts_ref, reference):
    torch.testing.assert_close(out, reference, rtol=RTOL, atol=ATOL)
    (reference * grad_out).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(layer.router.weight.grad, router_ref.grad, rtol=RTOL, atol=ATOL)
    for (fc1, fc2), (fc1_ref, fc2_ref) in zip(_expert_params(layer), experts_ref):
        torch.testing.assert_close(fc1.grad, fc1_ref.grad, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(fc2.grad, fc2_ref.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("pre_softmax", [False, True], ids=["post_softmax_renormalized", "pre_softmax_full_softmax"])
def test_moe_layer_matches_dense_reference(pre_softmax, make_config, make_moe_layer):
    config = _layer_config(make_config, moe_router_pre_softmax=pre_softmax)
    mcore.apply(ElasticConfig(schedule="1-3"))
    layer = make_moe_layer(config)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
    torch.manual_seed(3)
    x = torch.randn(S, B, H, requires_grad=True)
    grad_out = torch.randn(S, B, H)
    x_ref, router_ref, experts_ref = _leaf_copies(layer, x)

    out, bias = layer(x)
    assert bias is None
    (out * grad_out).sum().backward()

    record = mcore.routing_records(layer)[0]
    assert set(record.budgets.tolist()) == {1, 2, 3}
    routing_map = torch.zeros(S * B, E + 1, dtype=torch.bool).scatter(1, record.expert_ids % (E + 1), True)[:, :E]
    assert torch.equal(routing_map.sum(dim=1), record.budgets)
    gate = "full_softmax" if pre_softmax else "renormalized"
    reference = _dense_reference(config, x_ref, router_ref, experts_ref, _hand_gate(config, gate, routing_map))
    _assert_layer_matches_reference(layer, x, out, grad_out, x_ref, router_ref, experts_ref, reference)
    # every expert that received a token got a gradient; the router weight too
    assert layer.router.weight.grad.abs().sum() > 0


DISPATCH_CASES = {
    "allgather_dropless": dict(moe_token_dispatcher_type="allgather"),
    "alltoall_dropless": dict(moe_token_dispatcher_type="alltoall"),
    "allgather_capacity": dict(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0),
    "alltoall_capacity": dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0),
    "allgather_drop_and_pad": dict(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0,
                                   moe_pad_expert_input_to_capacity=True),
    "alltoall_drop_and_pad": dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0,
                                  moe_pad_expert_input_to_capacity=True),
}


@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_dispatchers_combine_exactly_what_the_router_routed(case, make_config, make_moe_layer):
    """Output and gradients equal Σ_e probs_te · expert_e(x_t) over the router's own (probs, map),
    capacity drops and drop-and-pad included; the kept rows are the hand gate on the kept set.

    The elastic router sizes expert capacity from T·k, as stock (E[κ] = k; mcore step 5), so
    stock's drop-and-pad buffers of capacity(T·k)·E rows fit its padded map. Stock alltoall sizes
    dropless buffers as T·k (0.19's permute keeps argsort[:T·k] rows); ``mcore.apply`` installs the
    token-dispatcher fix (``elastic_moe_plugin.mcore.dispatch``) that sizes them from the realised Σκ.
    """
    mcore.apply(ElasticConfig(schedule="1-3"))
    assert _alltoall_dispatcher_patched()
    config = _layer_config(make_config, **DISPATCH_CASES[case])
    layer = make_moe_layer(config)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
    captured = _Captured(layer.router)
    torch.manual_seed(4)
    x = torch.randn(S, B, H, requires_grad=True)
    grad_out = torch.randn(S, B, H)
    x_ref, router_ref, experts_ref = _leaf_copies(layer, x)
    out, _ = layer(x)
    (out * grad_out).sum().backward()

    routing_map = captured.routing_map
    record = mcore.routing_records(layer)[0]
    kept = routing_map & (captured.probs != 0)  # drop-and-pad adds zero-weight padding rows
    if config.moe_expert_capacity_factor is None:
        assert torch.equal(routing_map.sum(dim=1), record.budgets)
    else:
        capacity = -(-S * B * 2 // E)  # ceil(T·k/E·cf) with k = 2, cf = 1
        per_expert = routing_map.sum(dim=0)
        if config.moe_pad_expert_input_to_capacity:
            assert (per_expert == capacity).all()
        else:
            assert (per_expert <= capacity).all() and int(per_expert.max()) == capacity
        assert (kept.sum(dim=1) <= record.budgets).all() and (kept.sum(dim=1) < record.budgets).any()
    # the router's kept weights are the renormalized gate over the selected set (before drops)
    selected = torch.zeros(S * B, E + 1, dtype=torch.bool).scatter(1, record.expert_ids % (E + 1), True)[:, :E]
    hand = _hand_gate(config, "renormalized", selected)(x.detach().view(-1, H) @ layer.router.weight.detach().t())
    torch.testing.assert_close(captured.probs, hand * kept, rtol=RTOL, atol=ATOL)

    reference = _dense_reference(config, x_ref, router_ref, experts_ref,
                                 lambda logits: _hand_gate(config, "renormalized", selected)(logits) * kept)
    _assert_layer_matches_reference(layer, x, out, grad_out, x_ref, router_ref, experts_ref, reference)


def test_static_schedule_layer_is_bitwise_stock(make_config, make_moe_layer):
    config = _layer_config(make_config, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    torch.manual_seed(5)
    x = torch.randn(S, B, H)
    grad_out = torch.randn(S, B, H)

    def run(layer):
        xx = x.clone().requires_grad_()
        out, _ = layer(xx)
        (out * grad_out).sum().backward()
        return [out.detach(), xx.grad] + [p.grad for p in layer.parameters()]

    stock = run(make_moe_layer(config))
    with mcore.patched(ElasticConfig(schedule="static")):
        patched = run(make_moe_layer(config))
    assert len(stock) == len(patched)
    assert all(torch.equal(a, b) for a, b in zip(stock, patched))


# ======================================================================== gate conventions (docs/gates.md) in a layer
def _top1_layer(make_config, make_moe_layer):
    config = _layer_config(make_config, moe_router_topk=1, moe_router_pre_softmax=True)
    layer = make_moe_layer(config)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 1.0)
    return config, layer


def test_top1_full_softmax_layer_router_and_expert_gradients(make_config, make_moe_layer):
    """Top-1 with the full-softmax gate (pre-softmax model): the router weight learns from the task
    loss; an expert's weights get a gradient iff it received a token."""
    config, layer = _top1_layer(make_config, make_moe_layer)
    torch.manual_seed(6)
    x = torch.randn(S, B, H, requires_grad=True)
    grad_out = torch.randn(S, B, H)
    x_ref, router_ref, experts_ref = _leaf_copies(layer, x)
    mcore.apply(ElasticConfig(schedule="static"))
    captured = _Captured(layer.router)
    out, _ = layer(x)
    (out * grad_out).sum().backward()
    routing_map = captured.routing_map
    reference = _dense_reference(config, x_ref, router_ref, experts_ref,
                                 lambda logits: torch.softmax(logits, dim=-1) * routing_map)
    _assert_layer_matches_reference(layer, x, out, grad_out, x_ref, router_ref, experts_ref, reference)
    assert layer.router.weight.grad.abs().sum() > 1e-3
    used = routing_map.any(dim=0)
    for e, (fc1, fc2) in enumerate(_expert_params(layer)):
        assert bool(fc1.grad.abs().sum() > 0) == bool(used[e]) == bool(fc2.grad.abs().sum() > 0)


def test_top1_renormalized_layer_router_gradient_is_exactly_zero(make_config, make_moe_layer):
    """Same layer, gate='renormalized' with κ ≡ 1 (Megatron refuses post-softmax top-1): weight 1,
    so the router weight gets exactly zero task gradient while the experts still learn (docs/gates.md#gate-conventions)."""
    config, layer = _top1_layer(make_config, make_moe_layer)
    plan = LayerPlan(schedule=BudgetSchedule.static(1), gate="renormalized", sampling="iid", layer_index=0)
    router = layer.router
    router.routing = lambda logits, padding_mask=None: elastic_routing(router, plan, logits, padding_mask)
    captured = _Captured(router)
    torch.manual_seed(6)
    x = torch.randn(S, B, H, requires_grad=True)
    grad_out = torch.randn(S, B, H)
    x_ref, router_ref, experts_ref = _leaf_copies(layer, x)
    out, _ = layer(x)
    (out * grad_out).sum().backward()
    assert torch.equal(captured.probs[captured.routing_map], torch.ones(S * B))
    assert torch.count_nonzero(router.weight.grad) == 0
    reference = _dense_reference(config, x_ref, router_ref, experts_ref,
                                 lambda logits: captured.routing_map.float() + 0.0 * logits)
    _assert_layer_matches_reference(layer, x, out, grad_out, x_ref, router_ref, experts_ref, reference)
    assert sum(float(fc1.grad.abs().sum()) for fc1, _ in _expert_params(layer)) > 0


# ======================================================================== explicit spec route
def test_elastic_router_spec_equals_the_monkey_patch(make_config, make_moe_layer, mlp_spec):
    config = _layer_config(make_config, moe_aux_loss_coeff=0.01)
    elastic_config = ElasticConfig(schedule="1-3")
    spec = mcore.elastic_router_spec(mlp_spec(E), elastic_config)
    torch.manual_seed(7)
    x = torch.randn(S, B, H)
    grad_out = torch.randn(S, B, H)

    def run(layer, seed=42):
        xx = x.clone().requires_grad_()
        torch.manual_seed(seed)
        budget_rng.reset()  # both layers draw κ from a stream seeded with `seed`
        out, _ = layer(xx)
        (out * grad_out).sum().backward()
        return [out.detach(), xx.grad] + [p.grad for p in layer.parameters()]

    explicit_layer = make_moe_layer(config, spec=spec)
    assert type(explicit_layer.router).__name__ == "ElasticTopKRouter" and not mcore.is_applied()
    explicit = run(explicit_layer)
    assert len(set(mcore.routing_records(explicit_layer)[0].budgets.tolist())) > 1
    with mcore.patched(elastic_config):
        patched = run(make_moe_layer(config))
    assert len(explicit) == len(patched)
    assert all(torch.equal(a, b) for a, b in zip(explicit, patched))

    stock_layer = make_moe_layer(config)
    explicit_layer.eval()
    stock_layer.eval()
    with torch.no_grad():
        assert torch.equal(explicit_layer(x)[0], stock_layer(x)[0])
    # the original spec is untouched (deep copy)
    assert mcore.elastic_router_spec(mlp_spec(E), elastic_config) is not spec


def test_elastic_router_spec_rejects_a_spec_without_moe(mlp_spec):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with pytest.raises(ValueError, match="no MoE layer"):
        mcore.elastic_router_spec(get_gpt_layer_local_spec(), ElasticConfig(schedule="1-3"))
    layer_spec = mcore.elastic_router_spec(get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False),
                                           ElasticConfig(schedule="1-3"))
    assert layer_spec is not None
