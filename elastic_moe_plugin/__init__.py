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

from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.schedule import BudgetSchedule

__version__ = "0.1.0"
__all__ = ["BudgetSchedule", "ConfigError", "ElasticConfig", "__version__"]
