"""The gate-convention lab (docs/gates.md#gate-conventions): the same logits, experts and tokens
under every convention.

Three tools, pure torch, built on the reference conventions of :mod:`.conventions` (routing rules
run by the routing core training runs, :mod:`elastic_moe_plugin.core.routing`):

1. :func:`compare` (:mod:`.comparison`, on the toy MoE of :mod:`.toy_moe`) runs each convention
   on identical logits, expert parameters, token order and capacity policy (dropless), and
   records per convention the loss, the selected identities, the retained weight sums, the
   router- and expert-weight gradient norms, and the tokens whose router-gate gradient is
   exactly zero, with the cause of each zero.
2. :func:`gradcheck_router` (:mod:`.gradcheck`) checks router-logit gradients against central
   differences only where the difference cannot cross a membership change, and reports the
   selection change instead where it would.
3. :func:`two_logit_example` (:mod:`.two_logit`): the two-expert gate [0, w·x − 0.5], whose
   second probability is σ(w·x − 0.5) with gate derivative p(1 − p).

:func:`load_logits` (:mod:`.inputs`) reads user-supplied logits ``[T, E]``. ``elastic-moe gates``
is :mod:`elastic_moe_plugin.cli.gates`; docs/gates.md explains the conventions and the lab.
"""

from elastic_moe_plugin.tools.gates_lab.comparison import compare, format_comparison
from elastic_moe_plugin.tools.gates_lab.gradcheck import (
    DEFAULT_STEP,
    MIN_STEP,
    STEP_SHARE_OF_MARGIN,
    GradcheckResult,
    SelectionChange,
    gradcheck_router,
)
from elastic_moe_plugin.tools.gates_lab.inputs import load_logits
from elastic_moe_plugin.tools.gates_lab.toy_moe import ZERO_CAUSES
from elastic_moe_plugin.tools.gates_lab.two_logit import format_two_logit, two_logit_example

__all__ = [
    "DEFAULT_STEP",
    "MIN_STEP",
    "STEP_SHARE_OF_MARGIN",
    "ZERO_CAUSES",
    "GradcheckResult",
    "SelectionChange",
    "compare",
    "format_comparison",
    "format_two_logit",
    "gradcheck_router",
    "load_logits",
    "two_logit_example",
]
