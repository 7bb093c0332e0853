"""κ's own stream on the transformers path (``elastic_moe_plugin.hf.budget_rng``), on real models.

- drawing κ leaves the default generator alone, and other consumers of the default generator
  (dropout, data shuffling) leave κ alone;
- a ``Trainer`` run saved at step 3 and resumed to 6 draws exactly the κ of the uninterrupted
  6-step run, with gradient checkpointing on: the generator state travels in the Trainer's
  ``rng_state.pth``. (The losses are not compared: on this CPU setup the Trainer's own resume
  differs from the uninterrupted run in the 4th digit with the plugin off as well.)
- a recompute that cannot be matched to its forward is an error naming the cause;
- an explicit re-seed (`transformers.set_seed`, i.e. `torch.manual_seed`) restarts κ's stream, other
  random draws after it do not move κ, and `hf.remove()` takes the hook away.

Gradient checkpointing's exact replay (gradients, budgets, histograms) is in ``test_hf_adapter.py``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from elastic_moe_plugin import ElasticConfig, hf
from elastic_moe_plugin.core.budget_stream import BudgetStream
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET
from elastic_moe_plugin.hf import budget_rng
from elastic_moe_plugin.core.records import latest_record

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("hf_clean")]

STEPS, BATCH, SEQ = 6, 4, 16


def test_kappa_and_the_default_generator_leave_each_other_alone(tiny):
    hf.apply(ElasticConfig(schedule="1-3"))
    model = tiny.model("olmoe")
    router = model.model.layers[0].mlp.gate
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))

    torch.manual_seed(5)
    budget_rng.reset()
    before = torch.default_generator.get_state()
    router(hidden)
    first = latest_record(router).budgets.clone()
    assert torch.equal(torch.default_generator.get_state(), before), "drawing κ moved the default generator"

    torch.manual_seed(5)
    budget_rng.reset()
    torch.rand(1000)  # dropout, data shuffling, ...
    router(hidden)
    assert torch.equal(latest_record(router).budgets, first), "another consumer of the default generator moved κ"
    assert len(set(first.tolist())) == 3


def test_a_recompute_without_its_forward_is_an_error(tiny):
    from elastic_moe_plugin.core.plan import LayerPlan
    from elastic_moe_plugin.hf.routing import resolve_state

    hf.apply(ElasticConfig(schedule="1-3"))
    router = tiny.model("olmoe").model.layers[0].mlp.gate
    layer_plan = LayerPlan(schedule=ElasticConfig(schedule="1-3").budget_schedule(2), gate="renormalized",
                           sampling="iid", layer_index=0)
    state = resolve_state(router, hf.covered_router_classes()[type(router)], layer_plan, None)
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"recompute .* routes 16 tokens.*drew κ for none"):
        budget_rng.replayed_draw(router, state, 16, cpu)
    state.draw(state.path, 8, cpu, replayable=True)
    with pytest.raises(RuntimeError, match=r"drew κ for 8 tokens"):
        budget_rng.replayed_draw(router, state, 16, cpu)


class _TokenDataset(torch.utils.data.Dataset):
    def __init__(self, size: int, vocab: int):
        self.ids = torch.randint(3, vocab, (size, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index]
        return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


class _KappaPerStep(transformers.TrainerCallback):
    """κ of every layer after each optimizer step (one micro-batch per step)."""

    def __init__(self, model):
        self.model, self.steps = model, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.steps[state.global_step] = {layer: record.budgets.clone()
                                         for layer, record in hf.routing_records(self.model).items()}


def _train(tiny, output_dir, *, max_steps, resume_from=None, save_steps=None):
    model = tiny.model("olmoe", output_router_logits=True)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        logging_steps=1, report_to="none", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, gradient_checkpointing=True,
    )
    kappa = _KappaPerStep(model)
    trainer = transformers.Trainer(model=model, args=args, callbacks=[kappa],
                                   train_dataset=_TokenDataset(STEPS * BATCH, model.config.vocab_size))
    trainer.train(resume_from_checkpoint=resume_from)
    return kappa.steps


@pytest.mark.slow
def test_a_resumed_trainer_run_continues_the_kappa_sequence(tiny, tmp_path):
    hf.apply(ElasticConfig(schedule="1-3"))
    kappa = _train(tiny, tmp_path / "uninterrupted", max_steps=STEPS, save_steps=3)
    checkpoint = tmp_path / "uninterrupted" / "checkpoint-3"
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():  # as the Trainer reads it
        saved = torch.load(checkpoint / "rng_state.pth", weights_only=True)
    # the Trainer's rng_state carries κ's stream: seed 0 (TrainingArguments.seed), 3 steps × 2 layers drawn
    assert saved[budget_rng.RNG_STATE_KEY] == {"seed": BUDGET_SEED_OFFSET, "counter": 3 * 2}

    budget_rng.reset()
    torch.manual_seed(123)  # whatever the resumed process does first must not matter
    torch.rand(1000)
    resumed_kappa = _train(tiny, tmp_path / "resumed", max_steps=STEPS, resume_from=str(checkpoint))
    assert sorted(resumed_kappa) == [4, 5, 6]
    for step in (4, 5, 6):
        for layer in (0, 1):
            assert torch.equal(resumed_kappa[step][layer], kappa[step][layer]), f"step {step}, layer {layer}"
    assert not torch.equal(kappa[4][0], kappa[5][0])


# ------------------------------------------------------------------------------- an explicit re-seed
def _two_steps(tiny, *, between=None):
    """Build a model from the default generator as it is, run ``between`` (other random draws), then
    two training steps; (κ of every layer and step, the losses)."""
    config = tiny.config("olmoe")
    model = transformers.OlmoeForCausalLM(config).train()
    if between is not None:
        between()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(3, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
    kappa, losses = [], []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        kappa.append([record.budgets.clone() for record in hf.routing_records(model).values()])
        losses.append(loss.item())
    return kappa, losses


def _same_kappa(a, b) -> bool:
    return all(torch.equal(x, y) for step_a, step_b in zip(a, b) for x, y in zip(step_a, step_b))


def test_set_seed_twice_in_one_process_gives_the_same_kappa_and_losses(tiny):
    """``torch.initial_seed()`` is 42 both times, so only the re-seed hook can restart κ's stream."""
    hf.apply(ElasticConfig(schedule="1-3"))
    transformers.set_seed(42)
    kappa, losses = _two_steps(tiny)
    assert len(set(kappa[0][0].tolist())) == 3 and not torch.equal(kappa[0][0], kappa[1][0])
    transformers.set_seed(42)
    kappa_again, losses_again = _two_steps(tiny)
    assert _same_kappa(kappa, kappa_again)
    assert losses == losses_again
    transformers.set_seed(43)
    assert not _same_kappa(kappa, _two_steps(tiny)[0]), "another seed, another κ"


def test_random_draws_after_set_seed_do_not_move_kappa(tiny):
    import random

    import numpy as np

    hf.apply(ElasticConfig(schedule="1-3"))
    transformers.set_seed(42)
    kappa, losses = _two_steps(tiny)

    def other_consumers():  # data shuffling, dropout masks, augmentation: every other generator
        torch.rand(1000)
        torch.randperm(100, generator=torch.Generator().manual_seed(1))
        random.random()
        np.random.rand(10)

    transformers.set_seed(42)
    kappa_after_draws, losses_after_draws = _two_steps(tiny, between=other_consumers)
    assert _same_kappa(kappa, kappa_after_draws)
    assert losses == losses_after_draws  # dropout is off: the draws touch nothing the model reads


def test_remove_takes_the_re_seed_hook_away(tiny):
    hf.apply(ElasticConfig(schedule="1-3"))
    torch.manual_seed(5)
    assert budget_rng.current_stream() == BudgetStream(BUDGET_SEED_OFFSET + 5, 0)
    hf.remove()
    torch.manual_seed(6)
    assert budget_rng.current_stream() == BudgetStream(BUDGET_SEED_OFFSET + 5, 0), "no hook once removed"
