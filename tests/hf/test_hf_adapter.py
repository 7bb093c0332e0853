"""The transformers adapter (``elastic_moe_plugin.hf``) on tiny OLMoE / Qwen3-MoE models, on CPU.

Every expectation is a hand-written reference: unpatched transformers itself (bitwise, where the
issue claims bitwise equality), ``torch.sort`` of the fp32 softmax for the selected set, closed
forms for both gate conventions, a per-token dense loop Σ_e w_te·expert_e(x_t) for the MoE block,
the load-balancing loss written out from its definition, and scipy's chi-square test for κ.
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

transformers = pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core.config import ConfigError
from elastic_moe_plugin.core.patching import PATCH_MARKER
from elastic_moe_plugin.core.budget_stream import BudgetStream
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET, BudgetSchedule
from elastic_moe_plugin.hf import budget_rng
from elastic_moe_plugin.hf import families as hf_families
from elastic_moe_plugin.hf import patch as hf_patch
from elastic_moe_plugin.core.records import latest_record
from elastic_moe_plugin.core.router_state import state_of

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_clean")]

IMPLS = ("eager", "grouped_mm", "batched_mm")
E, K = 8, 2


def _padding_mask() -> torch.Tensor:
    """[batch, seq] with 1 = real token (transformers' polarity); the second row ends in padding."""
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    return mask


def _step(model, inputs, seed=7, **extra):
    """One training forward + backward; everything the comparisons need, detached."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    budget_rng.reset()  # κ from a generator seeded with `seed`, as the default generator is
    out = model(**inputs, output_router_logits=True, **extra)
    out.loss.backward()
    return {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "aux_loss": out.aux_loss.detach(),
        "router_logits": [z.detach() for z in out.router_logits],
        "grads": {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None},
    }


def _assert_bitwise(a, b):
    assert torch.equal(a["logits"], b["logits"])
    assert torch.equal(a["loss"], b["loss"])
    assert torch.equal(a["aux_loss"], b["aux_loss"])
    assert all(torch.equal(x, y) for x, y in zip(a["router_logits"], b["router_logits"]))
    assert a["grads"].keys() == b["grads"].keys() and len(a["grads"]) > 0
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name


def _family_objects(name):
    family = next(f for f in hf.FAMILIES if f.name == name)
    return family, hf_families.load_family(family)


def _all_patch_points():
    points = []
    for family in hf.FAMILIES:
        loaded = hf_families.load_family(family)
        if isinstance(loaded, str):
            continue
        # every covered family's experts follow κ but LongCat-Flash 5.19's own loop (docs/transformers.md)
        assert loaded.experts is not None or family.name == "longcat_flash", family.name
        points += [(loaded.router, family.patched_method)]
        points += [(loaded.experts, "forward")] if loaded.experts is not None else []
        points += [(layer, "__init__") for layer in loaded.decoder_layers]
        if family.merging_block:  # ERNIE-4.5-VL's block, which merges its routers' logits for the loss
            points.append((getattr(loaded.module, family.merging_block), "forward"))
        if "load_balancing_loss_func" in vars(loaded.module):  # families without a Switch loss have none
            points.append((loaded.module, "load_balancing_loss_func"))
    from transformers.distributed.mixin import DistributedMixin
    from transformers.modeling_utils import PreTrainedModel
    from transformers.trainer import Trainer

    points.append((PreTrainedModel, "post_init"))  # an uncovered MoE model is refused at build
    return points + _expert_parallel_points() + [
        # κ's stream: the Trainer's rng_state files, the re-seed, tensor-parallel tagging (hf.budget_rng)
        (Trainer, "_save_rng_state"), (Trainer, "_load_rng_state"), (torch, "manual_seed"),
        (torch.random, "manual_seed"), (DistributedMixin, "maybe_distribute_model")]


def _expert_parallel_points():
    """Where expert parallelism lives in the installed transformers: ``AllToAllEP``/``AllReduceEP``
    (5.23+), else the ``ep_dispatch_experts`` style's own dispatch (5.19-5.22, moved to
    ``expert_parallel`` in 5.22) and the masked plan's router hook."""
    import importlib

    try:
        expert_parallel = vars(importlib.import_module("transformers.distributed.expert_parallel"))
    except ImportError:
        expert_parallel = {}
    if "AllToAllEP" in expert_parallel:
        return [(expert_parallel["AllToAllEP"], "__call__"), (expert_parallel["AllReduceEP"], "__call__")]
    owner = expert_parallel if "EpDispatchExpertsParallel" in expert_parallel else vars(
        importlib.import_module("transformers.distributed.tensor_parallel"))
    dispatch, router = owner["EpDispatchExpertsParallel"], owner["EpRouterParallel"]
    return [(dispatch, "_dispatch_tokens"), (dispatch, "_combine_tokens"), (dispatch, "transform_inputs_pre_forward"),
            (router, "transform_output_post_forward")]


