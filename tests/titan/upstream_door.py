"""A pytest plugin that runs torchtitan's own unit tests with the door applied at κ ≡ k.

torchtitan's unit tests live in its source repository (``tests/unit_tests``), not in its wheel or
sdist, and CI cannot fetch it; ``scripts/titan_upstream_tests.sh CHECKOUT`` runs them with this
plugin (``-p upstream_door``): the CPU runtime first (before torchtitan is imported), then
``titan.apply`` with ``schedule="auto"`` and σ = 1e-3, so every MoE layer with k >= 2 routes in
training through the door's elastic path with κ ≡ k (top-1 layers stay stock: ``auto`` finds no
range there). A test that passes so saw no numeric change beyond its own tolerance.
"""

from __future__ import annotations

from elastic_moe_plugin.cpu_runtime import titan as titan_cpu_runtime

titan_cpu_runtime.enable()

from elastic_moe_plugin import ElasticConfig, titan  # noqa: E402  (after the CPU runtime)
from elastic_moe_plugin.titan import rules  # noqa: E402

POINT_MASS = ElasticConfig(schedule="auto", sigma=1e-3)
_resolve_plan = rules.resolve_plan


def _top1_stays_stock(moe, config, **kwargs):
    # "auto" refuses a top-1 router (no range around 1): the upstream tests' top-1 MoEs run stock
    return None if moe.router.top_k == 1 else _resolve_plan(moe, config, **kwargs)


rules.resolve_plan = _top1_stays_stock


def pytest_configure(config) -> None:
    titan.apply(POINT_MASS)


def pytest_runtest_setup(item) -> None:
    # a test may remove or change patches; every test starts with the door applied at κ ≡ k
    titan.apply(POINT_MASS)


def pytest_report_header(config) -> list[str]:
    return [f"elastic-moe: torchtitan door applied ({POINT_MASS.schedule}, sigma {POINT_MASS.sigma}): κ ≡ k"]
