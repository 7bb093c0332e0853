"""The framework-free core: torch, numpy (and PyYAML for config files) only, nothing else of the package.

The routing path (what a training forward of a patched router runs):

- :mod:`~elastic_moe_plugin.core.routing`: ``RoutingRule`` and ``route``: which experts a token
  keeps and their weights, for every rule either door reads (``docs/gates.md#gate-conventions``).
- :mod:`~elastic_moe_plugin.core.router_state`: ``RouterState``, what one router keeps between
  forwards (plan, rule, κ stream, latest draw, what it routed, κ's histogram).
- :mod:`~elastic_moe_plugin.core.budget_stream`: κ's counter-based stream (seed, counter, shard)
  and where a door keeps it.
- :mod:`~elastic_moe_plugin.core.schedule`: ``BudgetSchedule``, the distribution of κ (paper
  §3.1-3.3), and the one map from uniforms to κ.
- :mod:`~elastic_moe_plugin.core.plan`: ``LayerPlan``, how one router routes in training, and the plan line.

Around it:

- :mod:`~elastic_moe_plugin.core.config`: ``ElasticConfig``, the one validated source of settings,
  with its checks (:mod:`~elastic_moe_plugin.core.config_checks`, the layer checks in
  :mod:`~elastic_moe_plugin.core.config_layer_checks`, worded by
  :mod:`~elastic_moe_plugin.core.config_refusals`), its readers of YAML, variables and flags
  (:mod:`~elastic_moe_plugin.core.config_sources`) and the words they share
  (:mod:`~elastic_moe_plugin.core.config_values`).
- :mod:`~elastic_moe_plugin.core.spelling`: how each entry point writes a setting, and so every fix.
- :mod:`~elastic_moe_plugin.core.records` and :mod:`~elastic_moe_plugin.core.metrics`: routing
  records, κ histograms and the logged scalars computed from them, when a logger asks.
- :mod:`~elastic_moe_plugin.core.patching`: the one patch lifecycle the doors share;
  :mod:`~elastic_moe_plugin.core.versions`: the tested version ranges;
  :mod:`~elastic_moe_plugin.core.import_hooks`: the one post-import hook mechanism.
- :mod:`~elastic_moe_plugin.core.errors`: the exception types.
"""
