"""Expert compute follows κ in every experts implementation (``elastic_moe_plugin.hf.experts``), on CPU.

The rows each implementation multiplies are read from the GEMMs that really run
(``counters.ExpertRows``: the rows of eager's per-expert ``mm``, batched_mm's ``bmm`` batch,
grouped_mm's last offset) and compared with Σκ from the routing records; outputs and gradients
of grouped_mm and batched_mm are compared with transformers' eager loop on the same κ; the
uninitialised tail of the grouped GEMM is filled with NaN on purpose.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.integrations import moe  # noqa: E402

from elastic_moe_plugin import ElasticConfig, hf  # noqa: E402
from elastic_moe_plugin.hf import experts as hf_experts  # noqa: E402
from elastic_moe_plugin.hf import budget_rng  # noqa: E402
from elastic_moe_plugin.core.records import latest_record
from counters import OpCounter, gemm_rows, host_syncs

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


@pytest.mark.parametrize("impl", IMPLS)
def test_a_call_that_keeps_every_slot_is_bitwise_stock(tiny, impl):
    """κ_t = b for every token (P = T·b, what a point mass at b dispatches): the marked call runs the
    stock forward, so its output and gradients equal the unmarked call's bit for bit (the per-token
    index_add would add the pairs in another order than stock's slot sum). One slot fewer and the
    call is compacted (and checked to agree to fp32 rounding, not bitwise)."""
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    experts = tiny.model("olmoe", experts_implementation=impl).model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator)
    ids = torch.stack([torch.randperm(8, generator=generator)[:WIDTH] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, WIDTH, generator=generator)

    def call(budgets):
        experts.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        index = ids.clone()
        if budgets is not None:
            hf_experts.mark_kept_slots(index, budgets)
        kept = weights if budgets is None else weights * (torch.arange(WIDTH) < torch.as_tensor(budgets)[:, None])
        out = experts(x, index, kept)
        out.square().sum().backward()
        return out.detach(), x.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()

    stock = call(None)
    every_slot = call([WIDTH] * TOKENS)
    assert all(torch.equal(a, b) for a, b in zip(stock, every_slot))
    one_fewer = [WIDTH] * (TOKENS - 1) + [WIDTH - 1]
    compacted = call(one_fewer)
    experts.zero_grad(set_to_none=True)
    dropped = weights * (torch.arange(WIDTH) < torch.tensor(one_fewer)[:, None])
    x = hidden.clone().requires_grad_()
    out = experts(x, ids.clone(), dropped)  # unmarked: all slots, the dropped one at weight 0
    out.square().sum().backward()
    for a, b in zip(compacted, (out.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad)):
        torch.testing.assert_close(a, b, **FP32)


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


def test_grouped_gemm_without_the_expert_parallel_flag_of_older_transformers_equals_eager(tiny):
    """transformers 5.17's experts have no ``_is_expert_parallel`` (seen on a GPU run of 5.17, where the
    grouped-GEMM path raised AttributeError): without it the masked path runs, equal to eager."""
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    eager = _train_step(tiny.model("olmoe", experts_implementation="eager"))
    model = tiny.model("olmoe", experts_implementation="grouped_mm")
    for layer in model.model.layers:
        assert layer.mlp.experts.__dict__.pop("_is_expert_parallel") is False  # an instance flag from 5.19 on
    ours = _train_step(model)
    for name in ("logits", "loss", "hidden_grad"):
        torch.testing.assert_close(ours[name], eager[name], **FP32, msg=name)
    for name, grad in ours["grads"].items():
        torch.testing.assert_close(grad, eager["grads"][name], **FP32, msg=name)


# ------------------------------------------------------------------------------- host syncs
def _eager_loop_syncs(expert_ids_per_layer) -> int:
    """The syncs of transformers' eager experts loop (5.19) over layers that hit h experts each:
    3 + 5·h per layer. Per layer: ``one_hot``'s two range checks (``.item()`` of its min and max)
    and the ``nonzero`` of the hit experts; per hit expert: the ``expert_idx == num_experts`` test,
    three indexings by the 0-d ``expert_idx`` (the mask, ``gate_up_proj``, ``down_proj``) and the
    ``torch.where`` of its slots (``nonzero``)."""
    return sum(3 + 5 * len(set(ids.reshape(-1).tolist())) for ids in expert_ids_per_layer)


@pytest.mark.parametrize("sampling", ["iid", "balanced"])
@pytest.mark.parametrize("impl", IMPLS)
def test_no_syncs_added_per_layer(tiny, impl, sampling):
    """Σκ is a host int (κ is drawn on the host), so no implementation reads it from the device.
    eager's own loop syncs per layer and per expert it hits, stock and elastic alike: both counts are checked against that closed form, from the experts each run really hit.
    (Before κ was drawn on the host, batched_mm under iid sampling read Σκ once per layer.)"""
    stock_model = tiny.model("olmoe", experts_implementation=impl)
    stock_ids = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda module, args: stock_ids.append(args[1].detach()))
             for layer in stock_model.model.layers]
    with host_syncs() as stock, torch.no_grad():
        stock_model(**tiny.inputs("olmoe"))
    for hook in hooks:
        hook.remove()
    hf.apply(ElasticConfig(schedule=SCHEDULE, sampling=sampling))
    model = tiny.model("olmoe", experts_implementation=impl)
    with host_syncs() as elastic, torch.no_grad():
        model(**tiny.inputs("olmoe"))
    # Outside the experts the model syncs once per forward (the causal mask's packed-sequence test).
    stock_loop = _eager_loop_syncs(stock_ids) if impl == "eager" else 0
    assert stock.count - stock_loop == 1
    if impl == "eager":
        kept_ids = [record.expert_ids[record.expert_ids >= 0] for record in hf.routing_records(model).values()]
        assert len(kept_ids) == len(model.model.layers)
        assert elastic.count == 1 + _eager_loop_syncs(kept_ids)
    else:
        assert elastic.count == stock.count == 1


# ------------------------------------------------------------------------------- rows and slots = Σκ
VIEWS = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze",
         "select", "slice", "split", "split_with_sizes", "chunk", "as_strided", "alias", "detach", "unbind"}


class _ActivationRows:
    """What one experts block does, op by op, counted at the ops that run (forward and backward),
    by three nested ``counters.OpCounter``:

    - ``rows``: (op, rows) for every tensor an op writes that holds activations: 2-D with a last
      dimension of H, F or 2F, leaving out the weight shapes (a parameter's, one expert's slice of
      it, and their transposes) and ops that write no element (views);
    - ``gemm_rows``: the rows of every expert GEMM, forward and backward: ``offs[-1]`` of each
      ``_grouped_mm``, the batch of each ``bmm``, and for an ``mm`` with one expert's weight
      matrix (eager) the rows of its activation output (weight gradients left out);
    - ``syncs``: as ``counters.host_syncs``.
    """

    def __init__(self, block: torch.nn.Module, hidden: int, ffn: int):
        widths = {hidden, ffn, 2 * ffn}
        shapes, expert_shapes = set(), set()
        for parameter in block.parameters():
            for shape in (tuple(parameter.shape), tuple(parameter.shape[1:])):
                if len(shape) == 2:
                    shapes |= {shape, shape[::-1]}
            if parameter.dim() == 3:  # [E, ., .]: one expert's matrix is a [., .] slice
                expert_shapes |= {tuple(parameter.shape[1:]), tuple(parameter.shape[1:])[::-1]}

        def expert_gemm(func, args, kwargs):
            return func.overloadpacket.__name__ != "mm" or any(tuple(a.shape) in expert_shapes for a in args[:2])

        def expert_gemm_rows(func, args, kwargs, out):
            if func.overloadpacket.__name__ == "mm" and tuple(out.shape) in shapes:
                return None  # a weight gradient
            return gemm_rows(func, args, kwargs, out)

        def activation_rows(func, args, kwargs, out):
            return [tensor.shape[0] for tensor in torch.utils._pytree.tree_leaves(out)
                    if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[-1] in widths
                    and tuple(tensor.shape) not in shapes]

        # the GEMM counter reads offs[-1] on the host (an op and a read): entered first, the others
        # never see them
        self._gemms = OpCounter("mm", "bmm", "_grouped_mm", where=expert_gemm, measure=expert_gemm_rows)
        self._activations = OpCounter(where=lambda func, args, kwargs: func.overloadpacket.__name__ not in VIEWS,
                                      measure=activation_rows)
        self._syncs = host_syncs()
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        for counter in (self._gemms, self._activations, self._syncs):
            self._stack.enter_context(counter)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    @property
    def rows(self) -> list[tuple[str, int]]:
        return self._activations.values

    @property
    def gemm_rows(self) -> list[tuple[str, int]]:
        return self._gemms.values

    @property
    def syncs(self) -> int:
        return self._syncs.count


# A standalone OLMoE block whose sizes no count can be mistaken for: T = 16 tokens, b = 3 slots,
# H = 24, F = 40 (2F = 80), E = 8; Σκ lies strictly between T and T·b.
BLOCK_TOKENS, BLOCK_HIDDEN, BLOCK_FFN = 16, 24, 40


def _counted_block_step(impl: str, schedule: str | None, sampling: str = "iid", seed: int = 3):
    """Forward + backward of one OLMoE block under :class:`_ActivationRows`; (counts, Σκ or None)."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock

    config = OlmoeConfig(hidden_size=BLOCK_HIDDEN, intermediate_size=BLOCK_FFN, num_experts=8, num_experts_per_tok=K)
    config._experts_implementation = impl
    torch.manual_seed(0)
    block = OlmoeSparseMoeBlock(config).train()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.1)
    hf.remove()
    if schedule is not None:
        hf.apply(ElasticConfig(schedule=schedule, sampling=sampling))
    x = torch.randn(1, BLOCK_TOKENS, BLOCK_HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(seed)
    budget_rng.reset()
    with _ActivationRows(block, BLOCK_HIDDEN, BLOCK_FFN) as counted:
        block(x).square().sum().backward()
    record = latest_record(block.gate)
    counted.expert_ids = None if record is None else record.expert_ids[record.expert_ids >= 0]  # the kept pairs' experts
    return counted, None if record is None else int(record.budgets.sum())


@pytest.mark.parametrize("sampling", ["iid", "balanced"])
@pytest.mark.parametrize("impl", IMPLS)
def test_rows_multiplied_and_elementwise_slots_processed_equal_sum_of_budgets(impl, sampling):
    """Every expert GEMM multiplies Σκ rows (per expert in eager: Σ_e rows = Σκ), and every
    element-wise op on activations (gathers, the gate activation, the weighting, the per-token sum,
    and all their gradients) writes Σκ rows, or T for the token-shaped input and output: nothing is
    shaped by the b candidate slots. And no host sync beyond what stock pays."""
    counted, total = _counted_block_step(impl, SCHEDULE, sampling)
    stock, _ = _counted_block_step(impl, None)
    tokens, slots = BLOCK_TOKENS, BLOCK_TOKENS * WIDTH
    assert tokens < total < slots
    if sampling == "balanced":
        assert total == tokens * K
    pair_rows = [rows for _, rows in counted.rows if rows != tokens]
    if impl == "eager":  # per expert: rows of that expert, Σ over the experts = Σκ
        assert max(pair_rows) <= total
        assert sum(rows for op, rows in counted.rows if op == "silu") == total
        assert sum(rows for op, rows in counted.gemm_rows) == 4 * total  # gate_up, down; their input gradients
        # the loop's own syncs (forward and backward), the same when both runs hit every expert
        assert set(counted.expert_ids.tolist()) == set(range(8)) and counted.syncs == stock.syncs
    else:
        assert set(pair_rows) == {total}
        assert {op for op, rows in counted.rows if rows == total} >= {"silu", "silu_backward", "mul", "index"}
        gemms = {"grouped_mm": 6, "batched_mm": 6}[impl]  # 2 forward, 2 × 2 backward (input and weight)
        assert counted.gemm_rows == [(op, total) for op, _ in counted.gemm_rows] and len(counted.gemm_rows) == gemms
        assert counted.syncs == stock.syncs == 0
    # the same count on stock top-k: T·k pair rows (the count sees the slots a call computes)
    if impl == "eager":
        assert sum(rows for op, rows in stock.rows if op == "silu") == tokens * K
    else:
        assert max(rows for _, rows in stock.rows) == tokens * K


@contextlib.contextmanager
def _library_implementation():
    """A library's own experts implementation (transformers' grouped_mm under another name),
    registered under a name new to this process (the adapter warns once per name), then removed."""
    name = f"library_grouped_mm_{next(_LIBRARY_NAMES)}"
    moe.ALL_EXPERTS_FUNCTIONS[name] = lambda *args: moe.grouped_mm_experts_forward(*args)
    try:
        yield name
    finally:
        del moe.ALL_EXPERTS_FUNCTIONS[name]


_LIBRARY_NAMES = itertools.count()


def test_the_slot_count_sees_b_slot_shapes():
    """Control for the test above: an implementation the adapter cannot cut to κ computes every
    candidate slot, and the count shows T·b rows."""
    with _library_implementation() as name:
        counted, total = _counted_block_step(name, SCHEDULE)
    assert total < BLOCK_TOKENS * WIDTH
    assert {rows for op, rows in counted.rows if op == "silu"} == {BLOCK_TOKENS * WIDTH}


# ------------------------------------------------------------------------------- aliases of the marked tensors
class _Alias(torch.autograd.Function):
    """What DeepSpeed ZeRO-3's module hooks do to every input and output: a new tensor object over
    the same data (``detach``), with a backward that passes the gradient through."""

    @staticmethod
    def forward(tensor):
        return tensor.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


def _alias_every_module_boundary(model) -> list:
    def alias(value):
        if isinstance(value, torch.Tensor):
            return _Alias.apply(value)
        if isinstance(value, tuple):
            return type(value)(alias(item) for item in value) if not hasattr(value, "_fields") else value
        return value

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(lambda module, args: alias(args)))
        handles.append(module.register_forward_hook(lambda module, args, output: alias(output)))
    return handles


