"""Elastic Expert Routing for torchtitan 0.3: one class-level patch of its MoE layer and token dispatch.

From torchtitan's command line, through its own override mechanism (every rank applies it while the
trainer reads its config, before the model is built)::

    torchrun --nproc_per_node 8 -m torchtitan.train --module deepseek_v3 --config deepseek_v3_16b \\
        --override.imports 'elastic_moe_plugin.titan.elastic_moe={"schedule": "6-10", "layers": "3-7"}'

The JSON object holds :class:`~elastic_moe_plugin.core.config.ElasticConfig` fields over
``ELASTIC_MOE_*`` variables over a YAML file (its key ``"config"``, or ``ELASTIC_MOE_CONFIG``);
``--override.imports elastic_moe_plugin.titan.elastic_moe`` alone reads the variables and file. In
Python, before the trainer builds the model::

    from elastic_moe_plugin import ElasticConfig, titan

    titan.apply(ElasticConfig(schedule="6-10"))
    with titan.patched(ElasticConfig()):     # or scoped
        ...

Modules: :mod:`.rules` (the router read into a routing rule; a layer's plan), :mod:`.routing` (one
elastic MoE forward; the kept pairs' dispatch), :mod:`.budget_rng` (κ's stream, its replay and its
checkpoint state), :mod:`.trainer` (start-up refusals, checkpoints, metrics), :mod:`.patch` (what
is patched, the lifecycle, layer tags, plans). ``docs/torchtitan.md`` has the details.

Importing this package imports torchtitan (its override registry). On a CPU host without triton,
switch on the CPU runtime first (:mod:`elastic_moe_plugin.cpu_runtime.titan`).
"""

from typing import Any

try:
    from torchtitan.config import override
    from torchtitan.models.common.moe import MoE
except ModuleNotFoundError as missing:
    if missing.name == "triton":  # torchtitan imports MinimalAsyncEP's triton kernels at import
        raise ModuleNotFoundError(
            "elastic_moe_plugin.titan: torchtitan imports triton, which this torch lacks (a CPU-only build). "
            "On a CPU host switch on the CPU runtime first: "
            "from elastic_moe_plugin.cpu_runtime import titan; titan.enable() (docs/torchtitan.md).",
            name=missing.name,
        ) from missing
    if missing.name is not None and missing.name.split(".")[0] == "torchtitan":
        raise ModuleNotFoundError(
            "elastic_moe_plugin.titan needs torchtitan>=0.3,<0.4: pip install 'elastic-moe-plugin[titan]'.",
            name=missing.name,
        ) from missing
    raise

from elastic_moe_plugin.core.config import config_from_override
from elastic_moe_plugin.core.errors import UnsupportedTorchtitanError
from elastic_moe_plugin.titan.patch import (
    ALLOW_UNSUPPORTED_ENV,
    SUPPORTED_TORCHTITAN_RANGE,
    active_config,
    apply,
    check_torchtitan_version,
    is_applied,
    log_plan,
    logged_metrics,
    model_plans,
    moe_sites,
    patched,
    patched_symbols,
    remove,
    resolve_plan,
    tag_layers,
    torchtitan_version,
)


@override(target=MoE.Config, description="Elastic Expert Routing: a budget κ per token in training (elastic-moe)")
def elastic_moe(config: MoE.Config, **fields: Any) -> MoE.Config:
    """torchtitan's override entry: apply the door with the ``ElasticConfig`` of ``fields`` (the
    entry's JSON object) over the environment and YAML; the MoE config itself is returned unchanged
    (the door patches the MoE class, so checkpoints and configs stay stock).

    Raises:
        ConfigError: a field that is no setting or a value the config refuses, spelled as JSON.
    """
    apply(config_from_override(fields))
    return config


__all__ = [
    "ALLOW_UNSUPPORTED_ENV",
    "SUPPORTED_TORCHTITAN_RANGE",
    "UnsupportedTorchtitanError",
    "active_config",
    "apply",
    "check_torchtitan_version",
    "elastic_moe",
    "is_applied",
    "log_plan",
    "logged_metrics",
    "model_plans",
    "moe_sites",
    "patched",
    "patched_symbols",
    "remove",
    "resolve_plan",
    "tag_layers",
    "torchtitan_version",
]
