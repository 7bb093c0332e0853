"""Expert compute follows κ in every experts implementation (``elastic_moe_plugin.hf.experts``), on CPU.

The rows each implementation multiplies are read from the GEMMs that really run
(``experts_support.ExpertRows``: the rows of eager's per-expert ``mm``, batched_mm's ``bmm`` batch,
grouped_mm's last offset) and compared with Σκ from the routing records; outputs and gradients
of grouped_mm and batched_mm are compared with transformers' eager loop on the same κ; the
uninitialised tail of the grouped GEMM is filled with NaN on purpose.
"""

from __future__ import annotations

import collections
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from transformers.integrations import moe  # noqa: E402

from elastic_moe_plugin import ElasticConfig, hf  # noqa: E402
from elastic_moe_plugin.hf import experts as hf_experts  # noqa: E402
from elastic_moe_plugin.hf import budget_rng  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_clean")]

IMPLS = ("eager", "grouped_mm", "batched_mm")
BATCH, SEQ, HIDDEN = 2, 8, 64  # the tiny models of conftest.py
TOKENS, K, WIDTH = BATCH * SEQ, 2, 3  # schedule 1-3 around top-2: b = 3 slots per token
SCHEDULE = "1-3"
# fp32, same κ, different summation orders (grouped GEMM per expert vs eager's per-expert loop and
# index_add; batched per-row GEMMs and a slot sum): agreement to a few ulps of the values involved.
FP32 = {"rtol": 1e-5, "atol": 1e-6}


def _embeds(seed: int = 1) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _train_step(model, seed: int = 7, checkpointed: bool = False):
    """One forward + backward from input embeddings (so the hidden-state gradient is visible)."""
    model.zero_grad(set_to_none=True)
    embeds = _embeds().requires_grad_()
    labels = torch.randint(3, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(seed)
    budget_rng.reset()  # κ's own stream seeds afresh from `seed`: two models of a comparison draw alike
    out = model(inputs_embeds=embeds, labels=labels, output_router_logits=True, use_cache=False)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "aux_loss": out.aux_loss.detach(),
            "hidden_grad": embeds.grad.clone(), "grads": grads}


def _kappa_sums(model) -> dict[str, int]:
    """Σκ of each layer's latest elastic forward, keyed like ExpertRows (the experts module name)."""
    return {f"model.layers.{layer}.mlp.experts": int(record.budgets.sum())
            for layer, record in hf.routing_records(model).items()}


# ------------------------------------------------------------------------------- rows = Σκ
@pytest.mark.parametrize("sampling", ["iid", "balanced"])
@pytest.mark.parametrize("impl", IMPLS)
def test_rows_multiplied_equal_sum_of_budgets_in_every_implementation(tiny, expert_rows, impl, sampling):
    stock_model = tiny.model("olmoe", experts_implementation=impl)
    with expert_rows(stock_model) as stock:
        stock_model(**tiny.inputs("olmoe"))
    assert set(stock.rows.values()) == {TOKENS * K}

    hf.apply(ElasticConfig(schedule=SCHEDULE, sampling=sampling))
    model = tiny.model("olmoe", experts_implementation=impl)
    torch.manual_seed(3)
    with expert_rows(model) as counted:
        model(**tiny.inputs("olmoe"))
    kappa_sums = _kappa_sums(model)
    assert counted.rows == kappa_sums
    # b slots per token were handed over; only the kept ones were multiplied
    assert all(rows < TOKENS * WIDTH for rows in counted.rows.values())
    if sampling == "balanced":
        assert set(counted.rows.values()) == {TOKENS * K}


def test_every_grouped_gemm_stops_at_sum_of_budgets_forward_and_backward(tiny, expert_rows):
    """Both expert GEMMs and both of their gradient GEMMs see offsets[-1] = Σκ, never T·b."""
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    model = tiny.model("olmoe", experts_implementation="grouped_mm")
    with expert_rows(model) as counted:
        _train_step(model)
    kappa_sums = sorted(_kappa_sums(model).values())
    assert kappa_sums[0] < TOKENS * WIDTH
    per_layer = collections.Counter(counted.grouped_offsets)
    # forward: gate_up and down; backward: the input and the weight gradient of each
    assert per_layer == collections.Counter({kappa_sums[0]: 6, kappa_sums[1]: 6}) or (
        kappa_sums[0] == kappa_sums[1] and per_layer == collections.Counter({kappa_sums[0]: 12}))


