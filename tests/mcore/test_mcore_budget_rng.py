"""κ's own stream on the Megatron path (``elastic_moe_plugin.mcore.budget_rng``), router level.

- it is a named state of Megatron's RNG tracker, the stream ``(seed, counter)`` as a 16-byte CUDA
  Philox state, seeded with ``BUDGET_SEED_OFFSET`` + Megatron's seed
  (``model_parallel_cuda_manual_seed``), which a re-seed resets;
- each draw is the closed form of ``core.budget_stream`` at (seed, counter, shard) and advances the
  counter by one whatever T (T = 0 included), replacing the entry rather than mutating it;
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
from elastic_moe_plugin.core.budget_stream import BudgetStream
from elastic_moe_plugin.core.router_state import state_of
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
    expected = BudgetStream(SEED + BUDGET_SEED_OFFSET, 0).to_state_tensor()
    assert torch.equal(states[budget_rng.BUDGET_RNG_NAME], expected)
    # the layout of a CUDA Philox generator state: seed, then offset 4·counter (little-endian)
    assert expected.tolist()[:8] == list((SEED + BUDGET_SEED_OFFSET).to_bytes(8, "little"))
    assert expected.tolist()[8:] == [0] * 8


def test_each_draw_is_the_closed_form_and_advances_the_counter_by_one_whatever_t(router):
    """κ of draw c = the core stream's draw (seed, c, shard 0); T varies, T = 0 included; every
    draw stores a new entry object (a recompute snapshot keeps the old one)."""
    schedule = mcore.active_config().budget_schedule(2)
    seed = SEED + BUDGET_SEED_OFFSET
    for counter, tokens in enumerate((S, 3, 0, 1, S)):
        before = _tracker().get_states()[budget_rng.BUDGET_RNG_NAME]
        assert budget_rng.stream() == BudgetStream(seed, counter)
        x = torch.randn(tokens, B, H)
        if tokens:
            kappa = _kappa(router, x)
        else:  # Megatron's router gating cannot take T = 0 (a view of 0 elements): the stream's draw itself
            kappa = budget_rng.draw(schedule, "iid", 0, 0, "cpu").budgets
        expected = BudgetStream(seed, counter).draw(schedule, "iid", 0, tokens * B if tokens else 0)[0]
        assert torch.equal(kappa, expected.budgets), f"draw {counter}"
        if tokens:
            assert state_of(router).latest_draw.total == int(kappa.sum())
        after = _tracker().get_states()[budget_rng.BUDGET_RNG_NAME]
        assert after is not before and torch.equal(before, BudgetStream(seed, counter).to_state_tensor())
    assert budget_rng.stream() == BudgetStream(seed, 5)


def test_model_parallel_cuda_manual_seed_resets_the_stream(router):
    """An explicit re-seed reaches κ: the same seed gives the same κ again, whatever was drawn in
    between from the default generator."""
    from megatron.core import tensor_parallel

    x = torch.randn(S, B, H)
    first = [_kappa(router, x) for _ in range(2)]
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    torch.rand(1000)  # data, dropout, initialisation draws
    again = [_kappa(router, x) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    tensor_parallel.model_parallel_cuda_manual_seed(SEED + 1)
    assert not torch.equal(_kappa(router, x), first[0])


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


def test_the_entries_made_ahead_are_each_streams_own_state():
    """The tracker entries are made for the next counters together: whatever the order of the
    streams stored (consecutive, back, a jump, another seed, the last counters a state holds), each
    entry is that stream's own state tensor, a new object for every counter."""
    from elastic_moe_plugin.core import budget_stream

    ahead = budget_stream._EntriesAhead()  # the unit test of this private class itself
    last = (1 << 62) - 1  # the last counter a 16-byte state holds (offset 4·counter, 64 bits)
    order = [(7, 0), (7, 1), (7, 2), (7, 1), (7, 63), (7, 64), (7, 5000), (9, 5001), (7, last - 1), (7, last), (7, 0)]
    seen = {}
    for seed, counter in order:
        stream = BudgetStream(seed, counter)
        entry = ahead.get(stream)
        assert torch.equal(entry, stream.to_state_tensor()), (seed, counter)
        assert BudgetStream.from_state(entry) == stream
        assert all(other is not entry for key, other in seen.items() if key != (seed, counter))
        seen[(seed, counter)] = entry
