"""Token-dispatcher fixes for a per-token budget κ (``elastic_moe_plugin.mcore.dispatch``), on CPU.

- Host syncs: the alltoall dispatcher's ``preprocess`` (and ``dispatch_preprocess``, where its
  sizes reach the host) is wrapped in ``counters.host_syncs`` (tests/counters.py), counting
  ``aten::_local_scalar_dense`` (an explicit device-to-host read) and ``nonzero``/``masked_select``
  (ops whose output size needs one). ``iid`` and ``balanced`` must cost exactly what stock dropless
  costs (Σκ comes from the host's κ draw, on the map's tag); ``mode="top_p"``, whose Σκ only the
  device knows, exactly what stock pays with a capacity factor. ``ELASTIC_MOE_DEBUG=1`` checks the host Σκ against the map.
- Flex dispatchers (DeepEP, NCCL-EP, HybridEP): the patched ``setup_metadata`` runs on manager
  instances made with ``object.__new__`` plus the attributes it reads (only construction needs the
  DeepEP / TE kernels), and through the real ``MoEFlexTokenDispatcher.dispatch_preprocess``.
"""

from __future__ import annotations

import json

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.mcore import dispatch
from elastic_moe_plugin.mcore.routing import UnsupportedMegatronError, mark_elastic
from counters import DATA_SIZED_OPS, EXPLICIT_SYNCS, host_syncs
from megatron_support import force_budgets

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

S, B, H, E, K = 8, 3, 16, 8, 2
SCHEDULE, WIDTH = "1-3", 3  # b = 3 around k = 2


# ================================================================================ host syncs
def _counted(counts: dict, name: str, method):
    def wrapper(*args, **kwargs):
        with host_syncs(megatron=True) as counter:
            result = method(*args, **kwargs)
        counts[name] = (counter.of(*EXPLICIT_SYNCS), counter.of(*DATA_SIZED_OPS))
        return result

    return wrapper


CASES = {
    # label: (elastic sampling or None for stock, layer config overrides)
    "stock": (None, {}),
    "stock_capacity_factor": (None, dict(moe_expert_capacity_factor=1.5)),
    "elastic_iid": ("iid", {}),
    "elastic_balanced": ("balanced", {}),
    "elastic_top_p": ("top_p", {}),
}


def _elastic_config(sampling: str) -> ElasticConfig:
    if sampling == "top_p":  # κ from the probabilities, on the device
        return ElasticConfig(mode="top_p", top_p=0.5, top_p_max_experts=WIDTH)
    return ElasticConfig(schedule=SCHEDULE, sampling=sampling)


def measure_alltoall_syncs(make_config, make_moe_layer) -> dict[str, dict]:
    """One training forward+backward of an EP=1 alltoall MoE layer per case; host syncs counted in
    the dispatcher's ``preprocess`` and ``dispatch_preprocess`` (which calls ``preprocess``)."""
    results = {}
    for label, (sampling, overrides) in CASES.items():
        if sampling is None:
            mcore.remove()
        else:
            mcore.apply(_elastic_config(sampling))
        config = make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H, moe_token_dispatcher_type="alltoall",
                             **overrides)
        layer = make_moe_layer(config)
        dispatcher = layer.token_dispatcher
        counts: dict[str, tuple[int, int]] = {}
        dispatcher.preprocess = _counted(counts, "preprocess", dispatcher.preprocess)
        dispatcher.dispatch_preprocess = _counted(counts, "dispatch_preprocess", dispatcher.dispatch_preprocess)
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0), requires_grad=True)
        torch.manual_seed(1)
        with host_syncs(megatron=True) as whole:
            out, _ = layer(x)
            out.sum().backward()
        budgets = mcore.routing_records(layer)[0].budgets if sampling else torch.full((S * B,), K)
        results[label] = {
            "preprocess": counts["preprocess"][0],
            "dispatch_preprocess": counts["dispatch_preprocess"][0],
            "dispatch_preprocess_implicit": counts["dispatch_preprocess"][1],
            "layer_forward_backward": whole.of(*EXPLICIT_SYNCS),
            "cuda_sync_point": dispatcher.cuda_sync_point,
            "num_out_tokens": type(dispatcher.num_out_tokens).__name__,
            "num_out_tokens_value": int(dispatcher.num_out_tokens),
            "sum_kappa": int(budgets.sum()),
        }
    mcore.remove()
    return results


