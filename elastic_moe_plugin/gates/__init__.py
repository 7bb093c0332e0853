"""Top-k gate conventions and the gate-convention lab (seed 000). Pure torch.

The conventions (:mod:`~elastic_moe_plugin.gates.conventions`) are the single implementation of
gate weights: the Megatron and transformers adapters call them, and so does the lab
(:mod:`~elastic_moe_plugin.gates.lab`, ``elastic-moe gates``). See ``docs/gates.md``.
"""

from elastic_moe_plugin.gates.conventions import (
    CONVENTION_NAMES,
    CONVENTIONS,
    WEIGHING_RULES,
    budget_mask,
    full_softmax,
    get_convention,
    renormalized,
    selected_softmax,
    sigmoid,
    to_dense,
    top_p_budgets,
    weigh_candidates,
)
from elastic_moe_plugin.gates.lab import (
    ZERO_CAUSES,
    GradcheckResult,
    SelectionChange,
    compare,
    format_comparison,
    format_two_logit,
    gradcheck_router,
    load_logits,
    two_logit_example,
)

__all__ = [
    "CONVENTIONS",
    "CONVENTION_NAMES",
    "ZERO_CAUSES",
    "GradcheckResult",
    "SelectionChange",
    "budget_mask",
    "compare",
    "format_comparison",
    "format_two_logit",
    "full_softmax",
    "get_convention",
    "gradcheck_router",
    "load_logits",
    "renormalized",
    "selected_softmax",
    "sigmoid",
    "WEIGHING_RULES",
    "to_dense",
    "top_p_budgets",
    "two_logit_example",
    "weigh_candidates",
]
