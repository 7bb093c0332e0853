"""Elastic Expert Routing (EER) for Megatron-core, transformers and ms-swift.

During training every token in every elastic MoE layer draws an expert budget κ from a
discretised Gaussian on {low..high} centred at the model's top-k, and is dispatched to its top-κ
experts; inference stays static top-k with the same weights and checkpoint format.

Layers, each importing only those below it: :mod:`~elastic_moe_plugin.core` (framework-free:
schedule, config, gate rules, plans, records, metrics, the patch lifecycle);
:mod:`~elastic_moe_plugin.compat` (framework compatibility shims); the adapters
:mod:`~elastic_moe_plugin.mcore` (Megatron-core), :mod:`~elastic_moe_plugin.hf` (transformers)
and :mod:`~elastic_moe_plugin.swift` (ms-swift); :mod:`~elastic_moe_plugin.tools` (demo, bench,
evaluation, diagnostics, recipes); :mod:`~elastic_moe_plugin.cli` (``elastic-moe``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic_moe_plugin.core.config import ElasticConfig, ModelShape
    from elastic_moe_plugin.core.errors import ConfigError
    from elastic_moe_plugin.core.schedule import BudgetSchedule

__version__ = "0.1.0"
__all__ = ["BudgetSchedule", "ConfigError", "ElasticConfig", "ModelShape", "__version__"]

#: public name -> its module; imported on first access, so ``import elastic_moe_plugin`` (the CLI's
#: ``--help``, the ms-swift launcher hook) does not import torch
_EXPORTS = {
    "BudgetSchedule": "elastic_moe_plugin.core.schedule",
    "ConfigError": "elastic_moe_plugin.core.errors",
    "ElasticConfig": "elastic_moe_plugin.core.config",
    "ModelShape": "elastic_moe_plugin.core.config",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