def test_iid_and_balanced_are_sync_free_and_top_p_pays_what_a_capacity_factor_pays(make_config, make_moe_layer):
    counts = measure_alltoall_syncs(make_config, make_moe_layer)
    print("alltoall host syncs (EP=1, T=24, E=8, k=2, schedule 1-3):", json.dumps(counts, sort_keys=True))
    stock, capacity = counts["stock"], counts["stock_capacity_factor"]
    iid, balanced, top_p = counts["elastic_iid"], counts["elastic_balanced"], counts["elastic_top_p"]
    # Megatron's preprocess itself never reads the device: it only schedules the DtoH copies
    assert stock["preprocess"] == capacity["preprocess"] == iid["preprocess"] == balanced["preprocess"] == 0
    assert top_p["preprocess"] == 0
    keys = ("dispatch_preprocess", "dispatch_preprocess_implicit", "layer_forward_backward", "cuda_sync_point",
            "num_out_tokens")
    # balanced adds nothing over stock: static T·k size, stock's sync point
    assert {key: balanced[key] for key in keys} == {key: stock[key] for key in keys}
    assert balanced["num_out_tokens"] == "int" and balanced["sum_kappa"] == S * B * K
    # iid adds nothing over stock either: the realised Σκ comes from the host's κ draw, as a host
    # int, and stock's sync point stays
    assert {key: iid[key] for key in keys} == {key: stock[key] for key in keys}
    assert iid["cuda_sync_point"] != "before_permutation_1" and iid["num_out_tokens"] == "int"
    assert iid["num_out_tokens_value"] == iid["sum_kappa"] != S * B * K  # the realised size, not T·k
    # top-p (κ from the device's probabilities) adds exactly what stock pays with a capacity factor:
    # the realised Σκ, read on the host at Megatron's own earliest sync point
    assert {key: top_p[key] for key in keys} == {key: capacity[key] for key in keys}
    assert top_p["cuda_sync_point"] == "before_permutation_1" and top_p["num_out_tokens"] == "Tensor"
    assert top_p["num_out_tokens_value"] == top_p["sum_kappa"] != S * B * K
    # stock dropless pays no explicit read where the capacity factor pays one (0.19's argsort
    # permute; 0.16's masked_select permute pays its implicit sync in every case alike)
    assert top_p["dispatch_preprocess"] - stock["dispatch_preprocess"] == (
        capacity["dispatch_preprocess"] - stock["dispatch_preprocess"])


def test_the_map_tag_carries_the_host_total_only_where_the_host_knows_it(make_config, make_router, monkeypatch):
    """Σκ on the tag: the κ draw's host total for iid and balanced (equal to the map's count), none
    for top-p (κ from the device) or after capacity drops; a forced κ is a draw like any other."""
    def tag_total(elastic: ElasticConfig, **overrides):
        mcore.apply(elastic)
        router = make_router(make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H, **overrides),
                             weight_std=1.0)
        _, routing_map = router(torch.randn(S, B, H, generator=torch.Generator().manual_seed(2)))
        return getattr(routing_map, dispatch.TOTAL_ATTR), int(routing_map.sum())

    for sampling in ("iid", "balanced"):
        total, realised = tag_total(_elastic_config(sampling))
        assert total == realised and type(total) is int
    assert tag_total(_elastic_config("iid"))[0] != S * B * K
    assert tag_total(_elastic_config("top_p"))[0] is None
    assert tag_total(_elastic_config("iid"), moe_expert_capacity_factor=0.5)[0] is None
    force_budgets(monkeypatch, lambda n: torch.full((n,), 3))
    assert tag_total(_elastic_config("iid")) == (S * B * 3, S * B * 3)


