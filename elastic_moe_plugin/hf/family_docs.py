"""The family tables of ``docs/transformers.md``, generated from :mod:`.family_table` (``make docs``;
``tests/hf/test_hf_every_family.py`` checks the page holds them)."""

from __future__ import annotations

from elastic_moe_plugin.hf.family_table import FAMILIES, REFUSED
from elastic_moe_plugin.hf.router_family import RouterFamily

#: rule kind → its formula, for the docs table (the readers are :data:`.rules.RULES`)
RULE_SUMMARIES: dict[str, str] = {
    "softmax_topk": "p = softmax(z) (fp32); top-k by p (+ b: LongCat-Flash); w = p, or p / Σ_kept p (+ ε); × scale",
    "sigmoid_bias": "s = sigmoid(z) (fp32, or z's dtype: LFM2-MoE); top-k by s + b (inside the kept groups); "
    "w = s, or s / (Σ_kept s + ε); × scale",
    "activation_bias": "s = the router's activation of z (`score_fn`: sqrt(softplus(z)) or sigmoid(z)), in z's "
    "dtype; top-k by s + b; w = s / (Σ_kept s + ε); × scale",
    "softmax_groups": "p = softmax(z) (z's dtype); group-limited top-k by p (dropped groups 0.0); "
    "w = p, or p / (Σ_kept p + ε); × scale",
    "softmax_pnorm": "p = softmax(z) (z's dtype); top-k by p; w = p / ||p_kept||_q (q = moe_normalize_expert_weights), "
    "or p where q is None",
    "logits_bias_sigmoid": "top-k by z + b (fp32); w = sigmoid(z_kept), / Σ_kept iff norm_topk_prob",
    "sigmoid_shared_sink": "s = sigmoid(z) (fp32 from 5.25); top-k by s + b over the routed experts; w = s / "
    "(Σ_kept s + Σ_shared s) × route_scale × global_scale, the shared experts' own weights alike",
    "logits_topk": "top-k by z; w = softmax over the kept z "
    "(Cohere2's sigmoid mode: sigmoid(z_kept), renormalised iff asked)",
    "softmax_bias_floor": "p = softmax(z) (fp32); top-k by p + b; w = p / max(Σ_kept p, moe_norm_min)",
}

DOCS_BEGIN = "<!-- families: generated from elastic_moe_plugin/hf/family_table.py by `make docs`; do not edit -->"
DOCS_END = "<!-- end of families -->"


def _bias_text(family: RouterFamily) -> str:
    if family.bias_argument:
        return f"`{family.bias_argument}` (passed in by the block)"
    return f"`{family.bias}`" if family.bias else "—"


def markdown_tables() -> str:
    """The covered and refused families as markdown, between :data:`DOCS_BEGIN` and :data:`DOCS_END`
    (``docs/transformers.md`` holds this text; ``tests/hf/test_hf_every_family.py`` checks it)."""
    covered = [
        "| family | router (site) | rule kind | logits | selection bias | renormalises | weights |",
        "|---|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        covered.append(
            f"| `{family.name}` | `{family.router}` (`{'`, `'.join(family.sites)}`) | `{family.rule}` | "
            f"`{family.logits}` | {_bias_text(family)} | {family.renormalizes} | "
            f"{family.weights_dtype} |"
        )
    kinds = ["| rule kind | routing |", "|---|---|"] + [
        f"| `{kind}` | {text} |" for kind, text in RULE_SUMMARIES.items()
    ]
    refused = ["| family | why it is not elastic |", "|---|---|"] + [
        f"| `{folder}` | {reason} |" for folder, reason in sorted(REFUSED.items())
    ]
    parts = [
        DOCS_BEGIN,
        "",
        *kinds,
        "",
        *covered,
        "",
        "Refused at model build (`allow_uncovered_routers` keeps them static):",
        "",
        *refused,
        "",
        DOCS_END,
    ]
    return "\n".join(parts)


def with_tables(text: str) -> str:
    """``text`` (``docs/transformers.md``) with its generated section replaced by :func:`markdown_tables`."""
    start, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    return text[:start] + markdown_tables() + text[end:]