# ------------------------------------------------------------------------------- patch checklist
def test_apply_and_remove_restore_every_attribute_by_identity():
    points = _all_patch_points()
    originals = {(id(owner), name): owner.__dict__[name] for owner, name in points}
    hf.apply(ElasticConfig(schedule="1-3"))
    assert hf.is_applied()
    for owner, name in points:
        current = owner.__dict__[name]
        assert current is not originals[(id(owner), name)]
        assert getattr(current, PATCH_MARKER, False)
    # one loss function per module (Qwen3-Omni's thinker and talker share theirs)
    assert len(hf.patched_symbols()) == len({(id(owner), name) for owner, name in points})
    assert "transformers.models.olmoe.modeling_olmoe.OlmoeTopKRouter.forward" in hf.patched_symbols()
    hf.remove()
    assert not hf.is_applied() and hf.patched_symbols() == []
    for owner, name in points:
        assert owner.__dict__[name] is originals[(id(owner), name)]
    hf.remove()  # a second remove is a no-op


_DEFERRED_PROBE = r"""
import json, sys
from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core.patching import is_patched

name = "transformers.models.gpt_oss.modeling_gpt_oss"
hf.apply(ElasticConfig(schedule="1-3"))
report = {"imported_at_apply": name in sys.modules, "symbols_at_apply": len(hf.patched_symbols())}
import transformers.models.gpt_oss.modeling_gpt_oss as module  # a family other than OLMoE and Qwen3-MoE

stock = module.GptOssTopKRouter.forward.__wrapped__
report["patched_on_import"] = is_patched(vars(module.GptOssTopKRouter)["forward"])
report["symbols_after_import"] = len(hf.patched_symbols())
hf.remove()
report["restored"] = vars(module.GptOssTopKRouter)["forward"] is stock
hf.apply(ElasticConfig(schedule="1-3"))  # imported already: patched by apply itself
report["patched_by_apply"] = is_patched(vars(module.GptOssTopKRouter)["forward"])
hf.remove()
print(json.dumps(report))
"""