def _balanced_layer(make_config, make_moe_layer):
    mcore.apply(ElasticConfig(schedule=SCHEDULE, sampling="balanced"))
    config = make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H, moe_token_dispatcher_type="alltoall")
    return make_moe_layer(config)


def test_debug_mode_asserts_the_balanced_invariant(make_config, make_moe_layer, monkeypatch):
    layer = _balanced_layer(make_config, make_moe_layer)
    bad = torch.zeros(S * B, E, dtype=torch.bool)
    bad[:, 0] = True  # Σκ = T, not T·k
    mark_elastic(bad, WIDTH, balanced=True)
    layer.token_dispatcher.preprocess(bad)  # without the debug flag: no check, no sync
    monkeypatch.setenv(dispatch.DEBUG_ENV, "1")
    with pytest.raises(AssertionError, match=rf"balanced elastic routing dispatched {S * B} pairs, expected T·k = {S * B * K}"):
        layer.token_dispatcher.preprocess(bad)
    # a real balanced forward satisfies it; the check itself costs one host read
    x = torch.randn(S, B, H)
    with host_syncs(megatron=True) as debug:
        layer(x)
    monkeypatch.delenv(dispatch.DEBUG_ENV)
    with host_syncs(megatron=True) as plain:
        layer(x)
    assert debug.of(*EXPLICIT_SYNCS) == plain.of(*EXPLICIT_SYNCS) + 1


def test_debug_mode_asserts_the_host_total_under_iid(make_config, make_moe_layer, monkeypatch):
    mcore.apply(ElasticConfig(schedule=SCHEDULE, sampling="iid"))
    config = make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H, moe_token_dispatcher_type="alltoall")
    layer = make_moe_layer(config)
    bad = torch.zeros(S * B, E, dtype=torch.bool)
    bad[:, :2] = True
    mark_elastic(bad, WIDTH, balanced=False, total=S * B * 2 + 1)  # a host Σκ the map does not have
    layer.token_dispatcher.preprocess(bad)  # without the debug flag: no check, no sync
    assert layer.token_dispatcher.num_out_tokens == S * B * 2 + 1
    monkeypatch.setenv(dispatch.DEBUG_ENV, "1")
    with pytest.raises(AssertionError, match=rf"elastic routing dispatched {S * B * 2} pairs, but the κ drawn on "
                                             rf"the host sum to Σκ = {S * B * 2 + 1}"):
        layer.token_dispatcher.preprocess(bad)
    # a real iid forward satisfies it; the check itself costs one host read
    x = torch.randn(S, B, H)
    with host_syncs(megatron=True) as debug:
        layer(x)
    monkeypatch.delenv(dispatch.DEBUG_ENV)
    with host_syncs(megatron=True) as plain:
        layer(x)
    assert debug.of(*EXPLICIT_SYNCS) == plain.of(*EXPLICIT_SYNCS) + 1


def test_allgather_pays_what_stock_pays(make_config, make_moe_layer):
    """The allgather dispatcher copies its per-expert counts to the host (``.cpu()``) and sizes the
    permute from that copy, for an elastic map as for a stock one: no read of its own."""
    counts = {}
    for label in ("stock", "iid", "balanced", "top_p"):
        if label == "stock":
            mcore.remove()
        else:
            mcore.apply(_elastic_config(label))
        config = make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H, moe_token_dispatcher_type="allgather")
        layer = make_moe_layer(config)
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with host_syncs(megatron=True) as whole:
            out, _ = layer(x)
            out.sum().backward()
        counts[label] = (whole.of(*EXPLICIT_SYNCS), whole.of(*DATA_SIZED_OPS))
    mcore.remove()
    assert counts["iid"] == counts["balanced"] == counts["top_p"] == counts["stock"]


