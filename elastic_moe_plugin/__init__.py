"""Elastic Expert Routing (EER) for Megatron-core, transformers and ms-swift.

During training every token in every elastic MoE layer draws an expert budget κ from a
discretised Gaussian on {low..high} centred at the model's top-k, and is dispatched to its top-κ
experts; inference stays static top-k with the same weights and checkpoint format.

Core modules (framework-free, torch only): :mod:`~elastic_moe_plugin.schedule`,
:mod:`~elastic_moe_plugin.config`, :mod:`~elastic_moe_plugin.gates`. Framework adapters import
them, never the other way round: :mod:`~elastic_moe_plugin.mcore` (Megatron-core),
:mod:`~elastic_moe_plugin.hf` (transformers) and :mod:`~elastic_moe_plugin.swift` (ms-swift).
"""

from elastic_moe_plugin.config import ConfigError, ElasticConfig
from elastic_moe_plugin.schedule import BudgetSchedule

__version__ = "0.1.0"
__all__ = ["BudgetSchedule", "ConfigError", "ElasticConfig", "__version__"]
