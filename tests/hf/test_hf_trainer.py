"""The plain ``transformers.Trainer`` recipe of docs/transformers.md, on tiny models, on CPU.

The recipe: ``hf.apply`` before the model is built, ``output_router_logits=True`` so the aux loss
(on realised counts) joins the loss, and a ``Trainer`` subclass whose ``log`` adds
``hf.logged_metrics`` (as ``ElasticConfig.log_metrics`` says). On a tiny OLMoE, a few steps must
train (finite, decreasing-capable loss, weights move), the realised κ must vary, and its mean must
sit near the model's k. On a tiny Gemma 4, the family ms-swift cannot build on this CPU machine
(torchvision, :func:`test_gemma4_trains_elastically_and_saves_a_stock_checkpoint`), the same
recipe stands in for ``swift sft`` and ``swift infer``: the plan line, κ over the whole schedule in
both layers, and a checkpoint that a stock transformers loads and generates from. A 48-layer model
logging through transformers' ``TensorBoardCallback`` writes, per logging step, 31 names x 48
layers + the layer means with ``layers`` (the default), the 21 layer means with ``means``, nothing
with ``off``.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core import metrics
from elastic_moe_plugin.core import plan as core_plan

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


def test_gemma4_trains_elastically_and_saves_a_stock_checkpoint(tiny, tmp_path, caplog):
    """Gemma 4 (``Gemma4ForCausalLM``, ``enable_moe_block=True``: the router on the decoder layer,
    fed the normalised residual stream, beside the dense MLP; top-2 of 8 experts, 2 layers) through
    the recipe with ``ElasticConfig(schedule="1-3")``, then its checkpoint in a stock transformers:
    what ``swift sft --plugin elastic_moe`` and ``swift infer`` check for the other families in
    tests/swift/test_swift_sft.py. Checked: the plan line names the family's rule and both layers,
    4 steps with finite losses (Gemma 4 computes no load-balancing loss), κ drawn over the whole
    schedule in both layers with a mean near k, and the saved checkpoint, loaded with the patch
    removed, gives the trained model's eval logits (eval routes stock top-k) and generates.
    Tolerance of that comparison: 1e-6 on float32 logits of magnitude < 1; ``from_pretrained`` runs
    a float32 kernel path of its own (a model built from its config and loaded with the same weights
    differs from it by about 1e-7 here, without the plugin imported at all), and the untrained model's
    logits are more than 100 times the tolerance away, so the check can fail.

    Why not ms-swift: ms-swift 4.6 builds Gemma 4 (``--model_type gemma4``) as
    ``Gemma4ForConditionalGeneration`` with its ``Gemma4Processor``, which it loads with
    ``AutoProcessor.from_pretrained`` even for text-only rows; transformers' Gemma 4 image and video
    processors import torchvision unconditionally (``ModuleNotFoundError: No module named
    'torchvision'`` without it), and the PyPI torchvision wheels for torch 2.13 are CUDA-linked, so
    they do not import beside the project's CPU torch (``RuntimeError: operator torchvision::nms
    does not exist``). docs/swift.md has the detail.
    """
    core_plan.forget_logged()
    hf.apply(ElasticConfig(schedule="1-3"))  # before the model is built
    model = tiny.model("gemma4")
    ids = _TokenDataset(2, model.config.vocab_size, seed=1).ids
    with torch.no_grad():
        untrained = model.eval()(input_ids=ids).logits
    with caplog.at_level(logging.INFO, logger="elastic_moe_plugin"):
        line = hf.log_plan(model)
    assert line == ("elastic-moe plan (transformers, 2 MoE layers): elastic 1-3 around k=2 (σ=1.5), gemma4 "
                    "softmax_topk rule, renormalized gate, iid sampling: layers 0-1; static: none")
    assert [record.getMessage() for record in caplog.records].count(line) == 1
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, seed=0,
    )
    dataset = _TokenDataset(STEPS * BATCH, model.config.vocab_size)
    trainer = ElasticTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()

    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == STEPS and all(math.isfinite(entry["loss"]) and entry["loss"] > 0 for entry in logged)
    # κ ~ q on {1, 2, 3}: the same bound as the OLMoE run's (2 layers x 4 steps x 64 tokens)
    mean_kappa = sum(entry["elastic_moe/mean_kappa"] for entry in logged) / len(logged)
    assert abs(mean_kappa - 2.0) < 0.15, logged
    for layer in (0, 1):
        shares = [sum(entry[f"elastic_moe/layer_{layer}/kappa_frac_{b}"] for entry in logged) for b in (1, 2, 3)]
        assert all(share > 0 for share in shares), (layer, shares)  # every budget drawn in every layer
        # renormalised over the kept experts (per_expert_scale multiplies the weights after that)
        assert all(entry[f"elastic_moe/layer_{layer}/retained_weight_sum_mean"] == pytest.approx(1.0, abs=1e-5)
                   for entry in logged)
    records = hf.routing_records(model)
    assert set(records) == {0, 1} and all(set(r.budgets.tolist()) == {1, 2, 3} for r in records.values())

    # the checkpoint: eval routes stock top-k, so the trained model's eval logits are the stock model's
    checkpoint = tmp_path / "checkpoint"
    trainer.save_model(str(checkpoint))
    with torch.no_grad():
        trained = model.eval()(input_ids=ids).logits
    hf.remove()
    assert not hf.is_applied() and not hf.patched_symbols()
    stock = transformers.Gemma4ForCausalLM.from_pretrained(str(checkpoint)).eval()
    with torch.no_grad():
        evaluated = stock(input_ids=ids, labels=ids)
    assert torch.isfinite(evaluated.loss)
    assert (evaluated.logits - trained).abs().max() <= 1e-6
    assert (untrained - trained).abs().max() > 100 * 1e-6
    prompt = ids[:, :8]
    generated = stock.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                               do_sample=False)
    assert generated.shape == (2, 12) and torch.equal(generated[:, :8], prompt)


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