# ================================================================================ capacity
class _Dispatched:
    """What one MoE layer forward routed and dispatched: the router's (probs, map) by a forward
    hook, and the experts' input rows and ``tokens_per_expert`` by a forward pre-hook."""

    def __init__(self, layer):
        layer.router.register_forward_hook(self._router)
        layer.experts.register_forward_pre_hook(self._experts)

    def _router(self, module, inputs, outputs):
        self.probs, self.routing_map = outputs[0].detach(), outputs[1].detach()

    def _experts(self, module, args):
        self.rows = args[0].shape[0]
        self.tokens_per_expert = torch.as_tensor(args[1]).tolist()


def _capacity_layer_run(make_config, make_moe_layer, elastic: ElasticConfig | None, **overrides):
    """One training forward+backward of an alltoall MoE layer (seeded weights, input and κ draw)."""
    config = make_config(hidden_size=H, moe_token_dispatcher_type="alltoall", **overrides)
    if elastic is None:
        mcore.remove()
    else:
        mcore.apply(elastic)
    layer = make_moe_layer(config, seed=3)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)  # clear winners, so capacity binds on some experts
    dispatched = _Dispatched(layer)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4), requires_grad=True)
    torch.manual_seed(5)
    out, _ = layer(x)
    (out * torch.randn(S, B, H, generator=torch.Generator().manual_seed(6))).sum().backward()
    dispatched.out, dispatched.input_grad, dispatched.layer = out.detach(), x.grad, layer
    dispatched.capacity = layer.token_dispatcher.capacity
    return config, dispatched


CAPACITY_MATRIX = [
    (capacity_factor, pad, policy, topk)
    for capacity_factor in (1.0, 1.5) for pad in (False, True) for policy in ("probs", "position") for topk in (2, 8)
]


@pytest.mark.parametrize(("capacity_factor", "pad", "policy", "topk"), CAPACITY_MATRIX,
                         ids=[f"cf{c}-{'pad' if p else 'drop'}-{d}-top{k}" for c, p, d, k in CAPACITY_MATRIX])
