"""ms-swift's own way of choosing the experts implementation (``--experts_impl``) is followed.

``swift sft --experts_impl X`` reaches transformers through ms-swift's model loader, which passes
``experts_implementation=X`` to ``from_pretrained`` (``swift.model.register``). This loads the tiny
OLMoE through that same loader, in process, and counts the rows its experts multiply in an elastic
training forward (``counters.ExpertRows``, at the GEMMs): Σκ per layer, in every
implementation, with the patch applied before or after the load.
"""

from __future__ import annotations

import pytest
import torch
from elastic_moe_plugin import ElasticConfig, hf
from counters import ExpertRows

pytestmark = [pytest.mark.swift, pytest.mark.slow]


@pytest.fixture
def swift_loaded(tiny_assets, monkeypatch):
    for name, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}.items():
        monkeypatch.setenv(name, value)
    from swift.model import get_model_processor

    def load(experts_impl: str):
        model, _ = get_model_processor(str(tiny_assets.model_dir("olmoe")), model_type="olmoe",
                                       experts_impl=experts_impl, download_model=False)
        return model.train()

    hf.remove()
    yield load
    hf.remove()


@pytest.mark.parametrize("apply_first", [True, False], ids=["apply-then-load", "load-then-apply"])
@pytest.mark.parametrize("experts_impl", ["eager", "grouped_mm", "batched_mm"])
def test_swift_loader_choice_of_experts_implementation_follows_kappa(swift_loaded, experts_impl, apply_first):
    config = ElasticConfig(schedule="1-3")  # the tiny OLMoE is top-2
    if apply_first:
        hf.apply(config)
    model = swift_loaded(experts_impl)
    if not apply_first:
        hf.apply(config)
    assert model.config._experts_implementation == experts_impl
    ids = torch.randint(10, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    with ExpertRows(model) as counted:
        model(input_ids=ids)
    records = hf.routing_records(model)
    assert set(records) == {0, 1}
    assert counted.rows == {f"model.layers.{i}.mlp.experts": int(records[i].budgets.sum()) for i in (0, 1)}
    assert all(rows < ids.numel() * 3 for rows in counted.rows.values())  # fewer than all b = 3 slots
