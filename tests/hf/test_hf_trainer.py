"""The plain ``transformers.Trainer`` recipe of docs/transformers.md, on a tiny OLMoE, on CPU.

The recipe: ``hf.apply`` before the model is built, ``output_router_logits=True`` so the aux loss
(on realised counts) joins the loss, and a ``Trainer`` subclass whose ``log`` adds
``hf.routing_metrics``. A few steps must train (finite, decreasing-capable loss, weights move),
the realised κ must vary, and its mean must sit near the model's k.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_clean")]

STEPS, BATCH, SEQ = 4, 4, 16


class _TokenDataset(torch.utils.data.Dataset):
    """Random token sequences; labels = inputs (causal LM), full attention masks."""

    def __init__(self, size: int, vocab: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (size, SEQ), generator=generator)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index]
        return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


# The class from docs/transformers.md, verbatim.
class ElasticTrainer(transformers.Trainer):
    def log(self, logs, *args, **kwargs):
        if self.model.training:  # training logs only; evaluation routes static top-k
            logs.update(hf.routing_metrics(self.model))  # mean κ, κ shares, load imbalance, ...
            hf.reset_budget_histograms(self.model)  # so each log covers the steps since the last
        super().log(logs, *args, **kwargs)


def test_trainer_recipe_trains_with_varying_budgets(tiny, tmp_path):
    hf.apply(ElasticConfig(schedule="1-3"))  # before the model is built
    model = tiny.model("olmoe", output_router_logits=True)
    before = model.model.layers[0].mlp.gate.weight.detach().clone()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, seed=0,
    )
    trainer = ElasticTrainer(model=model, args=args, train_dataset=_TokenDataset(STEPS * BATCH, model.config.vocab_size))
    result = trainer.train()

    assert trainer.state.global_step == STEPS and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(model.model.layers[0].mlp.gate.weight.detach(), before)
    # one log per step (logging_steps=1); the end-of-training summary log carries the metrics too
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all("elastic_moe/mean_kappa" in entry for entry in logged)
    assert len(logged) == STEPS
    assert {"elastic_moe/layer_0/mean_kappa", "elastic_moe/layer_1/mean_kappa", "elastic_moe/layer_0/kappa_frac_3",
            "elastic_moe/tokens_per_expert_max_over_mean"} <= set(logged[0])
    # κ ~ q on {1, 2, 3} around k = 2: SD 0.78, so the mean of 2 layers x 4 steps x 64 tokens is
    # 2 ± 0.035 (1 s.e.); 0.15 is > 4 standard errors.
    mean_kappa = sum(entry["elastic_moe/mean_kappa"] for entry in logged) / len(logged)
    assert abs(mean_kappa - 2.0) < 0.15, logged
    records = hf.routing_records(model)
    assert set(records) == {0, 1}
    for record in records.values():
        assert set(record.budgets.tolist()) == {1, 2, 3}
    assert len({entry["elastic_moe/mean_kappa"] for entry in logged}) > 1  # varies between steps
