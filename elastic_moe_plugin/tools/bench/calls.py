"""``elastic-moe bench --only calls``: what one router call costs, stock against patched, per door.

Each door's router alone, in training mode, forward only, at a small T (256 tokens, 32 experts,
top-8; ``--quick``: 64 tokens), so that the package's per-call Python work shows next to the
kernels: Megatron-core's ``TopKRouter`` (alltoall, aux loss 0.01, fp32 router; under the CPU
runtime on a CPU machine) and transformers' OLMoE router, each as

- ``stock``: the unpatched router;
- ``static``: under the patch with ``schedule="static"`` (the stock path through the patched method);
- ``elastic``: under the patch with schedule 6-10 around 8.

Timing: per round, each variant runs a block of calls with its patch applied (removed between
blocks), the variants' order alternating round by round, so drift and other load hit all three;
the figure is the median per call over the rounds. Counted, not timed (the same on every machine):
the calls into the package's functions during one steady-state elastic call (its state resolved by
the call before), and the modules they enter (``sys.setprofile``; the CPU runtime, which stands in
for CUDA, left out).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import elastic_moe_plugin
from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.tools.bench.schema import BenchRow, row

VARIANTS = ("stock", "static", "elastic")
DOORS = ("megatron", "transformers")
HIDDEN, EXPERTS, TOPK, SCHEDULE = 64, 32, 8, "6-10"
TOKENS, QUICK_TOKENS = 256, 64
_PACKAGE = os.path.dirname(elastic_moe_plugin.__file__)
_RUNTIME = os.path.join(_PACKAGE, "cpu_runtime")


@dataclass
class RouterCallResult:
    """One (door, variant) row: µs per router call, and for ``elastic`` the calls and modules of the
    package one call enters (None for the other variants)."""

    door: str
    variant: str
    tokens: int
    median_us: float
    min_us: float
    max_us: float
    package_calls: int | None = None
    package_modules: int | None = None


def package_calls(call: Callable[[], object]) -> tuple[int, int]:
    """``(calls, modules)``: the package's functions ``call()`` calls, and the modules they are in
    (this bench's own code, which makes the call, left out)."""
    calls, modules = 0, set()

    def profile(frame, event, arg):
        nonlocal calls
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(_PACKAGE) and not path.startswith(_RUNTIME) and path != __file__:
            calls += 1
            modules.add(path)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return calls, len(modules)


def _megatron_router(tokens: int) -> tuple[Callable[[], torch.nn.Module], Callable[[torch.nn.Module], object]]:
    """A factory of identical ``TopKRouter`` objects and the call of one forward on ``tokens`` tokens."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from elastic_moe_plugin.tools.bench.megatron import bench_device, transformer_config

    config = transformer_config(
        hidden_size=HIDDEN,
        ffn_hidden_size=2 * HIDDEN,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type="alltoall",
    )
    x = torch.randn(tokens // 2, 2, HIDDEN, generator=torch.Generator().manual_seed(0)).to(bench_device())

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        router = TopKRouter(config=config, pg_collection=get_default_pg_collection()).to(bench_device())
        router.set_layer_number(1)
        return router.train()

    return build, lambda router: router(x)


def _transformers_router(tokens: int) -> tuple[Callable[[], torch.nn.Module], Callable[[torch.nn.Module], object]]:
    """A factory of identical OLMoE routers and the call of one forward on ``tokens`` tokens."""
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
    )
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(0))

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return OlmoeForCausalLM(config).train().model.layers[0].mlp.gate

    return build, lambda router: router(hidden)


def door(name: str):
    """(the door's patch module, its router factory: ``factory(tokens)`` -> (``build()``, ``forward(router)``)),
    the frameworks set up (Megatron: :func:`~.megatron.megatron_setup`). Raises ImportError where the
    door's framework is not installed."""
    if name == "megatron":
        from elastic_moe_plugin import mcore
        from elastic_moe_plugin.tools.bench.megatron import megatron_setup

        megatron_setup(0)
        return mcore, _megatron_router
    from elastic_moe_plugin import hf

    return hf, _transformers_router


def _time_door(name: str, tokens: int, rounds: int, calls: int) -> list[RouterCallResult]:
    patch, router_factory = door(name)
    build, forward = router_factory(tokens)
    configs = {"stock": None, "static": ElasticConfig(schedule="static"), "elastic": ElasticConfig(schedule=SCHEDULE)}
    routers = {}
    for variant, config in configs.items():
        # stock: no patch (each patched block restores the unpatched state it found)
        with patch.patched(config) if config is not None else contextlib.nullcontext():
            routers[variant] = build()
    samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_index in range(rounds + 1):  # round 0 warms up
        for variant in VARIANTS if round_index % 2 else VARIANTS[::-1]:
            config = configs[variant]
            with patch.patched(config) if config is not None else contextlib.nullcontext():
                for _ in range(3):
                    forward(routers[variant])
                start = time.perf_counter()
                for _ in range(calls):
                    forward(routers[variant])
                elapsed = (time.perf_counter() - start) / calls * 1e6
            if round_index:
                samples[variant].append(elapsed)
    with patch.patched(configs["elastic"]):
        forward(routers["elastic"])  # the first call under an apply resolves the router's state
        counted = package_calls(lambda: forward(routers["elastic"]))
    results = []
    for variant, times in samples.items():
        counts = counted if variant == "elastic" else (None, None)
        results.append(
            RouterCallResult(name, variant, tokens, statistics.median(times), min(times), max(times), *counts)
        )
    return results


def run_suite(quick: bool, threads: int) -> list[RouterCallResult]:
    """Both doors (a door whose framework is not installed is left out)."""
    if threads:
        torch.set_num_threads(threads)
    tokens, rounds, calls = (QUICK_TOKENS, 4, 20) if quick else (TOKENS, 30, 50)
    results: list[RouterCallResult] = []
    for name in DOORS:
        try:
            results += _time_door(name, tokens, rounds, calls)
        except ImportError:
            continue
    return results


def rows(results: list[RouterCallResult]) -> list[BenchRow]:
    """The schema rows (:mod:`.schema`): one per (door, variant); ``static`` and ``elastic`` against ``stock``."""
    stock = {r.door: r.median_us for r in results if r.variant == "stock"}
    out = []
    for r in results:
        compared = r.variant != "stock" and r.door in stock
        out.append(
            row(
                "calls",
                "router-call",
                f"{r.door}: training forward, T={r.tokens} E={EXPERTS} top-{TOPK} elastic {SCHEDULE}",
                r.variant,
                params=dict(door=r.door, tokens=r.tokens, experts=EXPERTS, topk=TOPK, schedule=SCHEDULE),
                metrics={k: v for k, v in asdict(r).items() if k not in ("door", "variant", "tokens")},
                baseline="stock" if compared else None,
                ratios=(
                    {"time_ratio": r.median_us / stock[r.door], "added_us": r.median_us - stock[r.door]}
                    if compared
                    else None
                ),
            )
        )
    return out


def format_table(results: list[RouterCallResult]) -> str:
    """One row per (door, variant): µs per call, its spread, and the elastic call's package work."""
    lines = [
        f"one router call, training forward, T={results[0].tokens}, E={EXPERTS}, top-{TOPK}, elastic {SCHEDULE}",
        f"{'door':13s} {'variant':8s} {'median µs':>10s} {'min-max µs':>17s} {'- stock µs':>11s} "
        f"{'package calls':>13s} {'modules':>7s}",
    ]
    stock = {r.door: r.median_us for r in results if r.variant == "stock"}
    for r in results:
        calls = "" if r.package_calls is None else str(r.package_calls)
        modules = "" if r.package_modules is None else str(r.package_modules)
        lines.append(
            f"{r.door:13s} {r.variant:8s} {r.median_us:10.1f} {r.min_us:8.1f}-{r.max_us:8.1f} "
            f"{r.median_us - stock[r.door]:+11.1f} {calls:>13s} {modules:>7s}"
        )
    return "\n".join(lines)


__all__ = ["DOORS", "VARIANTS", "RouterCallResult", "door", "format_table", "package_calls", "rows", "run_suite"]
