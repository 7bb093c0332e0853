"""`elastic-moe bench --quick --only kappa`: the κ draw of one router call, as the routers draw it.

Times are measurements, not asserted (only finite, positive and ordered); the memory of `before`
is asserted to grow with the number of shards (it allocates num_shards·T fp64 uniforms), the
doors' not to: that is the bytes the draws allocate, not a timing. What the bench times is the
routers' own call (RouterState.draw on a real router's resolved path, the door's own stream home),
checked here by its result and by counting the calls.
"""

import contextlib
import io
import json

import numpy as np
import pytest

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.core.budget_stream import BudgetStream, StreamHome
from elastic_moe_plugin.core.schedule import BudgetSchedule
from elastic_moe_plugin.tools.bench import kappa, schema

pytestmark = [pytest.mark.megatron, pytest.mark.hf]
DOORS = ("megatron", "transformers")


def _bench(*extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--quick", "--only", "kappa", *extra]) == 0
    return out.getvalue()


def test_the_table_has_every_cell_and_the_routers_draw_allocates_o_of_t(mp_world, monkeypatch):
    homes = {"TrackedStream": 0, "ProcessStream": 0}  # counts, not a growing list: the bench traces memory
    original = StreamHome.draw

    def counted(self, *args, **kwargs):
        homes[type(self).__name__] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StreamHome, "draw", counted)
    report = json.loads(_bench("--json"))
    schema.validate(report)
    # every timed draw of a door went through its stream home: at least the timed ones of each cell
    for home, count in homes.items():
        assert count >= 2 * len(kappa.QUICK_SHARDS) * 2 * 64, (home, count)
    cells = {(r["params"]["sampling"], r["params"]["num_shards"], r["variant"]): r for r in report["rows"]}
    paths = (kappa.BEFORE, *DOORS)
    assert set(cells) == {(s, n, p) for s in ("iid", "balanced") for n in kappa.QUICK_SHARDS for p in paths}
    for (_, _, path), cell in cells.items():
        metrics = cell["metrics"]
        assert 0 < metrics["min_us"] <= metrics["median_us"] <= metrics["max_us"]
        assert metrics["min_us"] <= metrics["mean_us"] <= metrics["max_us"]
        assert cell["params"]["tokens"] == kappa.QUICK_TOKENS and metrics["peak_bytes"] > 0
        assert metrics["stream"] == {"before": "", "megatron": "TrackedStream", "transformers": "ProcessStream"}[path]
        assert cell["baseline"] == (None if path == kappa.BEFORE else kappa.BEFORE)
    for sampling in ("iid", "balanced"):
        one, eight = (cells[sampling, n, kappa.BEFORE]["metrics"]["peak_bytes"] for n in kappa.QUICK_SHARDS)
        # 7·T more fp64 uniforms, give or take the mapping's host temporaries (tens of bytes)
        assert eight - one >= 0.99 * 7 * 8 * kappa.QUICK_TOKENS
        for door in DOORS:
            one, eight = (cells[sampling, n, door]["metrics"]["peak_bytes"] for n in kappa.QUICK_SHARDS)
            assert abs(eight - one) < 8 * kappa.QUICK_TOKENS


def test_the_text_table_names_every_path(mp_world):
    text = _bench()
    assert "κ draw per router call, T=1024" in text
    assert "before µs" in text and "megatron µs" in text and "transformers µs" in text
    assert len([line for line in text.splitlines() if line.startswith(("iid ", "balanced "))]) == 2 * len(kappa.QUICK_SHARDS)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("sampling", ["iid", "balanced"])
def test_the_bench_times_the_routers_own_draw(mp_world, monkeypatch, door, sampling):
    """The door's router resolves a path whose stream is the door's one home; a draw through it is
    StreamHome.draw, and its κ is the counter-based stream's for that (seed, counter, shard)."""
    from elastic_moe_plugin.hf import budget_rng as hf_rng
    from elastic_moe_plugin.mcore import budget_rng as mcore_rng

    state, path, device = kappa.router_draw(door, sampling)
    assert path.stream is {"megatron": mcore_rng.STREAM, "transformers": hf_rng.STREAM}[door]
    assert path.plan.sampling == sampling and (path.plan.schedule.low, path.plan.schedule.high) == (6, 10)
    draws = []
    original = StreamHome.draw

    def counted(self, *args, **kwargs):
        draws.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StreamHome, "draw", counted)
    before = path.stream.load()
    shard = 5
    import dataclasses

    drawn = state.draw(dataclasses.replace(path, shard=shard), kappa.QUICK_TOKENS, device)
    assert draws == [type(path.stream).__name__] and state.latest_draw is drawn
    schedule = BudgetSchedule.parse(kappa.SCHEDULE_SPEC, center=kappa.CENTER)
    uniforms = BudgetStream(before.seed, before.counter).uniforms(shard, kappa.QUICK_TOKENS)
    expected = schedule.budgets_from_uniforms(uniforms, sampling)
    assert np.array_equal(drawn.host_budgets, expected)
    assert path.stream.load().counter == before.counter + 1
