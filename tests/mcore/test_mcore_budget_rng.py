"""κ's own stream on the Megatron path (``elastic_moe_plugin.mcore.budget_rng``), router level.

- it is a named state of Megatron's RNG tracker, seeded with ``BUDGET_SEED_OFFSET`` + Megatron's
  seed (``model_parallel_cuda_manual_seed``);
- drawing κ leaves the default generator alone, and consuming the default generator (dropout, data
  shuffling) leaves κ alone;
- restoring the tracker states as ``load_checkpoint`` does continues the κ sequence exactly; a
  checkpoint without the state (a static or stock run) gets a fresh one at the next draw.

The end-to-end resume through ``megatron.training`` (save at 5, resume to 10) is in
``tests/mcore/test_megatron_lm.py``; recompute replay in ``test_mcore_gpt.py`` and
``test_mcore_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.core.schedule import BUDGET_SEED_OFFSET
from elastic_moe_plugin.mcore import budget_rng

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

S, B, H = 16, 2, 16
SEED = 1234


def _tracker():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def _kappa(router, x):
    router(x)
    return mcore.routing_records(router)[0].budgets.clone()


@pytest.fixture
def router(make_config, make_router):
    from megatron.core import tensor_parallel

    # Megatron-LM's _set_random_seed: torch.manual_seed(seed), then model_parallel_cuda_manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    mcore.apply(ElasticConfig(schedule="1-3"))
    return make_router(make_config(), seed=SEED)


def test_the_stream_is_a_tracker_state_seeded_from_megatrons_seed(router):
    states = _tracker().get_states()
    assert budget_rng.BUDGET_RNG_NAME in states, "an elastic router registers the stream when it is built"
    expected = torch.Generator().manual_seed(SEED + BUDGET_SEED_OFFSET).get_state()
    assert torch.equal(states[budget_rng.BUDGET_RNG_NAME], expected)


def test_a_static_schedule_registers_nothing(make_config, make_router):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    mcore.apply(ElasticConfig(schedule="static"))
    make_router(make_config())(torch.randn(S, B, H))
    assert budget_rng.BUDGET_RNG_NAME not in _tracker().get_states()


def test_kappa_and_the_default_generator_leave_each_other_alone(router):
    x = torch.randn(S, B, H)
    stream = budget_rng.state()
    before = torch.default_generator.get_state()
    first = _kappa(router, x)
    assert torch.equal(torch.default_generator.get_state(), before), "drawing κ moved the default generator"
    assert len(set(first.tolist())) > 1

    _tracker().set_states({**_tracker().get_states(), budget_rng.BUDGET_RNG_NAME: stream})
    torch.rand(1000)  # dropout, data shuffling, ...: other consumers of the default generator
    torch.manual_seed(99)
    assert torch.equal(_kappa(router, x), first), "another consumer of the default generator moved κ"


def test_restoring_the_tracker_states_continues_the_kappa_sequence(router):
    """What save_checkpoint stores (``get_states()``) and load_checkpoint restores (``set_states``)."""
    x = torch.randn(S, B, H)
    _kappa(router, x)  # step 1
    saved = {name: state.clone() for name, state in _tracker().get_states().items()}  # "checkpoint"
    uninterrupted = [_kappa(router, x) for _ in range(3)]  # steps 2-4
    assert not torch.equal(uninterrupted[0], uninterrupted[1])
    _tracker().set_states(saved)  # "resume"
    resumed = [_kappa(router, x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))


def test_a_checkpoint_without_the_stream_gets_a_fresh_one(router):
    """A checkpoint saved by a static or stock run holds Megatron's states only; the tracker still
    has our seed booked (set_states keeps ``seeds_``), which must not stop the re-registration."""
    x = torch.randn(S, B, H)
    first = _kappa(router, x)
    stock_states = {name: s for name, s in _tracker().get_states().items() if name != budget_rng.BUDGET_RNG_NAME}
    _tracker().set_states(stock_states)
    assert torch.equal(_kappa(router, x), first), "a fresh stream is seeded exactly like the first"