# ------------------------------------------------------------------------------- NaN tail
class _NanTail(torch.autograd.Function):
    """transformers' grouped GEMM, with every row at or past offsets[-1] set to NaN in its output
    and in its input gradient: the worst the uninitialised tail can hold."""

    @staticmethod
    def forward(ctx, input, weight, offs, grouped_mm):
        ctx.save_for_backward(input, weight, offs)
        ctx.grouped_mm = grouped_mm
        out = grouped_mm(input, weight, offs).clone()
        out[int(offs[-1]):] = float("nan")
        return out

    @staticmethod
    def backward(ctx, grad_out):
        input, weight, offs = ctx.saved_tensors
        with torch.enable_grad():
            x, w = input.detach().requires_grad_(), weight.detach().requires_grad_()
            grad_input, grad_weight = torch.autograd.grad(ctx.grouped_mm(x, w, offs), (x, w), grad_out)
        grad_input = grad_input.clone()
        grad_input[int(offs[-1]):] = float("nan")
        return grad_input, grad_weight, None, None


@pytest.fixture
def nan_tail(monkeypatch):
    """transformers' ``_grouped_mm`` (looked up at call time by ``_grouped_linear``) with a NaN tail."""
    stock = moe._grouped_mm
    monkeypatch.setattr(moe, "_grouped_mm", lambda input, weight, offs: _NanTail.apply(input, weight, offs, stock))


@pytest.mark.parametrize("norm", [False, True], ids=["full_softmax", "renormalized"])
def test_nan_in_the_grouped_gemm_tail_never_reaches_outputs_or_gradients(tiny, nan_tail, norm):
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    eager = _train_step(tiny.model("olmoe", experts_implementation="eager", norm_topk_prob=norm))
    grouped = _train_step(tiny.model("olmoe", experts_implementation="grouped_mm", norm_topk_prob=norm))
    for name in ("logits", "loss", "aux_loss", "hidden_grad"):
        assert torch.isfinite(grouped[name]).all(), name
        torch.testing.assert_close(grouped[name], eager[name], **FP32, msg=name)
    assert grouped["grads"].keys() == eager["grads"].keys()
    for name, grad in grouped["grads"].items():
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, eager["grads"][name], **FP32, msg=name)


def test_the_nan_tail_is_real_without_the_sentinel_masks(tiny, nan_tail):
    """Control for the test above: the same sentinel ids through transformers' grouped_mm without
    its expert-parallel masks let the tail's NaN into the output."""
    experts = tiny.model("olmoe", experts_implementation="grouped_mm").model.layers[0].mlp.experts
    ids = torch.tensor([[0, 8], [1, 8]])  # 8 = num_experts: the sentinel
    weights = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert not experts._is_expert_parallel
    out = moe.grouped_mm_experts_forward(experts, torch.randn(2, HIDDEN), ids, weights)
    assert torch.isnan(out).any()


# ------------------------------------------------------------------------------- gradients = eager
@pytest.mark.parametrize("sampling", ["iid", "balanced"])
@pytest.mark.parametrize("norm", [False, True], ids=["full_softmax", "renormalized"])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_outputs_and_gradients_match_the_eager_loop_on_the_same_budgets(tiny, impl, norm, sampling):
    hf.apply(ElasticConfig(schedule=SCHEDULE, sampling=sampling))
    eager_model = tiny.model("olmoe", experts_implementation="eager", norm_topk_prob=norm)
    eager = _train_step(eager_model)
    model = tiny.model("olmoe", experts_implementation=impl, norm_topk_prob=norm)
    ours = _train_step(model)
    for layer, record in hf.routing_records(model).items():  # the same κ, drawn from the same seed
        assert torch.equal(record.budgets, hf.routing_records(eager_model)[layer].budgets)
    for name in ("logits", "loss", "aux_loss", "hidden_grad"):
        torch.testing.assert_close(ours[name], eager[name], **FP32, msg=name)
    assert ours["grads"].keys() == eager["grads"].keys()
    for name, grad in ours["grads"].items():
        torch.testing.assert_close(grad, eager["grads"][name], **FP32, msg=name)
    router_grad = ours["grads"]["model.layers.0.mlp.gate.weight"]
    assert router_grad.abs().sum() > 0


