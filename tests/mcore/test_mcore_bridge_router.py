"""κ through mcore-bridge's router class, the router Megatron-SWIFT (``megatron sft``) builds.

mcore-bridge 1.6.5 replaces the stock spec's router with ``mcore_bridge.model.modules.topk_router.TopKRouter``,
a ``TopKRouter`` subclass whose ``routing`` delegates to ``super().routing`` and whose
``_apply_expert_bias`` counts the routing map it is given. ``import mcore_bridge`` needs Transformer
Engine (its package ``__init__`` applies patches importing ``megatron.core.extensions.transformer_engine``),
so the one module is loaded alone from its file; it imports only torch and megatron-core. Where is
it? The installed package, else ``.mcore-bridge/`` of the checkout (``make setup`` installs it there
``--no-deps``: it is not importable as a package on CPU anyway). Without either, the tests skip.

Not covered here (Transformer Engine, GPU): the rest of mcore-bridge (model building from HF
weights, its own transformer layer), Megatron-SWIFT's trainer; ``scripts/gpu_check.sh`` runs a real
``megatron sft --plugin elastic_moe`` for 2 steps.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.mcore import tracking

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("mcore_env")]

ROOT = Path(__file__).resolve().parents[2]
RELATIVE = Path("mcore_bridge") / "model" / "modules" / "topk_router.py"


def _router_file() -> Path | None:
    try:
        spec = importlib.util.find_spec("mcore_bridge")  # locates the package without running its __init__
    except (ImportError, ValueError):
        spec = None
    candidates = [Path(location).parent / RELATIVE for location in (spec.submodule_search_locations or [])] if spec else []
    candidates.append(ROOT / ".mcore-bridge" / RELATIVE)
    return next((path for path in candidates if path.is_file()), None)


@pytest.fixture(scope="module")
def bridge_router_class():
    path = _router_file()
    if path is None:
        pytest.skip("mcore-bridge is not installed (make setup puts it in .mcore-bridge/)")
    spec = importlib.util.spec_from_file_location("_mcore_bridge_topk_router", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from megatron.core.transformer.moe.router import TopKRouter

    assert issubclass(module.TopKRouter, TopKRouter) and "routing" in module.TopKRouter.__dict__
    return module.TopKRouter


def test_elastic_budgets_reach_the_routing_map_through_the_bridge_router(bridge_router_class, make_config, make_router):
    mcore.apply(ElasticConfig(schedule="1-3"))
    config = make_config()
    router = make_router(config, cls=bridge_router_class, weight_std=0.5).train()
    hidden = torch.randn(512, 1, config.hidden_size)
    probs, routing_map = router(hidden)
    per_token = routing_map.sum(-1)
    assert set(per_token.tolist()) == {1, 2, 3}  # κ ∈ {1, 2, 3} around top-2
    assert abs(per_token.double().mean().item() - 2) < 0.15
    assert torch.equal(routing_map, probs > 0)
    assert torch.allclose(probs.sum(-1), torch.ones(512))  # renormalised (post-softmax) gate
    values = tracking.routing_metrics(router)
    assert values["elastic_moe/layer_0/mean_kappa"] == pytest.approx(per_token.double().mean().item())
    router.eval()
    with torch.no_grad():
        _, static_map = router(hidden)
    assert set(static_map.sum(-1).tolist()) == {2}  # inference stays static top-k


def test_the_bridge_expert_bias_counts_realised_assignments(bridge_router_class, make_config, make_router):
    """mcore-bridge overrides ``_apply_expert_bias``: it must count the elastic map, not T·k."""
    mcore.apply(ElasticConfig(schedule="1-3"))
    config = make_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_load_balancing_type="none")
    router = make_router(config, cls=bridge_router_class, weight_std=0.5).train()
    _, routing_map = router(torch.randn(256, 1, config.hidden_size))
    assert torch.equal(router.local_tokens_per_expert.long(), routing_map.sum(0).long())


def test_a_moe_layer_built_with_the_bridge_router_is_elastic(bridge_router_class, make_config, mlp_spec):
    """The spec swap mcore-bridge makes (``submodules.router = TopKRouter``), then a forward/backward."""
    from tests.megatron_support import build_moe_layer  # noqa: PLC0415 - the shared builder

    mcore.apply(ElasticConfig(schedule="1-3", layers="0"))
    config = make_config()
    spec = mlp_spec(8)
    submodules = spec.submodules if hasattr(spec, "submodules") else spec.keywords["submodules"]
    submodules.router = bridge_router_class
    layers = [build_moe_layer(spec, config, number).train() for number in (1, 2)]
    assert all(type(layer.router) is bridge_router_class for layer in layers)
    hidden = torch.randn(256, 1, config.hidden_size, requires_grad=True)
    out = hidden
    for layer in layers:
        out = layer(out)[0]
    out.sum().backward()
    values = tracking.routing_metrics(torch.nn.ModuleList(layers))
    assert abs(values["elastic_moe/layer_0/mean_kappa"] - 2) < 0.25 and "elastic_moe/layer_0/kappa_frac_3" in values
    assert values["elastic_moe/layer_1/mean_kappa"] == 2.0  # layer 1 is static: logged at κ = k
    line = tracking.log_plan(torch.nn.ModuleList(layers))
    assert line == ("elastic-moe plan (megatron-core, 2 MoE layers): elastic 1-3 around k=2 (σ=1.5), renormalized gate, "
                    "iid sampling: layers 0; static top-2: layers 1")
