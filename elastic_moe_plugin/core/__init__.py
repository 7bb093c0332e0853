"""The framework-free core: torch, numpy (and PyYAML for config files) only, nothing else of the package.

- :mod:`~elastic_moe_plugin.core.schedule`: ``BudgetSchedule``, the distribution of κ (paper §3.1-3.3).
- :mod:`~elastic_moe_plugin.core.budget_stream`: ``BudgetStream``, κ's counter-based stream (seed, counter, shard).
- :mod:`~elastic_moe_plugin.core.config`: ``ElasticConfig``, the one validated source of settings.
- :mod:`~elastic_moe_plugin.core.spelling`: how each entry point writes a setting, and so every fix.
- :mod:`~elastic_moe_plugin.core.gates`: the gate-weighing rules routing runs (``docs/gates.md#gate-conventions``).
- :mod:`~elastic_moe_plugin.core.plan`: ``LayerPlan``, how one router routes in training.
- :mod:`~elastic_moe_plugin.core.records`: routing records and κ histograms kept on routers.
- :mod:`~elastic_moe_plugin.core.metrics`: logged scalars computed from those records.
- :mod:`~elastic_moe_plugin.core.patching`: the one patch lifecycle the adapters share.
- :mod:`~elastic_moe_plugin.core.errors`: the exception types.
"""
