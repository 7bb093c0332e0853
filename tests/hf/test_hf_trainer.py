"""The plain ``transformers.Trainer`` recipe of docs/transformers.md, on a tiny OLMoE, on CPU.

The recipe: ``hf.apply`` before the model is built, ``output_router_logits=True`` so the aux loss
(on realised counts) joins the loss, and a ``Trainer`` subclass whose ``log`` adds
``hf.logged_metrics`` (as ``ElasticConfig.log_metrics`` says). A few steps must train (finite,
decreasing-capable loss, weights move), the realised κ must vary, and its mean must sit near the
model's k. A 48-layer model logging through transformers' ``TensorBoardCallback`` writes, per logging
step, 31 names x 48 layers + the layer means with ``layers`` (the default), the 21 layer means with
``means``, nothing with ``off``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core import metrics

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
            logs.update(hf.logged_metrics(self.model))  # mean κ, κ shares, load imbalance, ... (log_metrics)
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


class CountingWriter:
    """A ``SummaryWriter`` for transformers' ``TensorBoardCallback``: the tags of each log (one list per
    ``on_log``, which ends with ``flush()``)."""

    def __init__(self):
        self.logs: list[list[str]] = [[]]

    def add_scalar(self, tag, value, global_step=None, *args, **kwargs):
        self.logs[-1].append(tag)

    def add_text(self, *args, **kwargs):
        pass

    def flush(self):
        self.logs.append([])

    def close(self):
        pass


@pytest.mark.parametrize("log_metrics", ["layers", "means", "off"])
def test_a_logging_step_of_48_moe_layers_writes_what_log_metrics_says(tiny, tmp_path, log_metrics):
    """The recipe's Trainer on a 48-layer OLMoE (16 experts, top-8, schedule 6-10, hidden 32), TensorBoard
    through transformers' own callback into a writer that counts: a logging step writes 31 names x 48
    layers + the 5 layer means next to them (``layers``), the 21 layer means (``means``: <= 40), or
    nothing of ours (``off``)."""
    from transformers.integrations import TensorBoardCallback

    hf.apply(ElasticConfig(schedule="6-10", log_metrics=log_metrics))
    model = tiny.model("olmoe", num_hidden_layers=48, num_experts=16, num_experts_per_tok=8, hidden_size=32,
                       intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
    writer = CountingWriter()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    trainer = ElasticTrainer(model=model, args=args, train_dataset=_TokenDataset(2, model.config.vocab_size),
                             callbacks=[TensorBoardCallback(tb_writer=writer)])
    trainer.train()

    names = metrics.metric_names(ElasticConfig(schedule="6-10").budget_schedule(8), 16)
    means = [name for name in names if not metrics.is_schedule_constant(name)]
    beside_layers = [name for name in metrics.SUMMARY_NAMES if name in names]
    assert (len(names), len(means), len(beside_layers)) == (31, 21, 5)
    ours = [tag for tag in writer.logs[0] if tag.startswith("train/elastic_moe/")]  # the step's log
    expected = {"layers": len(names) * 48 + len(beside_layers), "means": len(means), "off": 0}[log_metrics]
    assert "train/loss" in writer.logs[0] and len(ours) == len(set(ours)) == expected
    if log_metrics == "means":
        assert set(ours) == {f"train/elastic_moe/{name}" for name in means} and len(ours) <= 40

