"""What ``swift sft``'s ``elastic_moe`` callback adds to a training log, under each ``log_metrics``.

In process: the callback class ``--callbacks elastic_moe`` registers (ms-swift's own ``TrainerCallback``
base) runs its ``on_log`` on a 48-layer OLMoE (16 experts, top-8, schedule 6-10, hidden 32) after one
training forward, then transformers' ``TensorBoardCallback`` writes the same ``logs`` into a writer that
counts, as in a ``swift sft --report_to tensorboard`` run (the callback runs first). A logging step
writes 31 names x 48 layers + the 5 layer means beside them (``layers``, the default), the 21 layer
means (``means``: <= 40), or nothing of ours (``off``, the κ histograms left alone).
"""

from __future__ import annotations

import types

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core import metrics

pytestmark = [pytest.mark.swift, pytest.mark.hf]

LAYERS, EXPERTS, TOPK = 48, 16, 8


class CountingWriter:
    """A ``SummaryWriter`` stand-in: every tag ``TensorBoardCallback.on_log`` writes."""

    def __init__(self):
        self.tags: list[str] = []

    def add_scalar(self, tag, value, global_step=None, *args, **kwargs):
        self.tags.append(tag)

    def add_text(self, *args, **kwargs):
        pass

    def flush(self):
        pass


@pytest.fixture
def elastic_48_layers():
    """``make(log_metrics)`` -> a 48-layer OLMoE after one training forward under that setting."""
    import transformers

    def make(log_metrics: str):
        hf.apply(ElasticConfig(schedule="6-10", log_metrics=log_metrics))
        config = transformers.OlmoeConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=128, num_experts=EXPERTS, num_experts_per_tok=TOPK,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
        torch.manual_seed(0)
        model = transformers.OlmoeForCausalLM(config).train()
        model(input_ids=torch.randint(3, 128, (2, 16)))
        return model

    hf.remove()
    yield make
    hf.remove()


@pytest.mark.parametrize("log_metrics", ["layers", "means", "off"])
def test_the_swift_callback_logs_what_log_metrics_says(elastic_48_layers, log_metrics, tmp_path):
    from transformers import TrainingArguments
    from transformers.integrations import TensorBoardCallback
    from transformers.trainer_callback import TrainerControl, TrainerState

    from elastic_moe_plugin.swift.callbacks import hf_callback_class

    model = elastic_48_layers(log_metrics)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    state, control = TrainerState(global_step=1, is_world_process_zero=True), TrainerControl()
    callback = hf_callback_class()(args, types.SimpleNamespace(model=model))
    logs = {"loss": 1.0, "grad_norm": 0.5, "learning_rate": 1e-5}
    callback.on_log(args, state, control, logs=logs, model=model)
    writer = CountingWriter()
    TensorBoardCallback(tb_writer=writer).on_log(args, state, control, logs=logs)

    names = metrics.metric_names(ElasticConfig(schedule="6-10").budget_schedule(TOPK), EXPERTS)
    means = [name for name in names if not metrics.is_schedule_constant(name)]
    beside_layers = [name for name in metrics.SUMMARY_NAMES if name in names]
    assert (len(names), len(means), len(beside_layers)) == (31, 21, 5)
    ours = [tag for tag in writer.tags if tag.startswith("train/elastic_moe/")]
    expected = {"layers": len(names) * LAYERS + len(beside_layers), "means": len(means), "off": 0}[log_metrics]
    assert "train/loss" in writer.tags and len(ours) == len(set(ours)) == expected
    if log_metrics == "means":
        assert set(ours) == {f"train/elastic_moe/{name}" for name in means} and len(ours) <= 40
    # off reads nothing: the κ histograms keep the forward's 32 tokens (else they are reset after the log)
    counted = {int(histogram.sum()) for histogram in hf.budget_histograms(model).values()}
    assert counted == ({32} if log_metrics == "off" else {0})