# ------------------------------------------------------------------------------- host syncs
class _Syncs(TorchDispatchMode):
    """Counts the ops that force a device-to-host sync: ``.item()``-like reads and ``nonzero``."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero"):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl,sampling,added", [
    ("grouped_mm", "iid", 0), ("grouped_mm", "balanced", 0),
    ("batched_mm", "iid", 1), ("batched_mm", "balanced", 0),  # iid reads P = Σκ once per layer
])
def test_syncs_added_per_layer(tiny, impl, sampling, added):
    stock_model = tiny.model("olmoe", experts_implementation=impl)
    with _Syncs() as stock, torch.no_grad():
        stock_model(**tiny.inputs("olmoe"))
    hf.apply(ElasticConfig(schedule=SCHEDULE, sampling=sampling))
    model = tiny.model("olmoe", experts_implementation=impl)
    with _Syncs() as elastic, torch.no_grad():
        model(**tiny.inputs("olmoe"))
    assert elastic.count - stock.count == added * len(model.model.layers)


# ------------------------------------------------------------------------------- whoever chooses, whenever
@pytest.mark.parametrize("impl", IMPLS)
def test_model_built_before_apply_follows_kappa(tiny, expert_rows, impl):
    """hf.apply after the model was built (issue #16): the experts decide what to skip from the
    router's mark, so no link between router and experts is needed."""
    model = tiny.model("olmoe", experts_implementation=impl)
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    torch.manual_seed(4)
    with expert_rows(model) as counted:
        model(**tiny.inputs("olmoe"))
    assert counted.rows == _kappa_sums(model)


@pytest.mark.parametrize("impl", IMPLS)
def test_implementation_set_after_build_is_followed(tiny, expert_rows, impl):
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    model = tiny.model("olmoe", experts_implementation="grouped_mm" if impl != "grouped_mm" else "eager")
    model.set_experts_implementation(impl)
    assert model.model.layers[0].mlp.experts.config._experts_implementation == impl
    torch.manual_seed(5)
    with expert_rows(model) as counted:
        model(**tiny.inputs("olmoe"))
    assert counted.rows == _kappa_sums(model)


@pytest.mark.parametrize("impl", IMPLS)
def test_implementation_chosen_at_load_is_followed(tiny, expert_rows, tmp_path, impl):
    tiny.model("olmoe").save_pretrained(tmp_path)
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=impl).train()
    assert model.config._experts_implementation == impl
    torch.manual_seed(6)
    with expert_rows(model) as counted:
        model(**tiny.inputs("olmoe"))
    assert counted.rows == _kappa_sums(model)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_checkpointing_recomputes_the_same_rows(tiny, expert_rows, impl, reentrant):
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    plain = _train_step(tiny.model("olmoe", experts_implementation=impl, router_aux_loss_coef=0.0))
    model = tiny.model("olmoe", experts_implementation=impl, router_aux_loss_coef=0.0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with expert_rows(model) as counted:
        checkpointed = _train_step(model)
    # each layer's forward ran twice (first pass and recompute) on the same κ: 2·Σκ rows
    assert counted.rows == {name: 2 * total for name, total in _kappa_sums(model).items()}
    torch.testing.assert_close(checkpointed["loss"], plain["loss"], rtol=0, atol=0)
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(checkpointed["grads"][name], grad, rtol=0, atol=1e-7, msg=name)


def test_an_unknown_implementation_computes_every_slot_correctly_and_says_so(tiny, expert_rows, caplog):
    """A library's own experts implementation may not honour the sentinel: it gets every slot
    (zero weights beyond κ), so the output is still top-κ routing, at b/k of the compute."""
    moe.ALL_EXPERTS_FUNCTIONS["library_grouped_mm"] = lambda *args: moe.grouped_mm_experts_forward(*args)
    try:
        hf.apply(ElasticConfig(schedule=SCHEDULE))
        reference = _train_step(tiny.model("olmoe", experts_implementation="eager"))
        model = tiny.model("olmoe", experts_implementation="grouped_mm")
        model.config._experts_implementation = "library_grouped_mm"
        with caplog.at_level(logging.WARNING, logger="elastic_moe_plugin.hf"), expert_rows(model) as counted:
            ours = _train_step(model)
    finally:
        del moe.ALL_EXPERTS_FUNCTIONS["library_grouped_mm"]
        hf_experts._warned_implementations.discard("library_grouped_mm")
    assert set(counted.rows.values()) == {TOKENS * WIDTH}
    assert sum("'library_grouped_mm'" in record.getMessage() for record in caplog.records) == 1
    torch.testing.assert_close(ours["logits"], reference["logits"], **FP32)
    torch.testing.assert_close(ours["hidden_grad"], reference["hidden_grad"], **FP32)


def test_a_standalone_block_without_an_implementation_runs_the_eager_loop_on_kappa(expert_rows, caplog):
    """A block built outside a model has ``config._experts_implementation = None``; transformers
    then runs the eager loop, and so does the elastic path (no fallback, no warning)."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock

    config = OlmoeConfig(hidden_size=HIDDEN, intermediate_size=32, num_experts=8, num_experts_per_tok=K)
    assert config._experts_implementation is None
    torch.manual_seed(0)
    block = OlmoeSparseMoeBlock(config).train()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.1)
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    with caplog.at_level(logging.WARNING, logger="elastic_moe_plugin.hf"), expert_rows(block) as counted:
        block(_embeds())
    assert counted.rows == {"experts": int(block.gate._elastic_record.budgets.sum())}
    assert not [record for record in caplog.records if "experts implementation" in record.getMessage()]