@pytest.mark.slow
def test_a_family_imported_after_apply_is_patched_then_and_restored_by_remove():
    """``apply`` patches OLMoE and Qwen3-MoE itself and every other family when its modeling module is
    imported, so a process imports only its model's family; ``remove`` restores those too. In a fresh
    process: this one has imported every family."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_MOE_") or k == hf.ALLOW_UNSUPPORTED_ENV}
    done = subprocess.run([sys.executable, "-c", _DEFERRED_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["imported_at_apply"] is False
    assert report["patched_on_import"] is True and report["restored"] is True and report["patched_by_apply"] is True
    assert report["symbols_after_import"] > report["symbols_at_apply"]


def test_apply_is_idempotent_replaces_and_patched_restores():
    router_cls = _family_objects("olmoe")[1].router
    original = router_cls.__dict__["forward"]
    first, second = ElasticConfig(schedule="1-3"), ElasticConfig(schedule="1-3", sigma=1.0)
    hf.apply(first)
    patched_forward = router_cls.__dict__["forward"]
    hf.apply(ElasticConfig(schedule="1-3"))  # equal config: nothing re-patched
    assert router_cls.__dict__["forward"] is patched_forward
    hf.apply(second)  # a different config replaces the first
    assert hf.active_config() == second
    assert router_cls.__dict__["forward"].__wrapped__ is original
    with hf.patched(ElasticConfig(schedule="static")):
        assert hf.active_config().schedule == "static"
    assert hf.active_config() == second
    hf.remove()
    with hf.patched(first):
        assert hf.is_applied()
    assert not hf.is_applied() and router_cls.__dict__["forward"] is original


@pytest.mark.parametrize("found", ["5.26.0", "4.57.1"])
def test_version_guard_names_range_and_override(monkeypatch, found):
    monkeypatch.setattr(hf_patch, "transformers_version", lambda: Version(found))
    monkeypatch.delenv(hf.ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(hf.UnsupportedTransformersError, match=rf"{found}.*>=5.0,<5.26.*{hf.ALLOW_UNSUPPORTED_ENV}=1"):
        hf.apply(ElasticConfig(schedule="1-3"))
    assert not hf.is_applied()
    monkeypatch.setenv(hf.ALLOW_UNSUPPORTED_ENV, "1")
    hf.apply(ElasticConfig(schedule="1-3"))
    assert hf.is_applied()


def test_apply_without_config_reads_the_environment(monkeypatch):
    monkeypatch.setenv("ELASTIC_MOE_SCHEDULE", "1-3")
    monkeypatch.setenv("ELASTIC_MOE_LAYERS", "1")
    hf.apply()
    assert hf.active_config() == ElasticConfig(schedule="1-3", layers="1")


def test_bad_config_fails_at_model_build_and_at_apply_with_model(tiny):
    hf.apply(ElasticConfig(schedule="1-9"))
    with pytest.raises(ConfigError, match=r"reaches budget 9, but the model has only 8 experts"):
        tiny.model("olmoe", num_experts_per_tok=5)
    hf.remove()
    prebuilt = tiny.model("olmoe", num_experts_per_tok=5)
    with pytest.raises(ConfigError, match=r"reaches budget 9, but the model has only 8 experts"):
        hf.apply(ElasticConfig(schedule="1-9"), model=prebuilt)
    assert not hf.is_applied()  # the rejected config did not stay active
    hf.apply(ElasticConfig(schedule="2-8"))
    with pytest.raises(ConfigError, match=r"reaches budget 9"):
        hf.apply(ElasticConfig(schedule="1-9"), model=prebuilt)
    assert hf.active_config() == ElasticConfig(schedule="2-8")
    hf.remove()
    hf.apply(ElasticConfig(schedule="1-3", layers="1-3"))
    with pytest.raises(ConfigError, match=r"layers='1-3' selects layer\(s\) \[2, 3\], but the model has 2"):
        tiny.model("olmoe")


@pytest.mark.parametrize("cap", [None, 5])
def test_top_p_mode_keeps_the_smallest_set_reaching_p(tiny, cap):
    """mode='top_p' (the paper's nucleus control): κ_t = min{j : Σ_{i≤j} p_(i) ≥ p}, capped."""
    hf.apply(ElasticConfig(mode="top_p", top_p=0.4, top_p_max_experts=cap))
    router = _router(tiny, topk=2, norm=False)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(11)) * 0.5
    _, weights, ids = router(x)
    record = latest_record(router)
    probs = torch.softmax(x @ router.weight.detach().T, dim=-1, dtype=torch.float32)
    order_probs, order = torch.sort(probs, dim=-1, descending=True)
    width = cap or 8
    assert ids.shape == (256, width)
    expected = []
    for row in order_probs.tolist():  # a readable loop reference
        total, count = 0.0, 0
        while count < width and total < 0.4:
            total += row[count]
            count += 1
        expected.append(count)
    assert record.budgets.tolist() == expected
    assert len(set(expected)) > 1  # budgets really vary per token
    kept = torch.arange(width) < record.budgets[:, None]
    torch.testing.assert_close(weights.detach(), torch.where(kept, order_probs[:, :width], 0.0), rtol=1e-6, atol=1e-7)
    router.eval()
    assert router(x)[2].shape == (256, 2)  # inference stays static top-k
    hf.remove()
    with pytest.raises(ConfigError, match=r"top_p_max_experts=9 exceeds the model's 8 experts"):
        hf.apply(ElasticConfig(mode="top_p", top_p_max_experts=9), model=tiny.model("olmoe"))


