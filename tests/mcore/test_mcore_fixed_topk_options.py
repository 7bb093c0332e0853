"""Megatron options that assume one fixed top-k per token are refused at router build, naming the
option, its value and a fix, which is itself accepted (the Megatron-LM flags of the first two are
checked in test_megatron_args.py):

- ``batch_invariant_mode`` (megatron-core 0.16+; Megatron-LM main's batch-invariant MoE unpermute
  asserts ``num_out_tokens % num_tokens == 0`` and builds [T, topk] maps, ``moe/batch_invariant.py``);
- ``moe_apply_probs_on_input`` (the experts assert ``moe_router_topk == 1``);
- ``moe_router_topk_mode="seq_topk"`` (Megatron-LM's SeqTopK branch: the router picks per-sequence
  budgets itself).
"""

from __future__ import annotations

import pytest

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.core.errors import UnsupportedMegatronError
from elastic_moe_plugin.mcore.options import MEGATRON_LM_FLAGS, check_model_options

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

#: attribute -> (the refused value, what the message says, the fix it names: the value it sets)
FIXED_TOPK = {
    "batch_invariant_mode": (True, "batch_invariant_mode=True: Megatron's batch-invariant MoE unpermute asserts a "
                                   "fixed top-k per token", "set batch_invariant_mode=False", False),
    "moe_apply_probs_on_input": (True, "moe_apply_probs_on_input=True scales each expert's input by its gate, which "
                                       "Megatron defines for top-1 routing only",
                                 "set moe_apply_probs_on_input=False", False),
    "moe_router_topk_mode": ("seq_topk", "moe_router_topk_mode='seq_topk' chooses per-sequence expert budgets",
                             "use moe_router_topk_mode='topk'", "topk"),
}


@pytest.mark.parametrize("attribute", list(FIXED_TOPK))
def test_an_option_that_fixes_the_topk_is_refused_at_router_build_with_a_fix_that_is_accepted(
        attribute, make_config, make_router):
    value, says, fix, fixed = FIXED_TOPK[attribute]
    config = make_config()
    setattr(config, attribute, value)  # after construction: 0.19 wants bf16 and flash attention for the first
    with mcore.patched(ElasticConfig(schedule="1-3")), pytest.raises(UnsupportedMegatronError) as caught:
        make_router(config)
    assert says in str(caught.value) and fix in str(caught.value), str(caught.value)
    with mcore.patched(ElasticConfig(schedule="static")):
        make_router(config)  # the point mass is stock
    setattr(config, attribute, fixed)
    with mcore.patched(ElasticConfig(schedule="1-3")):
        make_router(config)


def test_the_flag_spelling_names_the_flag_to_remove(make_config):
    config = make_config()
    config.batch_invariant_mode = True
    with pytest.raises(UnsupportedMegatronError, match="remove --batch-invariant-mode, a store_true flag"):
        check_model_options(config, ElasticConfig(schedule="1-3"), score_function="softmax",
                            routing_type="aux_loss", options=MEGATRON_LM_FLAGS)
