"""Kept so that the documented ``elastic_moe_plugin.testing.megatron_cpu`` path keeps working;
the CPU layer lives in :mod:`elastic_moe_plugin.compat.megatron_cpu`."""
