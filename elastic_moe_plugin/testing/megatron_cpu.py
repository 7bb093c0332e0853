"""Alias of :mod:`elastic_moe_plugin.compat.megatron_cpu` (the documented pre-0.2 path): one module object."""

import sys

from elastic_moe_plugin.compat import megatron_cpu

sys.modules[__name__] = megatron_cpu
