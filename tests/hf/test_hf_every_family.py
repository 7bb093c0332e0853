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
from elastic_moe_plugin.hf import family_docs, family_table

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
    assert len(seen & covered) >= 51, sorted(seen & covered)  # found by default configs: 51 in 5.19, 66 in 5.25
    assert len(seen - covered) <= 8, sorted(seen - covered)  # refused in principle: the 8 of REFUSED


def test_the_docs_family_tables_are_generated_from_the_table():
    text = DOCS.read_text()
    assert family_docs.with_tables(text) == text, "run `make docs`"


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