def test_point_mass_capacity_is_bitwise_stock(capacity_factor, pad, policy, topk, make_config, make_moe_layer):
    """κ ≡ k drawn by the elastic path with b = k + 1 (vanishing σ on {k−1..k+1}) routes, drops,
    pads and dispatches exactly what stock top-k does: the capacity is get_capacity(T·k, E, cf),
    not from b, in the router and in the alltoall drop-and-pad buffers alike."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    num_experts = 16 if topk == 8 else E
    overrides = dict(num_moe_experts=num_experts, moe_router_topk=topk, moe_expert_capacity_factor=capacity_factor,
                     moe_pad_expert_input_to_capacity=pad, moe_token_drop_policy=policy)
    _, stock = _capacity_layer_run(make_config, make_moe_layer, None, **overrides)
    _, elastic = _capacity_layer_run(make_config, make_moe_layer,
                                     ElasticConfig(schedule=f"{topk - 1}-{topk + 1}", sigma=1e-3), **overrides)
    record = mcore.routing_records(elastic.layer)[0]
    assert record.expert_ids.shape[1] == topk + 1 and (record.budgets == topk).all()  # the elastic path ran

    capacity = get_capacity(num_tokens=S * B * topk, num_experts=num_experts, capacity_factor=capacity_factor)
    assert capacity < S * B  # capacity binds: Megatron skips dropping when it exceeds T
    per_expert = stock.routing_map.sum(dim=0)
    assert (per_expert == capacity).all() if pad else (per_expert <= capacity).all()
    if capacity_factor == 1.0:  # not vacuous: stock really drops something
        assert int((stock.probs != 0).sum()) < S * B * topk
    for name in ("probs", "routing_map", "out", "input_grad"):
        assert torch.equal(getattr(stock, name), getattr(elastic, name)), name
    assert (elastic.rows, elastic.tokens_per_expert) == (stock.rows, stock.tokens_per_expert)
    assert elastic.capacity == stock.capacity == (capacity if pad else None)
    for stock_param, elastic_param in zip(stock.layer.parameters(), elastic.layer.parameters()):
        assert torch.equal(stock_param.grad, elastic_param.grad)


@pytest.mark.parametrize("pad", [False, True], ids=["drop", "pad"])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_elastic_6_10_never_exceeds_the_capacity_computed_from_k(pad, policy, make_config, make_moe_layer):
    """6–10 around top-8, cf = 1: no expert gets more than get_capacity(T·k, E, cf) entries (with
    drop-and-pad exactly that many), although Σκ differs from T·k; the drop metrics count what
    capacity removed, the extra experts of tokens with κ > k included."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    num_experts, topk = 16, 8
    config, dispatched = _capacity_layer_run(
        make_config, make_moe_layer, ElasticConfig(schedule="6-10"), num_moe_experts=num_experts, moe_router_topk=topk,
        moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=pad, moe_token_drop_policy=policy)
    record = mcore.routing_records(dispatched.layer)[0]
    assert record.expert_ids.shape[1] == 10 and int(record.budgets.sum()) != S * B * topk  # iid: Σκ ≠ T·k

    capacity = get_capacity(num_tokens=S * B * topk, num_experts=num_experts, capacity_factor=1.0)
    per_expert = dispatched.routing_map.sum(dim=0)
    assert (per_expert == capacity).all() if pad else (per_expert <= capacity).all() and per_expert.max() == capacity
    assert max(dispatched.tokens_per_expert) <= capacity
    assert sum(dispatched.tokens_per_expert) == dispatched.rows == int(per_expert.sum())
    if pad:  # the buffers stock allocates at the same cf
        assert dispatched.capacity == capacity and dispatched.rows == capacity * num_experts

    # drop record: a selected slot is dropped iff its (token, expert) left the map; κ > k tokens lose some
    selected = record.expert_ids >= 0
    routed_after = dispatched.routing_map.gather(1, record.expert_ids.clamp(min=0)) & selected
    assert torch.equal(record.capacity_dropped, selected & ~routed_after)
    beyond = record.capacity_dropped[:, topk:]
    assert record.capacity_dropped[:, :topk].any()
    if policy == "probs":  # lowest probabilities go first, so the κ > k tokens' extra experts are among them
        assert beyond.any()  # (by position, whether any is dropped depends on the κ drawn)
    metrics = mcore.routing_metrics(dispatched.layer)
    layer_metric = "elastic_moe/layer_0/capacity_dropped_frac"
    assert metrics[layer_metric] == pytest.approx(int(record.capacity_dropped.sum()) / int(selected.sum()))
    assert metrics[layer_metric + "_beyond_k"] == pytest.approx(int(beyond.sum()) / int(selected[:, topk:].sum()))
    assert metrics["elastic_moe/capacity_dropped_frac"] == metrics[layer_metric]