# ------------------------------------------------------------------------------- bitwise stock
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family,norm", [("olmoe", False), ("qwen3_moe", True)])
@pytest.mark.parametrize("masked", [False, True])
def test_static_schedule_is_bitwise_stock(tiny, family, norm, masked, impl):
    inputs = dict(tiny.inputs(family), **({"attention_mask": _padding_mask()} if masked else {}))
    stock = _step(tiny.model(family, experts_implementation=impl, norm_topk_prob=norm), inputs)
    hf.apply(ElasticConfig(schedule="static"))
    patched = _step(tiny.model(family, experts_implementation=impl, norm_topk_prob=norm), inputs)
    _assert_bitwise(stock, patched)
    assert stock["aux_loss"] > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_disabled_config_is_bitwise_stock(tiny, impl):
    inputs = tiny.inputs("qwen3_moe")
    stock = _step(tiny.model("qwen3_moe", experts_implementation=impl), inputs)
    hf.apply(ElasticConfig(schedule="1-3", enabled=False))
    _assert_bitwise(stock, _step(tiny.model("qwen3_moe", experts_implementation=impl), inputs))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family,norm", [("olmoe", False), ("qwen3_moe", True)])
def test_eval_mode_is_static_and_bitwise_stock(tiny, family, norm, impl):
    inputs = dict(tiny.inputs(family), attention_mask=_padding_mask())
    stock_model = tiny.model(family, experts_implementation=impl, norm_topk_prob=norm).eval()
    with torch.no_grad():
        stock = stock_model(**inputs, output_router_logits=True)
    hf.apply(ElasticConfig(schedule="1-3"))
    model = tiny.model(family, experts_implementation=impl, norm_topk_prob=norm).eval()
    with torch.no_grad():
        ours = model(**inputs, output_router_logits=True)
    for name in ("logits", "loss", "aux_loss"):
        assert torch.equal(getattr(stock, name), getattr(ours, name)), name
    assert hf.routing_records(model) == {}
    # and the patch does route elastically once the same model trains
    model.train()
    model(**inputs)
    assert set(hf.routing_records(model)) == {0, 1}


@pytest.mark.parametrize("impl", IMPLS)
def test_static_layer_of_an_elastic_model_is_bitwise_stock(tiny, impl):
    """layers="1": layer 0 routes static top-k and its experts run the stock forward, so its block
    output equals unpatched transformers' bit for bit (its input does too: it comes first)."""
    inputs = tiny.inputs("olmoe")

    def layer0_output(model):
        captured = {}
        handle = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: captured.setdefault("y", out))
        torch.manual_seed(3)
        model(**inputs)
        handle.remove()
        return captured["y"].detach()

    stock = layer0_output(tiny.model("olmoe", experts_implementation=impl))
    hf.apply(ElasticConfig(schedule="1-3", layers="1"))
    model = tiny.model("olmoe", experts_implementation=impl)
    assert torch.equal(layer0_output(model), stock)
    assert list(hf.routing_records(model)) == [1]


# ------------------------------------------------------------------------------- selection
def _router(tiny, *, topk=K, norm=False):
    model = tiny.model("olmoe", num_experts_per_tok=topk, norm_topk_prob=norm)
    router = model.model.layers[0].mlp.gate
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))  # well-separated logits
    return router


