"""Shared fixtures of the Megatron-core tests: the real megatron-core MoE code on a CPU-only torch.

The conftest of every test folder that runs Megatron (``mcore/``, ``compat/``, ``tools/``)
star-imports this module, which is how pytest sees its fixtures.

- The CPU compatibility layer (``elastic_moe_plugin.cpu_runtime``) is enabled when this
  file is imported, so test modules may import ``megatron.core`` at their top level. It stays
  enabled for the session (``force=True``: on a GPU machine the tests still run on the CPU).
- ``mp_world`` (module scope) creates a single-process gloo group and Megatron's model-parallel
  state if none exists, runs torch single-threaded, and undoes both at the end of the module.
- ``mcore_env`` (function scope; every module here applies it through ``pytestmark``) makes sure
  the layer and the model-parallel state are up, and guarantees ``mcore.remove()``, an empty MoE
  metrics tracker, no budget stream (``mcore.budget_rng``: the next elastic router seeds a fresh
  one) and an unset aux-loss backward scale (i.e. 1) before and after each test.
- ``make_config`` / ``make_router`` / ``make_moe_layer`` build fresh Megatron objects;
  ``moe_tracker`` reads Megatron's aux-loss tracker in both 0.16 (dict tracker) and 0.19
  (``MoEMetricsTracker``).

Without megatron-core installed, ``HAVE_MEGATRON`` is False and nothing is enabled.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None

if HAVE_MEGATRON:
    from elastic_moe_plugin import cpu_runtime

    cpu_runtime.disable_torch_compile()
    # force=True: a test session on a GPU machine exercises the same CPU code path as CI.
    cpu_runtime.enable(force=True)


# -------------------------------------------------------------------------------- tracker
class MoETracker:
    """Megatron's MoE aux-loss tracker, whichever API the installed version has (the one shim)."""

    @staticmethod
    def values(name: str) -> torch.Tensor | None:
        """Per-layer accumulated values of ``name`` (a copy), or None if never recorded."""
        from elastic_moe_plugin.compat import megatron_tracker

        return megatron_tracker.values(name)

    @staticmethod
    def names() -> set[str]:
        from elastic_moe_plugin.compat import megatron_tracker

        return set(megatron_tracker.entries())

    @staticmethod
    def reset() -> None:
        """Forget every entry (the tracker is sized at its first record, so clear, not zero)."""
        from elastic_moe_plugin.compat import megatron_tracker

        megatron_tracker.reset()


@pytest.fixture
def moe_tracker() -> MoETracker:
    return MoETracker()


# -------------------------------------------------------------------------------- forced κ
def force_budgets(monkeypatch, budgets_for: Callable[[int], torch.Tensor]) -> None:
    """Every elastic draw of κ on the Megatron path returns ``budgets_for(T)`` [T] instead of drawing
    from the stream, as a draw would (κ, Σκ and κ's histogram known on the host): replaces
    ``mcore.budget_rng.STREAM.draw`` for the test."""
    import numpy as np

    from elastic_moe_plugin.core.budget_stream import BudgetDraw
    from elastic_moe_plugin.mcore import budget_rng

    def draw(schedule, sampling, shard, num_tokens, device):
        budgets = budgets_for(num_tokens)
        host = budgets.numpy()
        return BudgetDraw(budgets, host, int(host.sum()), np.bincount(host, minlength=schedule.high + 1))

    monkeypatch.setattr(budget_rng.STREAM, "draw", draw)


# -------------------------------------------------------------------------------- environment
@pytest.fixture(scope="module")
def mp_world():
    """Single-process gloo + Megatron model-parallel state (TP=PP=EP=1) for one test module.

    Also runs torch single-threaded for the module: every tensor here is tiny, and intra-op threads
    only oversubscribe shared CI cores (a 4-step GPT run took 9 s instead of 0.4 s with other jobs
    on the same 2 cores).
    """
    from megatron.core import parallel_state

    cpu_runtime.enable(force=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    created = False
    if not parallel_state.model_parallel_is_initialized():
        cpu_runtime.initialize_model_parallel()
        created = True
    yield
    if created:
        cpu_runtime.destroy()
    torch.set_num_threads(threads)


@pytest.fixture
def mcore_env(mp_world):
    """Per test: layer on, model-parallel up, no elastic patch and an empty MoE tracker around it."""
    from megatron.core import parallel_state

    from elastic_moe_plugin import mcore

    cpu_runtime.enable(force=True)  # idempotent; a test elsewhere may have disabled it
    if not parallel_state.model_parallel_is_initialized():
        cpu_runtime.initialize_model_parallel()
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from elastic_moe_plugin.mcore import budget_rng

    mcore.remove()
    MoETracker.reset()
    budget_rng.reset()  # each test's budget stream starts from its own seed, whatever ran before
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # aux-loss gradients at scale 1
    try:
        yield
    finally:
        mcore.remove()
        MoETracker.reset()
        budget_rng.reset()
        MoEAuxLossAutoScaler.main_loss_backward_scale = None


# -------------------------------------------------------------------------------- factories
CONFIG_DEFAULTS: dict[str, Any] = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    ffn_hidden_size=32,
    moe_ffn_hidden_size=32,
    num_moe_experts=8,
    moe_router_topk=2,
    moe_token_dispatcher_type="allgather",
    moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=0.0,
    use_cpu_initialization=True,
    add_bias_linear=False,
)


@pytest.fixture
def make_config() -> Callable[..., Any]:
    """``make_config(**overrides)`` -> a fresh ``TransformerConfig`` for a small MoE model."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    def factory(**overrides: Any):
        values = dict(CONFIG_DEFAULTS)
        values.update(overrides)
        if "moe_ffn_hidden_size" not in overrides and "ffn_hidden_size" in overrides:
            values["moe_ffn_hidden_size"] = overrides["ffn_hidden_size"]
        return TransformerConfig(**values)

    return factory


@pytest.fixture
def make_router() -> Callable[..., Any]:
    """``make_router(config, layer_number=1, seed=0, weight_std=None, cls=None)`` -> a TopKRouter.

    Weights are drawn after ``torch.manual_seed(seed)``, so two calls with one seed give equal
    routers. ``weight_std`` re-draws the gate weight with that std (Megatron's default init gives
    nearly tied logits at hidden size 16).
    """
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    def factory(config, layer_number: int | None = 1, seed: int = 0, weight_std: float | None = None, cls=None):
        torch.manual_seed(seed)
        router = (cls or TopKRouter)(config=config, pg_collection=get_default_pg_collection())
        if weight_std is not None:
            with torch.no_grad():
                router.weight.normal_(0.0, weight_std)
        if layer_number is not None:
            router.set_layer_number(layer_number)
        return router

    return factory


def moe_mlp_spec(num_experts: int):
    """The MoE MLP spec of ``get_gpt_layer_local_spec`` (SequentialMLP experts, local linears).

    A ``ModuleSpec`` in 0.16, a ``functools.partial`` in 0.19.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False).submodules.mlp


def build_moe_layer(spec, config, layer_number: int = 1):
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    layer.set_layer_number(layer_number)
    return layer


@pytest.fixture
def make_moe_layer() -> Callable[..., Any]:
    """``make_moe_layer(config, spec=None, layer_number=1, seed=0)`` -> an MoELayer on CPU."""

    def factory(config, spec=None, layer_number: int = 1, seed: int = 0):
        torch.manual_seed(seed)
        return build_moe_layer(spec if spec is not None else moe_mlp_spec(config.num_moe_experts), config, layer_number)

    return factory


@pytest.fixture
def mlp_spec() -> Callable[[int], Any]:
    return moe_mlp_spec
