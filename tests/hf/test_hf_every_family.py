"""Every MoE family of the installed transformers: covered under its own routing rule, or refused by name.

- Coverage: every config class of the installed transformers whose default config routes to more
  than one expert (nested configs included: a vision-language wrapper counts as its text model's
  folder) is a covered family (``hf.FAMILIES``) or refused with its reason (``REFUSED``,
  ``NOT_TOP_K``). A new MoE family in a new transformers fails here until it is classified.
- Each covered family, as a tiny model built before ``apply``: a static schedule in training and
  an elastic one in evaluation are bitwise the stock model; in training, κ ranges over the
  schedule and its frequencies follow the schedule's pmf (written out below, not the package's).
- The three rules the issue names (DeepSeek-V3: sigmoid, correction bias, groups, ε, scaling;
  GPT-OSS: top-k on the logits with bias, softmax over the kept; ERNIE-4.5: softmax, bias,
  floor) under variable κ against a hand-written reference of the family's rule.
- Refusal: a MoE model whose routers are not covered, built while a config is active, is refused
  when it is built, naming its family and router class; ``allow_uncovered_routers`` builds it static.
- The docs' family tables are the generated ones.
"""

from __future__ import annotations

import math
import operator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.schedule import BudgetSchedule
from elastic_moe_plugin.hf import families as hf_families
from elastic_moe_plugin.hf import family_table

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_clean")]

FAMILY_NAMES = tuple(family.name for family in hf.FAMILIES)
INSTALLED = {family.name for family in hf.covered_router_classes().values()}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "transformers.md"