def test_budgets_follow_the_schedule_pmf(tiny):
    scipy_stats = pytest.importorskip("scipy.stats")
    hf.apply(ElasticConfig(schedule="2-6"))
    router = _router(tiny, topk=4)
    schedule = BudgetSchedule.parse("2-6", center=4)
    x = torch.randn(20000, 64, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(5)
    with torch.no_grad():
        _, weights, ids = router(x)
    budgets = latest_record(router).budgets
    # what is dispatched with a non-zero weight is exactly κ_t experts per token
    assert torch.equal((weights > 0).sum(-1), budgets)
    assert weights.shape == ids.shape == (20000, 6)
    observed = torch.bincount(budgets, minlength=7)[2:].double()
    expected = torch.tensor(schedule.pmf, dtype=torch.float64) * budgets.numel()
    assert observed.sum() == budgets.numel()
    result = scipy_stats.chisquare(observed.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (observed, expected)
    assert abs(budgets.double().mean().item() - 4.0) < 0.03


@pytest.mark.parametrize("norm", [False, True], ids=["full_softmax", "renormalized"])
def test_kept_experts_are_top_kappa_and_weights_match_reference(tiny, norm):
    hf.apply(ElasticConfig(schedule="2-6"))
    router = _router(tiny, topk=4, norm=norm)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(8)
    logits, weights, ids = router(x)
    record = latest_record(router)
    kappa = record.budgets
    # reference: sort the fp32 full softmax by hand
    probs = torch.softmax(x @ router.weight.detach().T, dim=-1, dtype=torch.float32)
    order_probs, order = torch.sort(probs, dim=-1, descending=True)
    order_probs, order = order_probs[:, :6], order[:, :6]
    kept = torch.arange(6) < kappa[:, None]
    assert torch.equal(ids, order)  # beyond κ: the real rank-j candidate, not a sentinel
    assert torch.equal(record.expert_ids, torch.where(kept, order, -1))
    reference = torch.where(kept, order_probs, 0.0)
    if norm:
        reference = reference / reference.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.detach(), reference, rtol=1e-6, atol=1e-7)
    assert torch.all(weights.detach()[~kept] == 0.0)  # exactly 0, not merely small
    torch.testing.assert_close(record.retained_weight_sums, reference.sum(-1), rtol=1e-6, atol=1e-7)
    assert weights.dtype == logits.dtype == torch.float32


def test_renormalized_single_expert_tokens_get_weight_one_and_no_gate_gradient(tiny):
    """docs/gates.md#gate-conventions: κ = 1 under a renormalised gate gives w = 1 exactly and no router gradient."""
    hf.apply(ElasticConfig(schedule="1-3"))
    router = _router(tiny, topk=2, norm=True)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(9))
    torch.manual_seed(10)
    _, weights, _ = router(x)
    single = latest_record(router).budgets == 1
    assert single.any() and torch.all(weights[single, 0] == 1.0)
    router.zero_grad()
    (weights[single] * torch.randn(weights[single].shape)).sum().backward()
    assert torch.all(router.weight.grad == 0.0)


@pytest.mark.parametrize("gate,expect_sum_one", [("renormalized", True), ("full_softmax", False)])
def test_gate_setting_overrides_the_model_convention(tiny, gate, expect_sum_one):
    hf.apply(ElasticConfig(schedule="1-3", gate=gate))
    router = _router(tiny, norm=not expect_sum_one)  # the model's own flag says the opposite
    torch.manual_seed(0)
    _, weights, _ = router(torch.randn(64, 64))
    sums = weights.detach().sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == expect_sum_one


# ------------------------------------------------------------------------------- dense reference
def _dense_reference(block, x, budgets, renormalize):
    """Σ_{j<κ_t} w_tj · expert_{e_tj}(x_t), one token and one expert at a time."""
    experts, router = block.experts, block.gate
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(tokens @ router.weight.T, dim=-1, dtype=torch.float32)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        top = torch.sort(probs[t], descending=True)
        chosen, chosen_probs = top.indices[: budgets[t]], top.values[: budgets[t]]
        gates = chosen_probs / chosen_probs.sum() if renormalize else chosen_probs
        for expert, gate in zip(chosen.tolist(), gates):
            gate_proj, up_proj = torch.nn.functional.linear(tokens[t], experts.gate_up_proj[expert]).chunk(2)
            hidden = torch.nn.functional.silu(gate_proj) * up_proj
            out[t] += gate * torch.nn.functional.linear(hidden, experts.down_proj[expert])
    return out.reshape(x.shape)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("norm", [False, True], ids=["full_softmax", "renormalized"])
