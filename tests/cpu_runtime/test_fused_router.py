"""The CPU stand-in for Transformer Engine's fused MoE router (``cpu_runtime.fused_router``).

``cpu_runtime.enable()`` sets the three fused router names of ``moe_utils`` to megatron-core's own
unfused code and ``moe_utils.HAVE_TE`` to True, so ``moe_router_fusion=True`` runs on the CPU and
its fused path equals the unfused one bit for bit; the other fused kernels (permute and kin) still
raise megatron-core's own "not available"; ``disable()`` restores every name by identity.
"""

from __future__ import annotations

import pytest
import torch

from elastic_moe_plugin import cpu_runtime
from elastic_moe_plugin.cpu_runtime import fused_router

pytestmark = pytest.mark.megatron

T, E = 24, 8


def _moe_utils():
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


@pytest.fixture
def stand_ins():
    cpu_runtime.enable(force=True)
    moe_utils = _moe_utils()
    if not all(fused_router.is_stand_in(getattr(moe_utils, name)) for name in fused_router.FUSED_ROUTER_FUNCTIONS):
        pytest.skip("Transformer Engine's fused router is installed: its kernels run, not the stand-in")
    return moe_utils


@pytest.mark.parametrize("case", [
    dict(score_function="softmax"),
    dict(score_function="softmax", use_pre_softmax=True, scaling_factor=2.0),
    dict(score_function="softmax", num_groups=4, group_topk=2),
    dict(score_function="sigmoid", expert_bias=True),
    dict(score_function="sigmoid", num_groups=2, group_topk=1, expert_bias=True),
], ids=["softmax", "pre_softmax_scaled", "groups", "sigmoid_bias", "sigmoid_groups"])
def test_the_fused_path_equals_the_unfused_one_bit_for_bit(case, stand_ins):
    moe_utils = stand_ins
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=generator)
    kwargs = dict(case)
    if kwargs.pop("expert_bias", False):
        kwargs["expert_bias"] = torch.randn(E, generator=generator) * 0.1
    fused = moe_utils.topk_routing_with_score_function(logits, 2, fused=True, **kwargs)
    unfused = moe_utils.topk_routing_with_score_function(logits, 2, fused=False, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
    score_function = kwargs["score_function"]
    fused = moe_utils.compute_routing_scores_for_aux_loss(logits, 2, score_function, fused=True)
    unfused = moe_utils.compute_routing_scores_for_aux_loss(logits, 2, score_function, fused=False)
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
    routing_map, scores = unfused
    loss = dict(probs=scores, tokens_per_expert=routing_map.sum(dim=0), total_num_tokens=T, topk=2, num_experts=E,
                moe_aux_loss_coeff=0.01)
    assert torch.equal(moe_utils.switch_load_balancing_loss_func(**loss, fused=True),
                       moe_utils.switch_load_balancing_loss_func(**loss, fused=False))


def test_the_other_fused_kernels_still_say_they_are_unavailable(stand_ins):
    moe_utils = stand_ins
    tokens, routing_map = torch.randn(T, 4), torch.zeros(T, E, dtype=torch.bool)
    with pytest.raises(ValueError, match="fused_permute is not available"):
        moe_utils.permute(tokens, routing_map, fused=True)


def test_disable_restores_the_names_and_enable_installs_them_again(stand_ins):
    moe_utils = stand_ins
    try:
        cpu_runtime.disable()
        assert moe_utils.HAVE_TE is False
        assert all(getattr(moe_utils, name, None) is None for name in fused_router.FUSED_ROUTER_FUNCTIONS)
        with pytest.raises(ValueError, match="fused_topk_with_score_function is not available"):
            moe_utils.topk_routing_with_score_function(torch.randn(T, E), 2, fused=True)
    finally:
        cpu_runtime.enable(force=True)
    assert moe_utils.HAVE_TE is True
    assert all(getattr(moe_utils, name) is fused_router.STAND_INS[name] for name in fused_router.FUSED_ROUTER_FUNCTIONS)