@pytest.mark.parametrize("impl", IMPLS)
def test_the_marks_survive_new_tensor_objects_at_every_module_boundary(tiny, expert_rows, impl):
    """Under ZeRO-3 every module's inputs and outputs reach the next module as new tensor objects
    (tests/hf/test_hf_engines.py runs the real thing): the experts must still compute Σκ rows, and the
    loss count the realised slots, exactly as without the aliases. With marks keyed by object
    identity (before), the experts computed T·b rows and the aux loss recounted a static top-3."""
    hf.apply(ElasticConfig(schedule=SCHEDULE))
    plain = _train_step(tiny.model("olmoe", experts_implementation=impl))
    model = tiny.model("olmoe", experts_implementation=impl)
    handles = _alias_every_module_boundary(model)
    try:
        with expert_rows(model) as counted:
            aliased = _train_step(model)
    finally:
        for handle in handles:
            handle.remove()
    assert counted.rows == _kappa_sums(model)
    assert all(rows < TOKENS * WIDTH for rows in counted.rows.values())
    assert torch.equal(aliased["aux_loss"], plain["aux_loss"]) and torch.equal(aliased["loss"], plain["loss"])
    assert hf_experts.kept_slots(torch.zeros(TOKENS, WIDTH, dtype=torch.long)) is None


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
    with _library_implementation() as name:
        hf.apply(ElasticConfig(schedule=SCHEDULE))
        reference = _train_step(tiny.model("olmoe", experts_implementation="eager"))
        model = tiny.model("olmoe", experts_implementation="grouped_mm")
        model.config._experts_implementation = name
        with caplog.at_level(logging.WARNING, logger="elastic_moe_plugin.hf"), expert_rows(model) as counted:
            ours = _train_step(model)
    assert set(counted.rows.values()) == {TOKENS * WIDTH}
    assert sum(f"'{name}'" in record.getMessage() for record in caplog.records) == 1
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
    assert counted.rows == {"experts": int(latest_record(block.gate).budgets.sum())}
    assert not [record for record in caplog.records if "experts implementation" in record.getMessage()]