def test_moe_block_equals_dense_reference_for_every_experts_implementation(tiny, impl, norm):
    hf.apply(ElasticConfig(schedule="1-3"))
    model = tiny.model("olmoe", experts_implementation=impl, norm_topk_prob=norm)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(11), requires_grad=True)
    torch.manual_seed(12)
    budget_rng.reset()
    y = block(x)
    budgets = latest_record(block.gate).budgets
    # κ is draw 0 of its own stream, seeded with BUDGET_SEED_OFFSET + torch.initial_seed(), on shard 0
    expected = BudgetStream(BUDGET_SEED_OFFSET + 12).draw(BudgetSchedule.parse("1-3", center=2), "iid", 0, 16)[0]
    assert torch.equal(budgets, expected.budgets)
    assert set(budgets.tolist()) == {1, 2, 3}
    with torch.no_grad():
        reference = _dense_reference(block, x, budgets, norm)
    torch.testing.assert_close(y.detach(), reference, rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and block.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_router_returns_real_candidates_and_marks_the_kept_slots(tiny, impl):
    """Whatever the experts implementation, the router returns the real rank-j candidate in every
    slot (weight exactly 0 beyond κ) and marks its index tensor with κ on the host (the kept mask,
    Σκ); the experts decide what to skip (tests/hf/test_hf_experts.py)."""
    from elastic_moe_plugin.hf import experts as hf_experts

    hf.apply(ElasticConfig(schedule="1-3"))
    model = tiny.model("olmoe", experts_implementation=impl)
    router = model.model.layers[0].mlp.gate
    torch.manual_seed(14)
    _, weights, ids = router(torch.randn(64, 64, generator=torch.Generator().manual_seed(15)))
    kept = torch.arange(3) < latest_record(router).budgets[:, None]
    assert (~kept).any()
    assert torch.equal(ids[kept], latest_record(router).expert_ids[kept])
    assert torch.all((ids >= 0) & (ids < E)) and torch.all(ids.sort(-1).values.diff(dim=-1) != 0)
    assert torch.all(weights[~kept] == 0.0)
    mark = hf_experts.kept_slots(ids)
    assert mark is not None and torch.equal(torch.arange(3) < torch.from_numpy(mark.host_budgets)[:, None], kept)
    assert mark.total == int(kept.sum())
    assert hf_experts.kept_slots(ids.clone()) is None  # a rebuilt tensor is unmarked: stock compute


# ------------------------------------------------------------------------------- aux loss
@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_counts_the_realised_assignments(tiny, hand_aux, masked):
    mask = _padding_mask() if masked else None
    hf.apply(ElasticConfig(schedule="1-3"))
    model = tiny.model("qwen3_moe", norm_topk_prob=True)
    inputs = dict(tiny.inputs("qwen3_moe"), **({"attention_mask": mask} if masked else {}))
    torch.manual_seed(13)
    out = model(**inputs, output_router_logits=True)
    records = hf.routing_records(model)
    assert set(records) == {0, 1}
    expected = hand_aux(out.router_logits, [records[i].expert_ids for i in (0, 1)], E, mask)
    torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-6, atol=0)
    # stock would recount a static top-2 from the logits: a different number here
    modeling = __import__("transformers.models.qwen3_moe.modeling_qwen3_moe", fromlist=["x"])
    stock = modeling.load_balancing_loss_func.__wrapped__(out.router_logits, E, K, mask)
    static_ids = [torch.topk(z, K, dim=-1).indices for z in out.router_logits]
    torch.testing.assert_close(stock.double(), hand_aux(out.router_logits, static_ids, E, mask), rtol=1e-6, atol=0)
    assert not torch.allclose(stock, out.aux_loss)
    # the total loss carries it with the model's coefficient, and the aux loss reaches the router
    out.loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_aux_loss_uses_stock_counts_for_static_layers(tiny, hand_aux):
    hf.apply(ElasticConfig(schedule="1-3", layers="1"))
    model = tiny.model("olmoe")
    torch.manual_seed(14)
    out = model(**tiny.inputs("olmoe"), output_router_logits=True)
    records = hf.routing_records(model)
    assert set(records) == {1}  # layer 0 ran the stock router
    layer0_ids = torch.topk(torch.softmax(out.router_logits[0], dim=-1), K, dim=-1).indices
    expected = hand_aux(out.router_logits, [layer0_ids, records[1].expert_ids], E)
    torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-6, atol=0)


def test_balanced_sampling_dispatches_exactly_t_times_k(tiny, hand_aux):
    """sampling='balanced': Σκ = T·k per router call, so transformers' c_e / N sums to k as in stock."""
    hf.apply(ElasticConfig(schedule="1-3", sampling="balanced"))
    model = tiny.model("olmoe")
    torch.manual_seed(17)
    out = model(**tiny.inputs("olmoe"), output_router_logits=True)
    records = hf.routing_records(model)
    for record in records.values():
        assert int(record.budgets.sum()) == 16 * K and len(set(record.budgets.tolist())) > 1
    expected = hand_aux(out.router_logits, [records[i].expert_ids for i in (0, 1)], E)
    torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-6, atol=0)


def test_balanced_sampling_needs_a_symmetric_schedule(tiny):
    hf.apply(ElasticConfig(schedule="1-4", allow_off_center=True, sampling="balanced"))
    with pytest.raises(ConfigError, match=r"sampling='balanced' needs a schedule symmetric .* top-2"):
        tiny.model("olmoe")


