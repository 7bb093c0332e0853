"""Compatibility shims, one module per concern, imported by every tool, test and script that needs it.

- :mod:`~elastic_moe_plugin.compat.megatron_cpu`: the explicit, opt-in layer that runs the real
  megatron-core MoE code on a CPU-only torch (tests, the demo, the bench on CPU).
- :mod:`~elastic_moe_plugin.compat.megatron_tracker`: Megatron's MoE metrics tracker across
  megatron-core 0.16 (a dict in ``moe_utils``) and 0.17+ (``moe_logging.MoEMetricsTracker``).
- :mod:`~elastic_moe_plugin.compat.inference_topk`: route a trained model to another static
  top-k at inference (Megatron-core and transformers).
"""
