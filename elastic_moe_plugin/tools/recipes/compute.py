"""The compute budget of a recipe: total and active parameters, M (training FLOPs per token),
D (tokens), C = M·D against the paper's 6e19, and the expected and worst-case experts per token
of every schedule of its setting. The definitions are printed with the numbers and explained in
docs/recipes.md ("Budget arithmetic")."""

from __future__ import annotations

from typing import Any

from elastic_moe_plugin.tools.recipes.load import load_recipe
from elastic_moe_plugin.tools.recipes.recipe import Recipe, display_path

PAPER_COMPUTE = 6.0e19
#: display order of the schedule recipes
ORDER = (
    "top8",
    "7-9",
    "6-10",
    "5-11",
    "6-10_sigma1.0",
    "6-10_sigma3.0",
    "6-10_L3-7",
    "6-10_L8-12",
    "top9",
    "top10",
    "top-p0.4",
)


def experts_per_token(recipe: Recipe) -> dict[str, Any]:
    """Expected and worst-case experts per token of ``recipe``'s training routing."""
    model = recipe.model
    elastic = recipe.elastic
    k = model.training_topk
    layers = elastic.layer_set
    n_elastic = model.num_layers if layers is None else len([i for i in layers if i < model.num_layers])
    n_static = model.num_layers - n_elastic
    row: dict[str, Any] = {
        "recipe": recipe.name,
        "train_topk": k,
        "eval_topk": model.topk,
        "elastic_layers": n_elastic,
        "mode": elastic.mode,
        "layers": "all" if elastic.layers is None else elastic.layers,
    }
    if not elastic.enabled:
        n_elastic, n_static = 0, model.num_layers
    if elastic.mode == "top_p":
        cap = elastic.top_p_max_experts or model.num_experts
        row.update(
            kind=f"top-p {elastic.top_p}",
            expected_per_layer=None,
            expected_mean=None,
            worst_per_layer=cap,
            worst_mean=(n_elastic * cap + n_static * k) / model.num_layers,
            min_per_layer=1,
            schedule=None,
            note="E[experts] has no closed form: it depends on the router's probabilities "
            "(the paper reports ~13 per token on OLMoE at p = 0.4)",
        )
        return row
    schedule = elastic.budget_schedule(k)
    mean = schedule.mean
    row.update(
        kind=f"static top-{k}" if schedule.is_static else f"{schedule.spec()} sigma {elastic.sigma:g}",
        schedule=schedule.spec(),
        expected_per_layer=mean,
        expected_mean=(n_elastic * mean + n_static * k) / model.num_layers,
        worst_per_layer=schedule.high,
        worst_mean=(n_elastic * schedule.high + n_static * k) / model.num_layers,
        min_per_layer=schedule.low,
        sd_per_layer=schedule.std,
        note="",
    )
    return row


def budget(recipe: Recipe) -> dict[str, Any]:
    """Everything ``elastic-moe budget`` prints, as a dict."""
    model = recipe.model
    batch = recipe.batch
    seq = batch["seq_length"]
    k = model.topk
    n_act_nonemb = model.non_embedding_params(k)
    attention_term = 12 * model.num_layers * seq * model.attention_width
    m = 6 * n_act_nonemb + attention_term
    m_forward = 2 * n_act_nonemb + 4 * model.num_layers * seq * model.attention_width
    args = recipe.args
    steps, warmup = _steps_and_warmup(recipe)
    tokens_per_step = batch["global"] * seq
    tokens = steps * tokens_per_step if steps else None
    siblings = []
    paths = [p for p in recipe.path.parent.glob("*.yaml") if p.name != "base.yaml"]
    for path in sorted(paths, key=lambda p: (ORDER.index(p.stem) if p.stem in ORDER else len(ORDER), p.stem)):
        siblings.append(experts_per_token(load_recipe(path)))
    return {
        "recipe": display_path(recipe.path),
        "setting": recipe.setting,
        "model": model.name,
        "params": {
            "total": model.total_params(),
            "active": model.active_params(k),
            "non_embedding_active": n_act_nonemb,
            "embedding": model.embedding_params,
            "per_layer_attention": model.attention_params,
            "per_layer_router": model.router_params,
            "per_expert": model.expert_params,
            "definition": "weight matrices only (embeddings, untied head, Q/K/V/O, router, SwiGLU experts "
            "3 x hidden x moe_ffn); norms and biases left out",
        },
        "flops": {
            "M": m,
            "six_n": 6 * n_act_nonemb,
            "attention_term": attention_term,
            "M_forward_only": m_forward,
            "definition": "M = 6 * N_act_nonemb + 12 * n_layers * seq * d_attn (non-embedding training FLOPs per "
            "token, DeepSeek-LLM convention as in Tian et al. 2025; d_attn = heads x head_dim)",
        },
        "tokens": {
            "steps": steps,
            "tokens_per_step": tokens_per_step,
            "D": tokens,
            "warmup_steps": warmup,
            "epochs": args.get("num_train_epochs"),
        },
        "compute": {
            "C": m * tokens if tokens else None,
            "paper_C": PAPER_COMPUTE if steps else None,
        },
        "this_recipe": experts_per_token(recipe),
        "schedules": siblings,
    }


