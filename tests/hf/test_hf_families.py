"""Every covered transformers MoE family (``hf.FAMILIES``), as a tiny model built from its config.

- Conformance: with every budget forced to the model's k, the elastic router reproduces the stock
  router of that family (logits bitwise; each token's expert ids bitwise as a set, with each
  expert's weight to rounding and in the same dtype: DeepSeek-style routers take their top-k
  unsorted, so only the set is defined) in fp32 and bf16, for both values of ``norm_topk_prob``
  where the family reads it. This pins the family table (rule kind, logits, bias, renormalisation,
  dtypes, output order) against the installed transformers code.
- Training: for each family and each experts implementation that runs on CPU (eager, grouped_mm,
  batched_mm), an elastic training forward/backward runs, routes κ_t experts per token, multiplies
  exactly Σκ rows in its expert GEMMs, reaches the router with a gradient, and (for causal-LM
  heads) reports the realised-count aux loss.
"""

from __future__ import annotations

import operator

import pytest
import torch

transformers = pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core.schedule import BudgetSchedule
from elastic_moe_plugin.hf import families as hf_families

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_clean")]

IMPLS = ("eager", "grouped_mm", "batched_mm")
FAMILY_NAMES = tuple(family.name for family in hf.FAMILIES)
INSTALLED = {family.name for family in hf.covered_router_classes().values()}


def _installed(family_name: str) -> None:
    """Skip a family the installed transformers does not ship (the table spans 5.19 to 5.25)."""
    if family_name not in INSTALLED:
        pytest.skip(f"transformers {transformers.__version__} has no {family_name}")
#: routers whose block hands them [batch, sequence, H] (they flatten it themselves), not [T, H]
ROUTERS_FED_BY_SEQUENCE = {"afmoe"}
CONFORMANCE = [
    pytest.param(family.name, norm, id=f"{family.name}-norm{norm}" if norm is not None else family.name)
    for family in hf.FAMILIES
    for norm in ((False, True) if family.renormalizes == "norm_topk_prob" else (None,))
]


def _unpack(family, output):
    """(logits, weights, ids) of a router's output, in whichever order the family returns them: the
    logits are the [T, E] float tensor (ids are int64, weights [T, k])."""
    logits_last = not output[0].is_floating_point()
    return (output[2], output[1], output[0]) if logits_last else tuple(output[:3])


def _keep_fp32_where_the_model_does(model, router) -> None:
    """Put back in fp32 the router tensors its model keeps in fp32 whatever its dtype
    (``_keep_in_fp32_modules_strict``: Inkling-2's router weight), as a bf16 checkpoint loads them."""
    name = next(name for name, module in model.named_modules() if module is router)
    patterns = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    with torch.no_grad():
        for tensor_name, tensor in [*router.named_parameters(), *router.named_buffers()]:
            if any(pattern in f"{name}.{tensor_name}" for pattern in patterns):
                tensor.data = tensor.data.float()


def _call_args(family, router, x, generator):
    """The patched call's arguments, as the block passes them: the hidden states and, where the block
    passes one in, a random selection bias [E] (fp32, as the blocks keep it); for a routing method
    (DBRX, Jamba 5.19) the logits of the block's own router (and the hidden states, where it takes them)."""
    values = {"hidden_states": x}
    for name in family.forward_args:
        if name == "hidden_states":
            continue
        if name == "router_logits":
            values[name] = router.router(x)
        else:
            assert name == family.bias_argument, f"{family.name}: no test value for argument {name!r}"
            values[name] = torch.randn(family.num_experts_of(router), generator=generator) * 0.1
    return [values[name] for name in family.call_parameters]


def _by_expert(ids, weights):
    """Each token's (ids, weights) ordered by expert id: the stock order of an unsorted top-k is undefined."""
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), weights.gather(-1, order)


def _experts_name(family, router_name: str) -> str:
    """The experts module next to a router (``...mlp.gate`` → ``...mlp.experts``; a block that routes
    itself holds them: ``...ffn`` → ``...ffn.experts``)."""
    return (router_name if family.routing_method else router_name.rpartition(".")[0]) + ".experts"


def _experts_of(model, router_name: str, family):
    return model.get_submodule(_experts_name(family, router_name))


#: families whose experts compute every candidate slot (b per token, the slots beyond κ weighing 0):
#: LongCat-Flash's block remaps its identity slots to real experts (5.25), or its own loop runs them (5.19)
EXPERTS_EVERY_SLOT = {"longcat_flash"}


