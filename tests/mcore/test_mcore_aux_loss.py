"""Realised load balancing is exact where stock's is: on one sequence, the sequence-level aux loss
equals the micro-batch aux loss, bit for bit (``elastic_moe_plugin.mcore.aux_loss``).

Megatron's own ``test_seq_aux_loss`` (``tests/unit_tests/transformer/moe/test_aux_loss.py``) holds
stock ``seq_aux_loss`` over one sequence to ``aux_loss`` exactly: both call
``switch_load_balancing_loss_func`` on the same tensors. The realised losses replace stock's
``topk · T`` by the realised Σκ; they must keep that equality with κ varying (the seq path used to
divide in another order and differ by 1 ulp), while κ ≡ k stays bitwise stock.
"""

from __future__ import annotations

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.mcore import budget_rng
from counters import all_ops, op_calls

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

SEQ, E, H = 64, 8, 16
COEFF = 0.01
LOGGED = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def _logged_loss(kind, logits, mask, schedule, score_function, make_config, make_router, moe_tracker):
    """(the value the tracker logged, the logits' gradient) of one training routing call on one
    sequence ([S, 1, E] logits), κ drawn from a stream seeded alike for every call."""
    moe_tracker.reset()
    config = make_config(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=COEFF, num_moe_experts=E,
                         moe_router_score_function=score_function)
    with mcore.patched(ElasticConfig(schedule=schedule)):
        router = make_router(config)
        torch.manual_seed(7)
        budget_rng.reset()  # every call draws κ from the stream seeded with 7, counter 0
        logits = logits.detach().clone().requires_grad_()
        probs, routing_map = router.routing(logits, padding_mask=mask)
        (probs * 0).sum().backward()
    return moe_tracker.values(LOGGED[kind])[0].clone(), logits.grad, routing_map


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
@pytest.mark.parametrize("schedule", ["1-3", "static"], ids=["variable_kappa", "stock"])
def test_seq_aux_loss_on_one_sequence_equals_aux_loss_exactly(schedule, masked, score_function, make_config,
                                                              make_router, moe_tracker):
    mask = None
    if masked:
        mask = torch.zeros(SEQ, 1, dtype=torch.bool)
        mask[-9:] = True  # padding at the end of the sequence
    for seed in range(6):  # a 1-ulp difference in the op order shows up within a few draws
        logits = torch.randn(SEQ, 1, E, generator=torch.Generator().manual_seed(seed)) * 2
        aux, aux_grad, aux_map = _logged_loss("aux_loss", logits, mask, schedule, score_function, make_config,
                                              make_router, moe_tracker)
        seq, seq_grad, seq_map = _logged_loss("seq_aux_loss", logits, mask, schedule, score_function, make_config,
                                              make_router, moe_tracker)
        assert torch.equal(aux_map, seq_map), "the same κ and the same routing in both calls"
        if schedule != "static":
            assert len(set(aux_map.sum(dim=1).tolist())) > 1, "κ varies"
        assert aux.item() > 0
        assert torch.equal(seq, aux), f"seed {seed}: seq_aux_loss {seq.item()!r} != aux_loss {aux.item()!r}"
        assert torch.equal(seq_grad, aux_grad), f"seed {seed}: the aux gradients differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_loss_scores_are_stocks_bit_for_bit_without_its_top1_map(score_function, masked, dtype):
    """The realised aux losses read only the scores of Megatron's ``compute_routing_scores_for_aux_loss``:
    computed without the top-k map it also builds, and bitwise equal to stock's scores (in the
    precision the installed megatron-core computes them in)."""
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

    from elastic_moe_plugin.mcore.aux_loss import aux_loss_scores

    logits = (torch.randn(SEQ * 2, E, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    mask = None
    if masked:
        mask = torch.zeros(SEQ * 2, dtype=torch.bool)
        mask[-11:] = True
    try:
        _, stock = compute_routing_scores_for_aux_loss(logits, 1, score_function, fused=False, padding_mask=mask)
    except ValueError as error:  # megatron-core 0.16 has no sqrtsoftplus; stock's refusal stays
        assert score_function == "sqrtsoftplus"
        with pytest.raises(ValueError, match=str(error)):
            aux_loss_scores(logits, score_function, mask)
        return
    aux_loss_scores(logits[:1], score_function)  # the first call reads stock's dtype once, on a [1, 2] input
    with op_calls(torch.ops.aten.topk.default, torch.ops.aten.scatter.value, torch.ops.aten.scatter.src) as counted:
        scores = aux_loss_scores(logits, score_function, mask)
    assert counted.count == 0
    assert scores.dtype == stock.dtype and torch.equal(scores, stock)
    if masked:
        assert torch.count_nonzero(scores[mask]) == 0 and scores[~mask].sum() > 0


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_the_host_realised_sum_normalises_as_the_devices_count(kind, make_config, make_router, moe_tracker, monkeypatch):
    """With κ drawn on the host, no padding mask and a one-rank reduction, Σ_j c_j = Σκ is the
    draw's host total: the loss normalises by it with no device op, to the value (and gradient)
    the device's own count gives, up to fp32 rounding of the scale (float64 on the host)."""
    from elastic_moe_plugin.mcore import aux_loss

    logits = torch.randn(SEQ, 1, E, generator=torch.Generator().manual_seed(3)) * 2
    # the unit test of the private aux_loss._realised_sum itself: its host sum against the device's count
    taken = []
    original = aux_loss._realised_sum
    monkeypatch.setattr(aux_loss, "_realised_sum", lambda *args: taken.append(original(*args)) or taken[-1])
    host, host_grad, host_map = _logged_loss(kind, logits, None, "1-3", "softmax", make_config, make_router, moe_tracker)
    assert taken and taken[0] == int(host_map.sum()), "the host path ran with the realised Σκ"
    monkeypatch.setattr(aux_loss, "_realised_sum", lambda *args: None)
    device, device_grad, device_map = _logged_loss(kind, logits, None, "1-3", "softmax", make_config, make_router,
                                                   moe_tracker)
    assert torch.equal(host_map, device_map) and len(set(host_map.sum(dim=1).tolist())) > 1
    torch.testing.assert_close(host, device, rtol=4e-7, atol=0)
    # the gradient scales by the same factor, through a few more fp32 ops (each within half an ulp,
    # 6e-8): elements cancelled near 0 compare against the largest, to about 16 ulps of it
    torch.testing.assert_close(host_grad, device_grad, rtol=4e-7, atol=1e-6 * float(device_grad.abs().max()))


def test_an_iid_elastic_router_forward_issues_no_more_ops_than_stock(make_config, make_router, moe_tracker):
    """Per-call cost, structurally: an elastic 6-10 training forward with the aux loss (κ drawn on
    the host, its histogram counted there, the loss normalised by the host Σκ) dispatches no more
    aten ops than the stock top-8 router's forward on the same input (stock builds a second top-k
    map for its aux loss; elastic weighs b = 10 slots instead)."""
    config = make_config(num_moe_experts=16, moe_router_topk=8, moe_aux_loss_coeff=COEFF)
    x = torch.randn(32, 4, H, generator=torch.Generator().manual_seed(0))
    counts = {}
    for name, patch in (("stock", None), ("elastic", ElasticConfig(schedule="6-10"))):
        if patch is not None:
            mcore.apply(patch)
        try:
            router = make_router(config)
            router.train()
            router(x.clone().requires_grad_())  # first call: plans, caches, the stream
            with all_ops() as counted:
                router(x.clone().requires_grad_())
            counts[name] = counted.names
        finally:
            mcore.remove()
            moe_tracker.reset()
    assert 0 < len(counts["elastic"]) <= len(counts["stock"]), {name: len(ops) for name, ops in counts.items()}
    # what the host's κ spares: the histogram's scatter_add_, the -inf scalar's scalar_tensor, and
    # the device-side Σκ / T (its reciprocal)
    assert not {"scatter_add_", "scalar_tensor", "reciprocal"} & set(counts["elastic"]), counts["elastic"]
