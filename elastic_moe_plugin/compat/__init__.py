"""Version and framework shims, one module per concern, on the training path.

- :mod:`~elastic_moe_plugin.compat.megatron_tracker`: Megatron's MoE metrics tracker across
  megatron-core 0.16 (a dict in ``moe_utils``) and 0.17+ (``moe_logging.MoEMetricsTracker``).

Not here: the CPU runtime (:mod:`elastic_moe_plugin.cpu_runtime`, opt-in, for CPU-only machines)
and the inference top-k override (:mod:`elastic_moe_plugin.tools.inference_topk`, for evaluation).
"""