def _family(name: str):
    return next(family for family in hf.FAMILIES if family.name == name)


def _expected_rows(family, loaded, record, histogram, router) -> int:
    """The rows a layer's experts multiply in an elastic forward: Σκ where expert compute follows κ
    (from the κ histogram: a looped layer's router, Inkling-2-Loop's, routes once per pass); every
    candidate slot where it does not, less the identity slots a LongCat 5.19 loop skips."""
    if family.name not in EXPERTS_EVERY_SLOT:
        return int((histogram * torch.arange(len(histogram))).sum())
    if loaded.experts is None:  # 5.19: its own loop, whose identity experts multiply nothing
        return int((record.candidate_ids < router.num_experts).sum())  # ids from num_experts on are identities
    return record.candidate_ids.numel()


def _routers(model, *, with_names: bool = False):
    """[(layer index, router, family)] of the covered routers in ``model`` (with the router's
    qualified name first when ``with_names``)."""
    classes = hf.covered_router_classes()
    found = []
    for name, module in model.named_modules():
        if type(module) in classes:
            entry = (hf_families.layer_index_from_name(name), module, classes[type(module)])
            found.append((name, *entry) if with_names else entry)
    return found


def test_every_family_block_holds_the_experts_class_the_table_names(tiny):
    for family in hf.FAMILIES:
        if family.name not in INSTALLED:
            continue
        model = tiny.model(family.name)
        loaded = hf_families.load_family(family)
        if loaded.experts is None:  # LongCat 5.19: its own loop, left stock (EXPERTS_EVERY_SLOT)
            assert family.name in EXPERTS_EVERY_SLOT, family.name
            continue
        for name, _, _, routed_family in _routers(model, with_names=True):
            experts = _experts_of(model, name, routed_family)
            assert type(experts) is loaded.experts, (family.name, type(experts).__name__)


def test_every_family_in_the_table_is_installed_and_tested(tiny):
    assert INSTALLED <= set(FAMILY_NAMES)
    assert len(INSTALLED) >= 56, sorted(INSTALLED)  # 5.19 ships 56 of the table's 72 rows, 5.25 all but Jamba's 5.19 row
    assert set(FAMILY_NAMES) <= set(tiny.families), "every family of the table has a tiny model"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family_name,norm", CONFORMANCE)
