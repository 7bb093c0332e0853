"""Gate conventions (docs/gates.md#gate-conventions): hand-written references, closed-form router gradients, no host syncs.

Every expected value here is written out independently of the code under test: Python-loop
references over ``math``, the closed forms of docs/gates.md, or literal numbers.
"""

import math

import pytest
import torch

from elastic_moe_plugin.core.routing import budget_mask
from elastic_moe_plugin.tools.gates_lab.conventions import (
    CONVENTION_NAMES,
    CONVENTIONS,
    full_softmax,
    get_convention,
    renormalized,
    selected_softmax,
    sigmoid,
    to_dense,
)
from counters import host_syncs

F64 = torch.float64


def _logits(num_tokens=6, num_experts=8, seed=0, dtype=F64):
    return torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference(name, row, budget, width):
    """One token, written from the definitions with Python floats: (ids, weights) of length width."""
    exps = [math.exp(v) for v in row]
    probs = [e / sum(exps) for e in exps]
    scores = {"sigmoid": [1 / (1 + math.exp(-v)) for v in row], "selected_softmax": list(row)}.get(name, probs)
    order = sorted(range(len(row)), key=lambda i: -scores[i])[:width]
    kept = order[:budget]
    if name == "full_softmax":
        weights = [probs[i] for i in kept]
    elif name == "renormalized":
        weights = [probs[i] / sum(probs[j] for j in kept) for i in kept]
    elif name == "selected_softmax":
        weights = [math.exp(row[i]) / sum(math.exp(row[j]) for j in kept) for i in kept]
    else:
        sig = [scores[i] for i in kept]
        weights = [s / (sum(sig) + 1e-20) for s in sig] if budget > 1 else sig
    pad = width - budget
    return kept + [-1] * pad, weights + [0.0] * pad


# ------------------------------------------------------------------------------ budget_mask / API
def test_conventions_registry_and_unknown_names():
    assert list(CONVENTIONS) == ["full_softmax", "renormalized", "selected_softmax", "sigmoid"]
    assert get_convention("sigmoid") is sigmoid
    with pytest.raises(ValueError, match="full_softmax, renormalized, selected_softmax, sigmoid"):
        get_convention("softmax")
    with pytest.raises(ValueError, match="'auto' is a plugin setting"):
        get_convention("auto")