def _moe_folders(config, parent: str | None = None) -> set[str]:
    """Model folders of ``config`` and its nested configs whose own (non-nested) fields route to
    more than one expert. A nested config without a model type (DBRX's ffn_config) is its parent's."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    folder = model_type_to_module_name(config.model_type) if config.model_type else parent
    own = {key: value for key, value in config.to_dict().items() if not isinstance(value, dict)}
    found = {folder} if folder and hf_families.routes_to_experts(own) else set()
    for value in vars(config).values():
        if isinstance(value, transformers.PretrainedConfig):
            found |= _moe_folders(value, folder)
    return found


def test_every_moe_config_of_the_installed_transformers_is_covered_or_refused(monkeypatch):
    import huggingface_hub.constants
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    # a few configs fetch a backbone's config from the hub by default: fail fast instead of retrying
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    covered = {family.module for family in hf.FAMILIES}
    classified = covered | set(family_table.REFUSED) | set(family_table.NOT_TOP_K)
    seen, unclassified = set(), []
    for model_type, class_name in CONFIG_MAPPING_NAMES.items():
        config_class = getattr(transformers, class_name, None)
        try:
            config = config_class()
        except Exception:  # composites built from other configs (encoder-decoder, RAG, ...), each listed itself
            continue
        for folder in _moe_folders(config):
            folder = family_table.TEXT_MODEL_FOLDERS.get(folder, folder)
            seen.add(folder)
            if folder not in classified:
                unclassified.append(f"{model_type} ({folder})")
    assert not unclassified, f"MoE families neither covered nor refused: {unclassified}"
    assert len(seen & covered) >= 40, sorted(seen & covered)  # 5.19: 43 covered families, 41 found by default configs


def test_the_docs_family_tables_are_generated_from_the_table():
    text = DOCS.read_text()
    assert family_table.with_tables(text) == text, "run `make docs`"


def _outputs(model, inputs):
    out = model(**inputs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _pmf(low: int, high: int, center: int, sigma: float) -> dict[int, float]:
    weights = {kappa: math.exp(-((kappa - center) ** 2) / (2 * sigma**2)) for kappa in range(low, high + 1)}
    total = sum(weights.values())
    return {kappa: weight / total for kappa, weight in weights.items()}


@pytest.mark.parametrize("family_name", FAMILY_NAMES)
def test_covered_family_is_elastic_in_training_and_stock_otherwise(tiny, family_name):
    if family_name not in INSTALLED:
        pytest.skip(f"transformers {transformers.__version__} has no {family_name}")
    model = tiny.model(family_name)
    inputs = tiny.inputs(family_name)
    with torch.no_grad():
        stock_train = _outputs(model, inputs)
        stock_eval = _outputs(model.eval(), inputs)
        model.train()

        hf.apply(ElasticConfig(schedule="static"), model=model)
        assert torch.equal(_outputs(model, inputs), stock_train), "static schedule, training"

        hf.apply(ElasticConfig(schedule="1-3"), model=model)
        assert torch.equal(_outputs(model.eval(), inputs), stock_eval), "elastic schedule, evaluation"
        model.train()
        counts = {1: 0, 2: 0, 3: 0}
        for _ in range(8):
            _outputs(model, inputs)
            for record in hf.routing_records(model).values():
                for kappa, number in zip(*torch.unique(record.budgets, return_counts=True), strict=True):
                    counts[int(kappa)] += int(number)
    draws = sum(counts.values())
    assert draws == 8 * 2 * 16, counts  # 8 forwards × 2 MoE layers × 16 tokens, every κ in 1..3
    for kappa, probability in _pmf(1, 3, 2, 1.5).items():
        # 5 binomial standard deviations (about ±37 of 256): a static layer (all κ = 2) fails by ~160
        assert abs(counts[kappa] - draws * probability) <= 5 * math.sqrt(draws * probability * (1 - probability)), counts


# ------------------------------------------------------------------------------- hand-written rules
def _family(name):
    return next(family for family in hf.FAMILIES if family.name == name)


def _top(values: list[float], allowed: list[int], width: int) -> list[int]:
    return sorted(allowed, key=lambda e: values[e], reverse=True)[:width]


def _deepseek_v3(router, row_logits, kappa, width):
    """DeepSeek-V3's rule written out: s = sigmoid(z); rank s + b inside the best groups (group
    score: sum of its top-2 of s + b); w = s / (Σ_kept s + 1e-20) × routed_scaling_factor."""
    bias = router.e_score_correction_bias.tolist()
    scores = [1 / (1 + math.exp(-z)) for z in row_logits]
    selection = [s + b for s, b in zip(scores, bias, strict=True)]
    size = len(scores) // router.num_group
    group_scores = [sum(sorted(selection[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(router.num_group)]
    groups = sorted(range(router.num_group), key=lambda g: group_scores[g], reverse=True)[: router.topk_group]
    ids = _top(selection, [e for e in range(len(scores)) if e // size in groups], width)
    total = sum(scores[e] for e in ids[:kappa]) + 1e-20
    return ids, [scores[e] / total * router.routed_scaling_factor for e in ids[:kappa]]


def _gpt_oss(router, row_logits, kappa, width):
    """GPT-OSS's rule written out: rank z = x W^T + bias; w = softmax over the kept z."""
    ids = _top(row_logits, list(range(len(row_logits))), width)
    top = max(row_logits[e] for e in ids[:kappa])
    exps = [math.exp(row_logits[e] - top) for e in ids[:kappa]]
    return ids, [x / sum(exps) for x in exps]


def _ernie(router, row_logits, kappa, width):
    """ERNIE-4.5's rule written out: p = softmax(z); rank p + b; w = p / max(Σ_kept p, moe_norm_min)."""
    bias = router.moe_statics.e_score_correction_bias.reshape(-1).tolist()
    top = max(row_logits)
    exps = [math.exp(z - top) for z in row_logits]
    probabilities = [x / sum(exps) for x in exps]
    ids = _top([p + b for p, b in zip(probabilities, bias, strict=True)], list(range(len(row_logits))), width)
    total = max(sum(probabilities[e] for e in ids[:kappa]), router.norm_min)
    return ids, [probabilities[e] / total for e in ids[:kappa]]