# ------------------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_replays_budgets(tiny, reentrant):
    hf.apply(ElasticConfig(schedule="1-3"))
    inputs = dict(tiny.inputs("olmoe"), attention_mask=_padding_mask())
    # Reentrant checkpointing runs the first forward without grad, so the router logits that
    # transformers records carry no graph and the aux loss sends no gradient: stock behaviour,
    # unrelated to the plugin. Compare that mode without the aux term.
    coef = {"router_aux_loss_coef": 0.0} if reentrant else {}
    plain = tiny.model("olmoe", **coef)
    checkpointed = tiny.model("olmoe", **coef)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    a = _step(plain, inputs, seed=15)
    b = _step(checkpointed, inputs, seed=15)
    for name in a["grads"]:
        torch.testing.assert_close(b["grads"][name], a["grads"][name], rtol=0, atol=1e-7, msg=name)
    torch.testing.assert_close(b["loss"], a["loss"], rtol=0, atol=0)
    records_a, records_b = hf.routing_records(plain), hf.routing_records(checkpointed)
    for layer in (0, 1):
        assert torch.equal(records_a[layer].budgets, records_b[layer].budgets)
        # the recompute in backward does not count the step twice
        assert int(hf.budget_histograms(checkpointed)[layer].sum()) == 16
    assert len(set(records_a[0].budgets.tolist())) > 1


# ------------------------------------------------------------------------------- layers and records
def test_layer_selection_and_records_are_keyed_by_layer_index(tiny):
    hf.apply(ElasticConfig(schedule="1-3", layers="1"))
    model = tiny.model("olmoe")
    gates = [layer.mlp.gate for layer in model.model.layers]
    assert [state_of(gate).layer_index for gate in gates] == [0, 1]
    torch.manual_seed(16)
    model(**tiny.inputs("olmoe"))
    records = hf.routing_records(model)
    assert list(records) == [1]
    record = records[1]
    assert record.budgets.shape == (16,) and record.expert_ids.shape == (16, 3)
    assert torch.equal((record.expert_ids >= 0).sum(-1), record.budgets)
    histograms = hf.budget_histograms(model)
    assert list(histograms) == [1] and histograms[1].shape == (4,) and int(histograms[1].sum()) == 16
    metrics = hf.routing_metrics(model)
    assert metrics["elastic_moe/layer_1/mean_kappa"] == pytest.approx(record.budgets.double().mean().item())
    # layer 0 routes stock top-2: logged at κ = k, with nothing measured beyond that
    assert metrics["elastic_moe/layer_0/mean_kappa"] == 2.0 and metrics["elastic_moe/layer_0/kappa_frac_2"] == 1.0
    assert "elastic_moe/layer_0/retained_weight_sum_mean" not in metrics
    assert hf.routing_metrics(tiny.model("olmoe")) == {}  # nothing routed yet
    hf.reset_budget_histograms(model)
    assert int(hf.budget_histograms(model)[1].sum()) == 0


def test_model_built_before_apply_is_covered_and_tagged_on_request(tiny):
    model = tiny.model("olmoe")  # built unpatched: no layer tags
    inputs = tiny.inputs("olmoe")
    hf.apply(ElasticConfig(schedule="1-3"))
    model(**inputs)  # class-level patch: routes elastically without tags when every layer is elastic
    assert set(hf.routing_records(model)) == {0, 1}
    config = ElasticConfig(schedule="1-3", layers="1")
    hf.apply(config)
    with pytest.raises(ConfigError, match=r"hf.apply\(config, model=model\) or hf.tag_layers\(model\)"):
        model(**inputs)
    hf.apply(config, model=model)
    assert hf.tag_layers(model) == {"model.layers.0.mlp.gate": 0, "model.layers.1.mlp.gate": 1}
    for layer in model.model.layers:
        state_of(layer.mlp.gate).routed = None  # forget the records of the forward before
    model(**inputs)
    assert list(hf.routing_records(model)) == [1]


def test_tag_layers_rejects_a_model_without_covered_routers():
    with pytest.raises(ValueError, match="contains no covered MoE router"):
        hf.tag_layers(torch.nn.Linear(2, 2))