def test_router_at_kappa_equal_k_reproduces_the_stock_router(tiny, family_name, norm, dtype):
    _installed(family_name)
    overrides = {} if norm is None else {"norm_topk_prob": norm}
    model = tiny.model(family_name, **overrides)
    _, router, family = _routers(model)[0]
    assert family.name == family_name
    router = router.to(dtype)
    _keep_fp32_where_the_model_does(model, router)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        if family.bias:  # a selection bias that ranks: nonzero, so that ignoring it would show
            bias = operator.attrgetter(family.bias)(router)
            bias.copy_(torch.randn(bias.shape, generator=generator) * 0.1)
        if family.per_expert_scale:  # Gemma 4's factors per expert id: not all ones, so that ignoring them would show
            scale = operator.attrgetter(family.per_expert_scale)(router)
            scale.copy_(torch.rand(scale.shape, generator=generator) + 0.5)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    if family.name in ROUTERS_FED_BY_SEQUENCE:
        x = x.view(2, 16, 64)
    args = _call_args(family, router, x, generator)
    stock = getattr(router, family.patched_method)(*args)  # unpatched
    k = family.top_k_of(router)
    plan = hf.LayerPlan(schedule=BudgetSchedule.static(k), gate=hf.gate_for(router, family, ElasticConfig()),
                        sampling="iid", layer_index=None)
    elastic = hf.elastic_routing(router, plan, *args, budgets=torch.full((32,), k))
    if family.routing_method:  # (weights, ids) in the method's order; the logits are its input
        stock = (args[-1], *(stock[family.method_outputs.index(name)] for name in ("weights", "ids")))
        elastic = (args[-1], *(elastic[family.method_outputs.index(name)] for name in ("weights", "ids")))
    stock_logits, stock_weights, stock_ids = _unpack(family, stock)
    logits, weights, ids = _unpack(family, elastic)
    assert torch.equal(logits, stock_logits)
    assert logits.dtype == stock_logits.dtype
    if family.shared_sink:  # Inkling's shared-expert weights, normalised with the kept routed ones
        assert elastic[3].dtype == stock[3].dtype
        torch.testing.assert_close(elastic[3].detach(), stock[3].detach(),
                                   **({"rtol": 1e-6, "atol": 1e-6} if stock[3].dtype == torch.float32
                                      else {"rtol": 1e-2, "atol": 1e-2}))
    ids, weights = _by_expert(ids, weights)
    stock_ids, stock_weights = _by_expert(stock_ids, stock_weights)
    assert torch.equal(ids, stock_ids)
    assert weights.dtype == stock_weights.dtype
    tolerance = {"rtol": 1e-6, "atol": 1e-7} if weights.dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(weights.detach(), stock_weights.detach(), **tolerance)
    expected_gate = {"never": "full_softmax", "always": "renormalized"}.get(family.renormalizes)
    if norm is not None:
        expected_gate = "renormalized" if norm else "full_softmax"
    if expected_gate is not None:
        assert plan.gate == expected_gate


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_family_trains_elastically_with_every_experts_implementation(tiny, hand_aux, expert_rows, family_name, impl):
    _installed(family_name)
    loaded = hf_families.load_family(_family(family_name))
    own_loop = loaded.own_experts or loaded.experts is None
    if own_loop and impl != "eager":
        pytest.skip(f"{family_name}'s experts are its own loop here, not transformers' dispatcher")
    hf.apply(ElasticConfig(schedule="1-3"))
    model = tiny.model(family_name, experts_implementation=None if own_loop else impl)
    routers = _routers(model)
    assert routers, f"{family_name}: no covered router built"
    inputs = tiny.inputs(family_name)
    torch.manual_seed(0)
    with expert_rows(model) as counted:
        out = model(**inputs, output_router_logits=True)
    loss = out.loss if getattr(out, "loss", None) is not None else out.last_hidden_state.square().mean()
    assert torch.isfinite(loss)
    loss.backward()

    records = hf.routing_records(model)
    keys = hf.router_keys(model)  # the layer index, or (layer, part) where a layer holds several routers
    assert set(records) == {keys[name] for name, _, _, _ in _routers(model, with_names=True)}
    tokens_per_layer: dict[int, int] = {}
    for name, index, router, family in _routers(model, with_names=True):
        record = records[keys[name]]
        tokens = record.budgets.numel()  # 16, or a layer's text or vision tokens (ERNIE-4.5-VL)
        tokens_per_layer[index] = tokens_per_layer.get(index, 0) + tokens
        assert record.expert_ids.shape == (tokens, 3)
        assert int(record.budgets.min()) >= 1 and int(record.budgets.max()) <= 3
        assert torch.equal((record.expert_ids >= 0).sum(-1), record.budgets)
        # the router's projection: its own weight, or its Linear's (HunYuan's wg, AFMoE's gate, Gemma 4's proj;
        # the block's router where the block routes, DBRX's and Jamba 5.19's)
        source = router.router if family.routing_method else router
        weight = next(parameter for parameter in source.parameters() if parameter.dim() == 2)
        assert weight.grad is not None and torch.isfinite(weight.grad).all()
        assert weight.grad.abs().sum() > 0
    assert set(tokens_per_layer.values()) == {16}  # every token of every layer routed once
    # expert compute follows κ: the experts next to each router multiplied exactly Σκ rows
    histograms = hf.budget_histograms(model)
    expected_rows = {_experts_name(family, name): _expected_rows(family, loaded, records[keys[name]],
                                                                 histograms[keys[name]], router)
                     for name, _, router, family in _routers(model, with_names=True)}
    # ... and the experts of a router that cannot rank (DeepSeek-V4's hash layer) every token's k slots
    expected_rows |= {_experts_name(family, name): 16 * router.top_k
                      for name, router, family, _ in hf_families.static_routers(model)}
    # (Inkling's shared experts, which every token passes through, are not counted: no router picks them)
    assert {name: rows for name, rows in counted.rows.items() if not name.endswith("shared_experts")} == expected_rows

    if getattr(out, "aux_loss", None) is not None:
        ids = [records[keys[name]].expert_ids for name, _, _, _ in _routers(model, with_names=True)]
        expected = hand_aux(out.router_logits, ids, routers[0][2].num_experts_of(routers[0][1]))
        torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-6, atol=0)