HAND_RULES = {"deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss, "ernie4_5_moe": _ernie}


@pytest.mark.parametrize("family_name", list(HAND_RULES))
def test_family_rule_under_variable_kappa_matches_its_hand_written_reference(tiny, family_name):
    family = _family(family_name)
    model = tiny.model(family_name)
    router = next(module for module in model.modules() if type(module).__name__ == family.router)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0, generator=generator)  # spread logits: every rank decided by a margin
        if family.bias:
            bias = operator.attrgetter(family.bias)(router)
            bias.copy_(torch.randn(bias.shape, generator=generator) * 0.1)
    x = torch.randn(24, 64, generator=generator)
    width = 4  # DeepSeek-V3's tiny model keeps 2 of 4 groups of 2 experts: 4 reachable
    budgets = torch.randint(1, width + 1, (24,), generator=generator)
    plan = hf.LayerPlan(schedule=BudgetSchedule.parse(f"1-{width}", 2, 1.5, allow_off_center=True),
                        gate=hf.gate_for(router, family, ElasticConfig()),
                        sampling="iid", layer_index=None)
    logits, weights, ids = hf.elastic_routing(router, plan, x, budgets=budgets)
    # the logits the reference reads, in float64 (the rule's ranks are decided by margins far above fp32's ulp)
    if family.logits == "linear_with_bias":
        stock_logits = x.double() @ router.weight.double().T + router.bias.double()
    else:
        stock_logits = x.double() @ router.weight.double().T
    for t in range(24):
        kappa = int(budgets[t])
        expected_ids, expected_weights = HAND_RULES[family_name](router, stock_logits[t].tolist(), kappa, width)
        assert ids[t].tolist() == expected_ids, t
        assert weights[t, kappa:].eq(0).all()
        torch.testing.assert_close(weights[t, :kappa].double(), torch.tensor(expected_weights, dtype=torch.float64),
                                   rtol=2e-6, atol=1e-7)  # fp32 logits and scores against float64: a few ulps


# ------------------------------------------------------------------------------- refusal at build
def _tiny_phimoe():
    from transformers import PhimoeConfig, PhimoeForCausalLM

    config = PhimoeConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128, num_local_experts=4)
    return PhimoeForCausalLM, config


def test_an_uncovered_moe_model_is_refused_when_it_is_built_unless_allowed():
    model_class, config = _tiny_phimoe()
    hf.apply(ElasticConfig(schedule="auto"))
    with pytest.raises(ConfigError, match=r"PhimoeModel is a phimoe mixture-of-experts model \(PhimoeTopKRouter\)"
                                          r".*samples its two experts inside the forward"
                                          r".*allow_uncovered_routers=True") as refused:
        model_class(config)
    assert refused.value.field == "allow_uncovered_routers"
    hf.apply(ElasticConfig(**refused.value.fixes[0]))  # the fix the message names is accepted
    model = model_class(config)
    assert not list(hf_families.covered_routers(model))
    hf.apply(ElasticConfig(enabled=False))
    model_class(config)
    hf.remove()
    model_class(config)  # no patch, nothing refused


def test_a_schedule_wider_than_the_kept_groups_reach_is_refused_with_a_schedule_that_fits(tiny):
    model = tiny.model("deepseek_v3")  # 2 of 4 groups of 2 experts kept: 4 experts reachable
    wide = ElasticConfig(schedule="1-5", allow_off_center=True)
    with pytest.raises(ConfigError, match=r"topk_group=2 of n_group=4 expert groups \(4 experts a token can reach\), "
                                          r"fewer than the 5 candidate slots .*schedule='1-5'.*Use schedule='1-4'") as refused:
        hf.apply(wide, model=model)
        model(**tiny.inputs("deepseek_v3"))
    hf.apply(wide.replace(**refused.value.fixes[0]), model=model)
    model(**tiny.inputs("deepseek_v3"))
    assert max(int(record.budgets.max()) for record in hf.routing_records(model).values()) <= 4


@pytest.mark.parametrize("family_name,norm,warned", [("deepseek_v3", True, True), ("deepseek_v3", False, False),
                                                     ("olmoe", False, False), ("qwen3_moe", True, True)])
def test_a_schedule_reaching_one_warns_only_where_the_gate_renormalises(tiny, caplog, monkeypatch, family_name, norm,
                                                                        warned):
    """A renormalised κ = 1 weight is exactly 1 for sigmoid gates as for softmax (docs/gates.md,
    'Sigmoid gates and top-1'); an unnormalised one keeps its gradient."""
    from elastic_moe_plugin.core import plan as core_plan

    core_plan.forget_logged()
    model = tiny.model(family_name, norm_topk_prob=norm)
    with caplog.at_level("WARNING", logger="elastic_moe_plugin"):
        hf.apply(ElasticConfig(schedule="1-3"), model=model)
    assert ("tokens drawn with κ=1 get gate weight 1" in caplog.text) is warned
