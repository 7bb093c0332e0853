"""κ's counter-based stream (``elastic_moe_plugin.core.budget_stream``) against a hand-written
Philox4x64-10 and the schedule's own mapping; framework-free."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from elastic_moe_plugin.core.budget_stream import BudgetStream, ProcessStream, to_device
from elastic_moe_plugin.core.router_state import state_of
from elastic_moe_plugin.core.schedule import BudgetSchedule

SCHEDULE = BudgetSchedule.parse("6-10", center=8)
MASK = (1 << 64) - 1


def _philox4x64_10(counter: list[int], key: list[int]) -> list[int]:
    """Salmon et al. (SC'11), Random123's philox4x64 with 10 rounds, in Python integers."""
    m0, m1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
    w0, w1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B
    x, k = list(counter), list(key)
    for round_index in range(10):
        if round_index:
            k = [(k[0] + w0) & MASK, (k[1] + w1) & MASK]
        p0, p1 = m0 * x[0], m1 * x[2]
        x = [(p1 >> 64) ^ x[1] ^ k[0], p1 & MASK, (p0 >> 64) ^ x[3] ^ k[1], p0 & MASK]
    return x


def _hand_uniforms(seed: int, counter: int, shard: int, num_tokens: int) -> list[float]:
    """The module docstring's formula: block j = Philox(key=(seed, shard), counter=(j, c, 0, 0)),
    j = 1, 2, ...; u = (x >> 11)·2^-53 of the words in order."""
    words: list[int] = []
    block = 1
    while len(words) < num_tokens:
        words += _philox4x64_10([block, counter, 0, 0], [seed, shard])
        block += 1
    return [(word >> 11) * 2.0**-53 for word in words[:num_tokens]]


@pytest.mark.parametrize("seed, counter, shard, tokens", [(2_147_483_647 + 1234, 0, 0, 9), (5, 7, 3, 13),
                                                          (MASK, 2**40, 1023, 6), (0, 0, 0, 0)])
def test_uniforms_are_philox_keyed_by_seed_and_shard_at_the_draw_counter(seed, counter, shard, tokens):
    got = BudgetStream(seed, counter).uniforms(shard, tokens)
    assert got.dtype == np.float64 and got.shape == (tokens,)
    assert got.tolist() == _hand_uniforms(seed, counter, shard, tokens)


def test_uniforms_do_not_depend_on_the_draws_before_them():
    """The generator kept per key is re-aimed at every draw: interleaved keys and counters, a
    repeated draw and a longer one in between give each draw its own hand-computed uniforms."""
    order = [(7, 3, 0, 9), (7, 4, 0, 5), (7, 3, 1, 9), (8, 3, 0, 30), (7, 3, 0, 9), (7, 3, 0, 2)]
    for seed, counter, shard, tokens in order:
        assert BudgetStream(seed, counter).uniforms(shard, tokens).tolist() == _hand_uniforms(seed, counter, shard, tokens)


def test_a_draw_maps_the_uniforms_with_the_schedule_and_advances_the_counter_by_one():
    stream = BudgetStream(11, 4)
    for sampling in ("iid", "balanced"):
        draw, advanced = stream.draw(SCHEDULE, sampling, 2, 40)
        uniforms = torch.tensor(_hand_uniforms(11, 4, 2, 40), dtype=torch.float64)
        assert torch.equal(draw.budgets, SCHEDULE.budgets_from_uniforms(uniforms, sampling))
        assert advanced == BudgetStream(11, 5)
        assert draw.total == int(draw.budgets.sum()) and draw.host_budgets.tolist() == draw.budgets.tolist()
    assert stream.draw(SCHEDULE, "balanced", 2, 40)[0].total == 40 * 8


@pytest.mark.parametrize("tokens", [0, 1, 7, 4096])
def test_the_counter_advances_by_one_whatever_t_and_for_a_static_schedule(tokens):
    for schedule in (SCHEDULE, BudgetSchedule.static(8)):
        draw, advanced = BudgetStream(3, 9).draw(schedule, "iid", 5, tokens)
        assert advanced.counter == 10 and draw.budgets.shape == (tokens,)
    assert torch.equal(BudgetStream(3, 9).draw(BudgetSchedule.static(8), "iid", 5, tokens)[0].budgets,
                       torch.full((tokens,), 8))


def test_token_t_gets_the_same_uniform_whatever_t():
    long, short = BudgetStream(8, 2).uniforms(1, 37), BudgetStream(8, 2).uniforms(1, 5)
    assert long[:5].tolist() == short.tolist()
    iid_long = BudgetStream(8, 2).draw(SCHEDULE, "iid", 1, 37)[0].budgets
    assert torch.equal(iid_long[:5], BudgetStream(8, 2).draw(SCHEDULE, "iid", 1, 5)[0].budgets)


def test_no_two_shards_or_draws_share_uniforms():
    seen = [BudgetStream(21, counter).uniforms(shard, 512) for counter in range(3) for shard in range(8)]
    pooled = np.concatenate(seen)
    assert np.unique(pooled).size == pooled.size


def test_iid_budgets_follow_the_pmf():
    budgets = BudgetStream(1).draw(SCHEDULE, "iid", 0, 40_000)[0].budgets
    for budget, probability in zip(SCHEDULE.budgets, SCHEDULE.pmf):
        observed = float((budgets == budget).double().mean())
        assert abs(observed - probability) < 4 * math.sqrt(probability * (1 - probability) / budgets.numel())


def _hand_mapping(schedule, uniforms, sampling):
    """κ of the uniforms by the schedule's rule, token by token: iid inverts the CDF (κ = low +
    #{r < high : CDF(r) <= u}); balanced hands the sorted multiset of balanced_counts to the tokens
    in the order of their uniforms, ties by token index."""
    cdf, total = [], 0.0
    for probability in schedule.pmf[:-1]:
        total += probability
        cdf.append(total)
    if sampling == "iid":
        return [schedule.low + sum(1 for threshold in cdf if threshold <= u) for u in uniforms]
    multiset = [budget for budget, count in sorted(schedule.balanced_counts(len(uniforms)).items()) for _ in range(count)]
    order = sorted(range(len(uniforms)), key=lambda t: (uniforms[t], t))
    budgets = [0] * len(uniforms)
    for rank, token in enumerate(order):
        budgets[rank] = multiset[token]
    return budgets


@pytest.mark.parametrize("sampling", ["iid", "balanced"])
def test_the_one_mapping_matches_the_hand_rule_ties_included(sampling):
    generator = torch.Generator().manual_seed(0)
    for tokens in (1, 2, 5, 64, 1000, 2049):
        uniforms = torch.rand(tokens, dtype=torch.float64, generator=generator)
        if tokens > 4:  # ties: balanced ranks them by token index
            uniforms[3] = uniforms[1] = uniforms[tokens - 1]
        mapped = SCHEDULE.budgets_from_uniforms(uniforms.numpy(), sampling)
        assert mapped.dtype == np.int64
        assert mapped.tolist() == _hand_mapping(SCHEDULE, uniforms.tolist(), sampling), tokens
        assert torch.equal(SCHEDULE.budgets_from_uniforms(uniforms, sampling), torch.from_numpy(mapped))


def test_the_state_tensor_is_a_cuda_philox_state_and_round_trips():
    stream = BudgetStream(2**63 + 5, 123)
    state = stream.to_state_tensor()
    assert state.dtype == torch.uint8 and state.shape == (16,)
    assert int.from_bytes(bytes(state.tolist()[:8]), "little") == 2**63 + 5
    assert int.from_bytes(bytes(state.tolist()[8:]), "little") == 4 * 123  # a CUDA offset: a multiple of 4
    assert BudgetStream.from_state(state) == stream
    with pytest.raises(ValueError, match="16-byte"):
        BudgetStream.from_state(torch.get_rng_state())  # a CPU generator's state is no stream
    with pytest.raises(ValueError, match="offset 4·counter"):
        BudgetStream.from_state(torch.tensor([0] * 8 + [2] + [0] * 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="counter=-1"):
        BudgetStream(0, -1)


def test_cpu_budgets_are_the_host_array_and_nothing_is_kept_on_a_bare_module():
    host = np.arange(4, dtype=np.int64)
    on_cpu = to_device(host, "cpu")
    host[0] = 9
    assert on_cpu[0] == 9, "a CPU device gets the host array itself, no copy"
    assert state_of(torch.nn.Linear(1, 1)) is None


def _reference_draw(schedule, sampling, seed, counter, shard, tokens):
    uniforms = np.array(_hand_uniforms(seed, counter, shard, tokens), dtype=np.float64)
    return schedule.budgets_from_uniforms(uniforms, sampling)


def _home_draw(home, seed, counter, schedule, sampling, shard, tokens):
    """One draw of a stream home placed at (seed, counter); the home's stream after it."""
    home.replace(BudgetStream(seed, counter))
    drawn = home.draw(schedule, sampling, shard, tokens, "cpu")
    return drawn, home.load()


def test_draws_made_ahead_are_each_their_own_draw():
    """A stream home draws from blocks of consecutive counters made together: every pattern a
    training run produces (consecutive layers, a recompute going back, a jump, T growing and
    shrinking, two schedules in one model, balanced sampling, another shard, the last counters
    before 2^64) gives the hand-computed κ of that very draw, with its own Σκ and histogram."""

    home = ProcessStream(lambda: 0)
    narrow = BudgetSchedule.parse("7-9", center=8)
    seed = 99
    pattern = [  # (counter, tokens, schedule, sampling, shard)
        (0, 24, SCHEDULE, "iid", 0), (1, 24, SCHEDULE, "iid", 0), (2, 24, narrow, "iid", 0), (3, 24, SCHEDULE, "iid", 0),
        (1, 24, SCHEDULE, "iid", 0),  # recompute: behind the block
        (4, 40, SCHEDULE, "iid", 0),  # T grows past the block's width
        (5, 7, SCHEDULE, "iid", 0), (6, 40, narrow, "iid", 0), (7, 33, SCHEDULE, "balanced", 0),
        (8, 40, SCHEDULE, "balanced", 0),  # balanced at the block's width: mapped with the block
        (8, 24, SCHEDULE, "iid", 3), (9, 24, SCHEDULE, "iid", 0),
        (500, 24, SCHEDULE, "iid", 0),  # a jump (a resumed run)
        (MASK - 1, 12, SCHEDULE, "iid", 0), (MASK, 12, SCHEDULE, "iid", 0), (0, 12, SCHEDULE, "iid", 0),
    ]
    for counter, tokens, schedule, sampling, shard in pattern:
        drawn, advanced = _home_draw(home, seed, counter, schedule, sampling, shard, tokens)
        expected = _reference_draw(schedule, sampling, seed, counter, shard, tokens)
        where = f"counter {counter}, T {tokens}, {schedule.spec} {sampling}, shard {shard}"
        assert drawn.host_budgets.tolist() == expected.tolist(), where
        assert drawn.budgets.tolist() == expected.tolist(), where
        assert drawn.total == int(expected.sum()), where
        assert drawn.counts.tolist() == np.bincount(expected, minlength=schedule.high + 1).tolist(), where
        assert advanced == BudgetStream(seed, (counter + 1) % (MASK + 1)), where
    static, _ = BudgetStream(seed, 3).draw(BudgetSchedule.static(8), "iid", 0, 5)
    assert static.host_budgets.tolist() == [8] * 5 and static.total == 40 and static.counts is None


def test_a_block_holds_at_most_its_element_budget():
    """A long draw gets fewer rows ahead: memory stays bounded whatever T."""
    # the unit test of the private block of draws made ahead (StreamHome._block)
    from elastic_moe_plugin.core import budget_stream

    home = ProcessStream(lambda: 0)
    tokens = budget_stream.AHEAD_ELEMENTS // 4 + 1
    drawn, _ = _home_draw(home, 5, 0, SCHEDULE, "iid", 0, tokens)
    assert home._block.uniforms.shape == (3, tokens) and home._block.uniforms.size <= budget_stream.AHEAD_ELEMENTS
    assert drawn.host_budgets[:9].tolist() == _reference_draw(SCHEDULE, "iid", 5, 0, 0, 9).tolist()


def test_layers_with_equal_schedules_share_one_mapping_of_a_block():
    """Every layer resolves its own BudgetSchedule object: equal ones map a block once (48 layers
    would otherwise keep 48 copies of it), and each layer's draw is still its own counter's."""
    # the unit test of the private block of draws made ahead (StreamHome._block)
    home = ProcessStream(lambda: 0)
    layers = [BudgetSchedule.parse("6-10", center=8) for _ in range(5)]
    assert all(schedule == SCHEDULE and schedule is not SCHEDULE for schedule in layers)
    for counter, schedule in enumerate(layers):
        drawn, _ = _home_draw(home, 3, counter, schedule, "iid", 0, 16)
        assert drawn.host_budgets.tolist() == _reference_draw(schedule, "iid", 3, counter, 0, 16).tolist()
    assert len(home._block.mapped) == 1 and home._block.first == 0