def test_drop_and_pad_buffers_match_the_router_capacity(make_config, make_moe_layer):
    """With drop-and-pad every expert buffer holds ceil(T·k/E·cf) rows, stock's, whatever κ, and the
    router pads its map to exactly that (permute/unpermute shapes depend on it)."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    mcore.apply(ElasticConfig(schedule=SCHEDULE))
    config = make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H, moe_token_dispatcher_type="alltoall",
                         moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    layer = make_moe_layer(config)
    captured = {}
    layer.router.register_forward_hook(lambda module, inputs, outputs: captured.update(map=outputs[1]))
    layer(torch.randn(S, B, H))
    capacity = get_capacity(num_tokens=S * B * K, num_experts=E, capacity_factor=1.0)
    assert layer.token_dispatcher.capacity == capacity
    assert (captured["map"].sum(dim=0) == capacity).all()  # the router pads to the same capacity
    assert config.moe_router_topk == K


# ================================================================================ flex dispatchers
def _token_dispatcher():
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher


def _elastic_map(budgets, seed=0, width=WIDTH, num_experts=E):
    """(probs [T, E], routing_map [T, E]) routing token t to its top-κ_t experts, tagged with b."""
    logits = torch.randn(len(budgets), num_experts, generator=torch.Generator().manual_seed(seed))
    order = logits.argsort(dim=1, descending=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(num_experts).expand_as(order))
    routing_map = ranks < torch.tensor(budgets).unsqueeze(1)
    probs = torch.softmax(logits.masked_fill(~routing_map, float("-inf")), dim=1).nan_to_num(0.0)
    return probs, mark_elastic(routing_map, width, balanced=False)


def _manager(name, make_config, *, tp=1, capacity_factor=None, **attributes):
    """A flex-dispatcher manager without its constructor (which needs DeepEP / TE kernels)."""
    cls = getattr(_token_dispatcher(), name, None)
    if cls is None:
        pytest.skip(f"this megatron-core has no {name}")
    manager = object.__new__(cls)
    manager.config = make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H)
    manager.num_experts = tp * E
    manager.num_local_experts = E
    manager.router_topk = tp * K
    manager.capacity_factor = capacity_factor
    manager.__dict__.update(attributes)
    return manager


def _routed_sets(indices):
    return [sorted(i for i in row.tolist() if i >= 0) for row in indices]


def _map_sets(routing_map):
    return [sorted(row.nonzero().flatten().tolist()) for row in routing_map]


BUDGETS = [1, 2, 3, 1, 3, 2, 3, 1]


def test_indices_from_routing_map_keeps_every_routed_expert_and_pads_with_minus_one():
    probs, routing_map = _elastic_map(BUDGETS)
    token_probs, indices = dispatch.indices_from_routing_map(routing_map, probs, WIDTH)
    assert indices.shape == token_probs.shape == (len(BUDGETS), WIDTH)
    assert _routed_sets(indices) == _map_sets(routing_map)
    assert (indices < 0).sum(dim=1).tolist() == [WIDTH - kappa for kappa in BUDGETS]
    assert torch.equal(token_probs[indices < 0], torch.zeros(int((indices < 0).sum())))
    routed = indices >= 0
    assert torch.equal(token_probs[routed], torch.gather(probs, 1, indices.clamp(min=0))[routed])
    with host_syncs(megatron=True) as counter:
        dispatch.indices_from_routing_map(routing_map, probs, WIDTH)
    assert counter.of(*EXPLICIT_SYNCS) == counter.of(*DATA_SIZED_OPS) == 0


@pytest.mark.parametrize("name", ["_DeepepManager", "_NCCLEPManager"])
def test_indexed_managers_route_kappa_experts_without_phantoms_or_truncation(name, make_config):
    extra = dict(_bootstrapped=False, num_local_tokens=None) if name == "_NCCLEPManager" else {}
    probs, routing_map = _elastic_map(BUDGETS)
    mcore.apply(ElasticConfig(schedule=SCHEDULE))  # installs the dispatcher patches
    manager = _manager(name, make_config, **extra)
    manager.setup_metadata(routing_map, probs)
    assert manager.token_indices.shape == (len(BUDGETS), WIDTH)  # κ > k is not truncated
    assert _routed_sets(manager.token_indices) == _map_sets(routing_map)  # κ < k: no phantom expert
    assert (manager.token_indices < 0).sum(dim=1).tolist() == [WIDTH - kappa for kappa in BUDGETS]
    assert manager.router_topk == WIDTH
    if name == "_NCCLEPManager":
        assert manager.num_local_tokens == len(BUDGETS)

    # what stock does with the same map: top-k of the probabilities
    stock = _manager(name, make_config, **extra)
    mcore.remove()
    stock.setup_metadata(routing_map.clone(), probs)
    stock_sets = [sorted(row.tolist()) for row in stock.token_indices]
    kappa_one = BUDGETS.index(1)
    assert len(stock_sets[kappa_one]) == K and -1 not in stock_sets[kappa_one]  # a phantom expert
    kappa_three = BUDGETS.index(3)
    assert len(stock_sets[kappa_three]) == K < 3  # truncated


def test_capacity_dropped_entries_are_minus_one(make_config, make_router):
    mcore.apply(ElasticConfig(schedule=SCHEDULE))
    router = make_router(make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H,
                                     moe_expert_capacity_factor=0.5), weight_std=1.0)
    probs, routing_map = router(torch.randn(S, B, H, generator=torch.Generator().manual_seed(2)))
    budgets = mcore.routing_records(router)[0].budgets
    kept = routing_map.sum(dim=1)
    assert (kept < budgets).any(), "the capacity factor should drop some assignments"
    manager = _manager("_DeepepManager", make_config, capacity_factor=0.5)
    manager.setup_metadata(routing_map, probs)
    assert manager.token_indices.shape == (S * B, WIDTH)
    assert ((manager.token_indices >= 0).sum(dim=1) == kept).all()
    assert _routed_sets(manager.token_indices) == _map_sets(routing_map)


@pytest.mark.parametrize("name", ["_DeepepManager", "_NCCLEPManager"])
def test_flex_dispatcher_hands_the_tag_through_the_tp_fold(name, make_config):
    """The real ``dispatch_preprocess``: ``_initialize_metadata`` replicates the map over TP into a
    new (untagged) tensor; the manager still gets width TP·b and every token's TP·κ experts."""
    tp = 2
    extra = dict(_bootstrapped=False, num_local_tokens=None) if name == "_NCCLEPManager" else {}
    mcore.apply(ElasticConfig(schedule=SCHEDULE))
    manager = _manager(name, make_config, tp=tp, **extra)
    flex = object.__new__(_token_dispatcher().MoEFlexTokenDispatcher)
    flex.config, flex.tp_size, flex.ep_size, flex.num_local_experts = manager.config, tp, 1, E
    flex.shared_experts, flex._comm_manager = None, manager
    probs, routing_map = _elastic_map(BUDGETS)
    hidden = torch.randn(len(BUDGETS), 1, H)
    _, token_probs = flex.dispatch_preprocess(hidden, routing_map, probs)
    assert manager.token_indices.shape == (len(BUDGETS), tp * WIDTH) and manager.router_topk == tp * WIDTH
    assert ((manager.token_indices >= 0).sum(dim=1) == tp * torch.tensor(BUDGETS)).all()
    folded = [sorted({i % E for i in row}) for row in _routed_sets(manager.token_indices)]
    assert folded == _map_sets(routing_map)
    assert token_probs is manager.token_probs
    assert not hasattr(manager, dispatch.MANAGER_TAG_ATTR)  # handed over for one call only

    # a stock map afterwards (eval, or a static layer) gets the stock width again: no phantoms
    stock_map = torch.zeros(len(BUDGETS), E, dtype=torch.bool)
    stock_map[:, :K] = True
    flex.dispatch_preprocess(hidden, stock_map, stock_map.float() / K)
    assert manager.token_indices.shape == (len(BUDGETS), tp * K) and manager.router_topk == tp * WIDTH