@pytest.mark.parametrize("name", CONVENTION_NAMES)
def test_static_top_k_matches_the_hand_written_reference(name):
    logits = _logits()
    expert_ids, weights = CONVENTIONS[name](logits, 3)
    assert expert_ids.shape == weights.shape == (6, 3) and expert_ids.dtype == torch.long
    for t in range(6):
        ids, ws = _reference(name, logits[t].tolist(), 3, 3)
        assert expert_ids[t].tolist() == ids
        assert weights[t].tolist() == pytest.approx(ws, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name", CONVENTION_NAMES)
def test_elastic_budgets_keep_a_rank_prefix(name):
    logits = _logits()
    budgets = torch.tensor([1, 2, 4, 3, 1, 4])
    expert_ids, weights = CONVENTIONS[name](logits, budgets, width=5)
    assert expert_ids.shape == (6, 5)
    for t, budget in enumerate(budgets.tolist()):
        ids, ws = _reference(name, logits[t].tolist(), budget, 5)
        assert expert_ids[t].tolist() == ids
        assert weights[t].tolist() == pytest.approx(ws, rel=1e-12, abs=1e-15)
    # Without width, kmax is the largest budget (one host sync).
    assert CONVENTIONS[name](logits, budgets)[0].shape == (6, 4)
    # An int k with a wider width fills the extra slots with -1 / 0.
    wide_ids, wide_weights = CONVENTIONS[name](logits, 2, width=4)
    assert (wide_ids[:, 2:] == -1).all() and (wide_weights[:, 2:] == 0).all()
    assert torch.equal(wide_ids[:, :2], CONVENTIONS[name](logits, 2)[0])


def test_sigmoid_keeps_raw_scores_for_single_expert_tokens():
    logits = torch.tensor([[0.3, -1.0, 2.0], [0.3, -1.0, 2.0]], dtype=F64)
    _, weights = sigmoid(logits, torch.tensor([1, 2]), width=2)
    s = [1 / (1 + math.exp(-v)) for v in (2.0, 0.3)]
    assert weights[0].tolist() == pytest.approx([s[0], 0.0], rel=1e-14)
    assert weights[1].tolist() == pytest.approx([s[0] / sum(s), s[1] / sum(s)], rel=1e-14)


def test_sigmoid_expert_bias_steers_selection_but_not_weights():
    logits = torch.tensor([[2.0, 0.0, -1.0]], dtype=F64)
    expert_ids, weights = sigmoid(logits, 1, expert_bias=torch.tensor([0.0, 0.0, 5.0], dtype=F64))
    assert expert_ids.tolist() == [[2]]
    assert weights.item() == pytest.approx(1 / (1 + math.exp(1.0)), rel=1e-14)  # σ(-1), bias excluded
    with pytest.raises(ValueError, match=r"expert_bias must have shape \[num_experts\] = \[3\]"):
        sigmoid(logits, 1, expert_bias=torch.zeros(2))


def test_renormalized_and_selected_softmax_agree_to_rounding_not_bitwise_by_contract():
    budgets = torch.tensor([1, 2, 3, 4, 2, 3, 1, 4])
    for dtype, tol in ((torch.float32, 1e-6), (F64, 1e-14)):
        logits = _logits(8, 16, seed=3, dtype=dtype).requires_grad_()
        grads = []
        for fn in (renormalized, selected_softmax):
            ids, weights = fn(logits, budgets, width=4)
            (weights * torch.arange(1.0, 5.0, dtype=weights.dtype)).sum().backward()
            grads.append((ids, weights.detach(), logits.grad.clone()))
            logits.grad = None
        (ids_a, w_a, g_a), (ids_b, w_b, g_b) = grads
        assert torch.equal(ids_a, ids_b)
        torch.testing.assert_close(w_a, w_b, rtol=tol, atol=tol)
        torch.testing.assert_close(g_a, g_b, rtol=tol, atol=tol)


def test_weight_dtypes_follow_the_precision_policy():
    assert full_softmax(_logits(dtype=torch.float32), 2)[1].dtype == torch.float32
    assert full_softmax(_logits(), 2)[1].dtype == F64
    assert renormalized(_logits(dtype=torch.float32).to(torch.bfloat16), 2)[1].dtype == torch.float32


def test_a_zero_budget_keeps_nothing_without_nan():
    logits = _logits(2, 5).requires_grad_()
    for name, fn in CONVENTIONS.items():
        expert_ids, weights = fn(logits, torch.tensor([0, 2]), width=2)
        assert expert_ids[0].tolist() == [-1, -1] and weights[0].tolist() == [0.0, 0.0], name
        weights.sum().backward()
        assert torch.isfinite(logits.grad).all() and (logits.grad[0] == 0).all(), name
        logits.grad = None


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: full_softmax(torch.zeros(3), 1), r"2-D tensor \[num_tokens, num_experts\]"),
        (lambda: full_softmax(torch.zeros(2, 4, dtype=torch.long), 1), "floating point"),
        (lambda: full_softmax(torch.zeros(2, 4), 5), r"k=5 is invalid: expected an integer in 1..num_experts=4"),
        (lambda: full_softmax(torch.zeros(2, 4), 0), "k=0 is invalid"),
        (lambda: full_softmax(torch.zeros(2, 4), 3, width=2), "width=2 is smaller than k=3"),
        (lambda: full_softmax(torch.zeros(2, 4), 1, width=9), r"width=9 is invalid: expected an integer in 1..num_experts=4"),
        (lambda: full_softmax(torch.zeros(2, 4), torch.tensor([1, 2, 3])), r"one budget per token, shape \[2\]"),
        (lambda: full_softmax(torch.zeros(2, 4), torch.tensor([1.0, 2.0])), "integer tensor"),
        (lambda: full_softmax(torch.zeros(2, 4), torch.tensor([1, 5])), "min 1, max 5"),
    ],
)
def test_bad_inputs_name_the_value_and_the_accepted_range(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------------ to_dense
def test_to_dense_drops_unused_slots_and_passes_gradients():
    expert_ids = torch.tensor([[2, 0, -1], [1, -1, -1]])
    weights = torch.tensor([[0.5, 0.25, 0.0], [0.75, 0.0, 0.0]], requires_grad=True)
    probs, routing_map = to_dense(expert_ids, weights, 4)
    assert probs.tolist() == [[0.25, 0.0, 0.5, 0.0], [0.0, 0.75, 0.0, 0.0]]
    assert routing_map.tolist() == [[True, False, True, False], [False, True, False, False]]
    (probs * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert weights.grad.tolist() == [[3.0, 1.0, 0.0], [2.0, 0.0, 0.0]]


@pytest.mark.parametrize("name", CONVENTION_NAMES)
def test_to_dense_of_a_convention_routes_exactly_the_kept_experts(name):
    budgets = torch.tensor([1, 3, 2, 4])
    expert_ids, weights = CONVENTIONS[name](_logits(4, 6), budgets, width=4)
    probs, routing_map = to_dense(expert_ids, weights, 6)
    assert routing_map.sum(-1).tolist() == budgets.tolist()
    assert torch.equal(routing_map, probs > 0)
    torch.testing.assert_close(probs.sum(-1), weights.sum(-1))


# --------------------------------------------------------------------------------- host syncs
# every overload of the ops that synchronise with the host or make data-dependent shapes; the
# first one raises (counters.host_syncs with fail=True)
NO_HOST_SYNC = ("_local_scalar_dense", "nonzero", "masked_select", "item")


@pytest.mark.parametrize("name", CONVENTION_NAMES)
def test_no_host_sync_with_tensor_budgets_and_a_width(name):
    logits = _logits(5, 8, dtype=torch.float32).requires_grad_()
    budgets = torch.tensor([1, 2, 3, 2, 1])
    with host_syncs(NO_HOST_SYNC, fail=True) as mode:
        expert_ids, weights = CONVENTIONS[name](logits, budgets, width=3)
        probs, routing_map = to_dense(expert_ids, weights, 8)
        budget_mask(budgets, 3)
        (probs.sum() + routing_map.sum()).backward()
    assert mode.count == 0 and logits.grad is not None


def test_the_sync_detector_can_fail():
    # Positive control: without width the budgets' maximum is read on the host, and the mode sees it.
    with pytest.raises(AssertionError, match="_local_scalar_dense"), host_syncs(NO_HOST_SYNC, fail=True):
        renormalized(_logits(), torch.tensor([1, 2, 3, 2, 1, 1]))


# ------------------------------------------------------------------------ gradients: closed forms
@pytest.mark.parametrize("name", CONVENTION_NAMES)
def test_autograd_matches_finite_differences_for_every_convention(name):
    logits = _logits(4, 6, seed=7).requires_grad_()
    budgets = torch.tensor([1, 2, 3, 2])
    torch.autograd.gradcheck(lambda z: CONVENTIONS[name](z, budgets, width=3)[1], (logits,))


def _gate_gradient(fn, logits, k, fixed):
    """d/dz of y = Σ_slots w · F[id] with F held fixed; returns (grad [T, E], ids, weights, y [T])."""
    z = logits.clone().requires_grad_()
    expert_ids, weights = fn(z, k)
    y = (weights * fixed.gather(1, expert_ids.clamp_min(0))).sum(-1)
    y.sum().backward()
    return z.grad, expert_ids, weights.detach(), y.detach()


def test_full_softmax_top1_closed_form():
    logits, fixed = _logits(5, 6, seed=1), _logits(5, 6, seed=2)
    grad, expert_ids, _, _ = _gate_gradient(full_softmax, logits, 1, fixed)
    for t in range(5):
        row = logits[t].tolist()
        p = [math.exp(v) / sum(math.exp(u) for u in row) for v in row]
        a = max(range(6), key=lambda i: row[i])
        assert expert_ids[t, 0] == a
        f_a = fixed[t, a].item()
        expected = [p[a] * (1 - p[a]) * f_a if j == a else -p[a] * p[j] * f_a for j in range(6)]
        assert grad[t].tolist() == pytest.approx(expected, abs=1e-6, rel=0)
        assert all(grad[t, j] != 0 for j in range(6))  # unselected logits learn through the denominator


@pytest.mark.parametrize("fn", [renormalized, selected_softmax])
def test_renormalized_top1_gate_gradient_is_exactly_zero(fn):
    logits, fixed = _logits(5, 6, seed=1), _logits(5, 6, seed=2)
    grad, _, weights, _ = _gate_gradient(fn, logits, 1, fixed)
    assert (weights == 1).all()
    assert (grad == 0).all()  # exactly, not approximately


@pytest.mark.parametrize("fn", [renormalized, selected_softmax])
def test_renormalized_top_k_closed_form(fn):
    # docs/gates.md: ∂y/∂z_j = w_j (F_j − y) for j in S, 0 otherwise.
    logits, fixed = _logits(5, 7, seed=4), _logits(5, 7, seed=5)
    budgets = torch.tensor([2, 3, 4, 2, 3])
    grad, expert_ids, weights, y = _gate_gradient(fn, logits, budgets, fixed)
    for t in range(5):
        w = dict(zip(expert_ids[t].tolist(), weights[t].tolist()))
        expected = [w[j] * (fixed[t, j].item() - y[t].item()) if j in w else 0.0 for j in range(7)]
        assert grad[t].tolist() == pytest.approx(expected, abs=1e-6, rel=0)
        assert all(grad[t, j] == 0 for j in range(7) if j not in w)


def test_full_softmax_top_k_closed_form():
    # ∂y/∂z_j = p_j (F_j·[j∈S] − y): unselected logits receive −p_j y.
    logits, fixed = _logits(5, 7, seed=4), _logits(5, 7, seed=5)
    budgets = torch.tensor([2, 3, 4, 1, 3])
    grad, expert_ids, _, y = _gate_gradient(full_softmax, logits, budgets, fixed)
    for t in range(5):
        row = logits[t].tolist()
        p = [math.exp(v) / sum(math.exp(u) for u in row) for v in row]
        kept = set(expert_ids[t, : budgets[t]].tolist())
        expected = [p[j] * ((fixed[t, j].item() if j in kept else 0.0) - y[t].item()) for j in range(7)]
        assert grad[t].tolist() == pytest.approx(expected, abs=1e-6, rel=0)


def test_sigmoid_closed_form():
    logits, fixed = _logits(4, 6, seed=8), _logits(4, 6, seed=9)
    budgets = torch.tensor([1, 2, 3, 1])
    grad, expert_ids, _, y = _gate_gradient(sigmoid, logits, budgets, fixed)
    for t in range(4):
        s = [1 / (1 + math.exp(-v)) for v in logits[t].tolist()]
        kept = expert_ids[t, : budgets[t]].tolist()
        total = sum(s[j] for j in kept)
        expected = [0.0] * 6
        for j in kept:
            if budgets[t] == 1:
                expected[j] = s[j] * (1 - s[j]) * fixed[t, j].item()
            else:
                expected[j] = s[j] * (1 - s[j]) * (fixed[t, j].item() - y[t].item()) / total
        assert grad[t].tolist() == pytest.approx(expected, abs=1e-6, rel=0)


def test_equal_expert_outputs_give_exact_zeros_only_for_normalised_gates():
    logits = _logits(5, 6, seed=11)
    fixed = torch.full((5, 6), 0.7, dtype=F64)
    budgets = torch.tensor([2, 3, 4, 2, 5])
    for fn in (renormalized, selected_softmax, sigmoid):
        assert (_gate_gradient(fn, logits, budgets, fixed)[0] == 0).all(), fn.__name__
    # full softmax: y = F · Σ_S p, and Σ_S p depends on the logits.
    assert (_gate_gradient(full_softmax, logits, budgets, fixed)[0] != 0).all()


def test_static_forwards_are_bitwise_the_upstream_formulas():
    # The adapters rely on this: with κ ≡ k the weights equal the stock router's, bit for bit.
    logits = _logits(16, 12, seed=13, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_p, _ = torch.topk(probs, 4, dim=-1)
    # HF OLMoE (norm_topk_prob=False) / Megatron pre-softmax
    assert torch.equal(full_softmax(logits, 4)[1], top_p)
    # HF Qwen3 (norm_topk_prob=True): router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    assert torch.equal(renormalized(logits, 4)[1], top_p / top_p.sum(dim=-1, keepdim=True))
    # Megatron post-softmax: torch.topk(logits) then softmax over the selected scores
    top_z, top_zi = torch.topk(logits, 4, dim=-1)
    ids, weights = selected_softmax(logits, 4)
    assert torch.equal(ids, top_zi) and torch.equal(weights, torch.softmax(top_z, dim=-1, dtype=torch.float32))
    # Megatron sigmoid: scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    top_s, _ = torch.topk(torch.sigmoid(logits), 4, dim=-1)
    assert torch.equal(sigmoid(logits, 4)[1], top_s / (top_s.sum(dim=-1, keepdim=True) + 1e-20))
    assert torch.equal(sigmoid(logits, 1)[1], top_s[:, :1])