def _steps_and_warmup(recipe: Recipe) -> tuple[int | None, int | None]:
    """The pretraining recipes' training and warmup steps (None for the SFT recipes, which train epochs)."""
    flags = {
        "megatron_lm": ("args.train-iters", "args.lr-warmup-iters"),
        "torchtitan": ("args.training.steps", "args.lr_scheduler.warmup_steps"),
    }.get(recipe.launcher)
    if flags is None:
        return None, None
    found = []
    for key in flags:
        try:
            found.append(recipe.get(key))
        except KeyError:
            found.append(None)
    return found[0], found[1]


def _b(n: float) -> str:
    return f"{n / 1e9:.4f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def format_budget(report: dict[str, Any]) -> str:
    p, f, t, c = report["params"], report["flops"], report["tokens"], report["compute"]
    lines = [
        f"recipe: {report['recipe']} ({report['setting']}, model {report['model']})",
        f"parameters: total {_b(p['total'])} ({p['total']:,}), active {_b(p['active'])} ({int(p['active']):,}) at the "
        f"checkpoint's top-k",
        f"  non-embedding active {_b(p['non_embedding_active'])}; embeddings {_b(p['embedding'])}; per layer: "
        f"attention {_b(p['per_layer_attention'])}, router {_b(p['per_layer_router'])}, "
        f"one expert {_b(p['per_expert'])}",
        f"  counted: {p['definition']}",
        f"M: {f['M']:.4e} FLOPs/token = 6*N_act_nonemb {f['six_n']:.4e} + 12*L*seq*d_attn {f['attention_term']:.4e}",
        f"  definition: {f['definition']}",
        f"  (a forward-only count, 2*N + 4*L*seq*d_attn, would be {f['M_forward_only']:.4e})",
    ]
    if t["D"]:
        lines.append(
            f"D: {t['steps']:,} steps x {t['tokens_per_step']:,} tokens/step = {t['D']:,} tokens "
            f"({t['D'] / 1e9:.2f}B); warmup {t['warmup_steps']} steps"
        )
        ratio = c["C"] / c["paper_C"] - 1 if c["paper_C"] else None
        lines.append(
            f"C = M * D = {c['C']:.4e} FLOPs"
            + (f" (paper: {c['paper_C']:.1e}, {ratio:+.1%})" if ratio is not None else "")
        )
        lines.append(f"steps: {t['steps']:,}")
    else:
        lines.append(
            f"D: unknown (trains {t['epochs']} epochs over the dataset; {t['tokens_per_step']:,} tokens per step "
            f"when packed), so C = M * D is unknown too; steps = epochs x ceil(packed rows / global batch)"
        )
    lines.append("experts per token in training (E = expected, worst = every elastic layer at the top of its support):")
    # Space-free column names, two spaces apart, so the header reads (and splits) like the rows.
    header = (
        f"  {'recipe':<15}  {'routing':<17}  {'layers':<7}  {'E[kappa]/layer':>14}  {'E[kappa]/model':>14}  "
        f"{'worst/layer':>11}  {'worst/model':>11}  {'min/layer':>9}  eval"
    )
    lines.append(header)
    this = report["this_recipe"]["recipe"]
    for row in report["schedules"]:
        exp = "unknown" if row["expected_per_layer"] is None else f"{row['expected_per_layer']:.3f}"
        mean = "unknown" if row["expected_mean"] is None else f"{row['expected_mean']:.3f}"
        mark = "*" if row["recipe"] == this else " "
        lines.append(
            f" {mark}{row['recipe']:<15}  {row['kind']:<17}  {row['layers']:<7}  {exp:>14}  {mean:>14}  "
            f"{row['worst_per_layer']:>11}  {row['worst_mean']:>11.3f}  {row['min_per_layer']:>9}  "
            f"top-{row['eval_topk']}"
        )
        if row.get("note"):
            lines.append(f"  {'':<15}  {row['note']}")
    lines.append("  (* this recipe; layer-restricted recipes average elastic and static layers in '/model')")
    return "\n".join(lines)