def test_ncclep_refuses_to_widen_after_its_buffers_were_sized(make_config):
    mcore.apply(ElasticConfig(schedule=SCHEDULE))
    manager = _manager("_NCCLEPManager", make_config, _bootstrapped=True, num_local_tokens=None)
    probs, routing_map = _elastic_map(BUDGETS)
    with pytest.raises(UnsupportedMegatronError, match=r"NCCL-EP receive buffers were sized for 2 .* needs 3"):
        manager.setup_metadata(routing_map, probs)


def test_hybridep_drop_and_pad_capacity_is_the_router_capacity(make_config, make_router):
    """HybridEP runs stock (not patched): its drop-and-pad capacity, from T·k, is the capacity the
    elastic router padded every expert to."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    class _Group:
        def size(self):
            return 1

    mcore.apply(ElasticConfig(schedule=SCHEDULE))
    assert not any("_HybridEPManager" in target for target in dispatch.installed_targets())
    overrides = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    router = make_router(make_config(num_moe_experts=E, moe_router_topk=K, hidden_size=H, **overrides), weight_std=1.0)
    probs, routing_map = router(torch.randn(S, B, H, generator=torch.Generator().manual_seed(2)))
    assert mcore.routing_records(router)[0].expert_ids.shape[1] == WIDTH  # elastic, b = 3
    capacity = get_capacity(num_tokens=S * B * K, num_experts=E, capacity_factor=1.0)
    assert (routing_map.sum(dim=0) == capacity).all()

    attributes = dict(drop_and_pad=True, group=_Group(), moe_expert_rank_capacity_factor=None, num_permuted_tokens=None)
    manager = _manager("_HybridEPManager", make_config, capacity_factor=1.0, **attributes)
    manager.setup_metadata(routing_map, probs)
    assert manager.capacity == capacity
    assert manager.num_permuted_tokens == capacity * E == int(routing_map.sum())
    assert torch.equal(manager.routing_map, routing_map)  # HybridEP consumes the map itself


# ================================================================================ one lifecycle
def test_the_info_count_lists_the_dispatcher_fixes_and_equals_what_remove_restores(caplog):
    """The dispatcher replacements belong to the router patch's own ``AttributePatches``: the INFO
    line counts them, ``patched_symbols`` names them, and ``remove`` restores exactly that many."""
    import logging
    import re

    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.router import TopKRouter

    if dispatch.SPEC_FIXES.is_on:
        pytest.skip("an ElasticTopKRouter built earlier in this process holds the dispatcher fixes for life")
    owners = [TopKRouter] + [value for value in vars(token_dispatcher).values() if isinstance(value, type)]
    before = {(id(owner), name): value for owner in owners for name, value in vars(owner).items()}
    with caplog.at_level(logging.INFO, logger="elastic_moe_plugin.mcore"):
        mcore.apply(ElasticConfig(schedule=SCHEDULE))
    counted = [int(m.group(1)) for m in (re.search(r"mcore patched \((\d+) attributes", r.getMessage())
                                         for r in caplog.records) if m]
    symbols = mcore.patched_symbols()
    assert counted == [len(symbols)]
    assert "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.preprocess" in symbols
    assert set(dispatch.installed_targets()) <= set(symbols)
    patched = {(id(owner), name) for owner in owners for name, value in vars(owner).items()
               if before.get((id(owner), name)) is not value}
    mcore.remove()
    restored = [key for key in patched if vars(next(o for o in owners if id(o) == key[0])).get(key[1]) is before[key]]
    assert len(restored) == len(patched) == counted[0]
    assert dispatch.installed_targets() == []


def test_removing_the_patch_keeps_the_fixes_an_explicit_spec_router_holds():
    """Spec routers hold the fixes for life (``dispatch.SPEC_FIXES``): whichever came first, the
    monkey-patch's ``remove`` leaves the alltoall fix installed while the switch is on."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from elastic_moe_plugin.core.patching import is_patched

    held_before = dispatch.SPEC_FIXES.is_on

    def alltoall_fixed() -> bool:
        return is_patched(MoEAlltoAllTokenDispatcher.__dict__["preprocess"])

    try:
        mcore.apply(ElasticConfig(schedule=SCHEDULE))   # the patch first ...
        dispatch.SPEC_FIXES.on()                         # ... then a spec router is built
        mcore.remove()
        assert alltoall_fixed()
        mcore.apply(ElasticConfig(schedule=SCHEDULE))   # the spec router's fixes first: the patch skips them
        assert not any("MoEAlltoAllTokenDispatcher" in symbol for symbol in mcore.patched_symbols())
        mcore.remove()
        assert alltoall_fixed()
    finally:
        mcore.remove()
        if not held_before:
            dispatch.SPEC_FIXES.off()
    assert alltoall_fixed() == held_before
