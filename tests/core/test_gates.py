"""The weighing rules routing runs (``elastic_moe_plugin.core.gates``): the kept-slot mask and
each rule against a hand-written formula. The reference conventions built on them are tested in
``tests/tools/test_gate_conventions.py``."""

import pytest
import torch

from elastic_moe_plugin.core.gates import budget_mask


def test_budget_mask_keeps_slot_j_iff_j_below_the_budget():
    mask = budget_mask(torch.tensor([1, 3, 0, 5]), 4)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, True, False],
        [False, False, False, False],
        [True, True, True, True],
    ]


def test_weigh_candidates_rules_against_hand_formulas():
    from elastic_moe_plugin.core.gates import weigh_candidates

    scores = torch.tensor([[0.9, 0.6, 0.3], [0.8, 0.5, 0.1]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    kept = scores * mask
    assert torch.equal(weigh_candidates("full_softmax", scores, mask), kept)
    renormalised = weigh_candidates("sigmoid_renormalized", scores, mask)
    assert torch.allclose(renormalised, kept / kept.sum(-1, keepdim=True), atol=1e-15, rtol=0)
    # Megatron's sigmoid rule per token: κ=2 normalised, κ=1 raw
    megatron_rule = weigh_candidates("sigmoid", scores, mask)
    assert torch.allclose(megatron_rule[0], renormalised[0], atol=1e-15, rtol=0)
    assert torch.equal(megatron_rule[1], kept[1])
    with pytest.raises(ValueError, match=r"weighing rule 'softmax' is unknown"):
        weigh_candidates("softmax", scores, mask)
