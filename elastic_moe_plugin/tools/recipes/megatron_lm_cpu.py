"""``python -m elastic_moe_plugin.tools.recipes.megatron_lm_cpu SCRIPT ARGS``: the recipe's Megatron-LM
entry point on a CPU-only torch (for ``elastic-moe launch RECIPE --rehearse``; also under torchrun).

Switches on, in this process and before anything imports megatron, the opt-in CPU runtime
(:func:`elastic_moe_plugin.cpu_runtime.enable` with ``training=True``: the CUDA runtime calls of
megatron-core and of ``megatron.training``'s loop), the megatron-core wheel's shims for Python 3.11
(:mod:`elastic_moe_plugin.cpu_runtime.megatron_training`) and host-tensor gradient clipping
(:mod:`elastic_moe_plugin.cpu_runtime.grad_clip`, so the recipe keeps its ``--clip-grad``), then runs
``python -m elastic_moe_plugin.megatron_lm SCRIPT ARGS`` unchanged: the recipe's own entry point,
with the plugin. torchrun starts one such process per rank, so every rank switches it on itself.

Where ``python -m elastic_moe_plugin.megatron_lm --cpu`` exists (the entry point's own CPU flag),
this module is that flag: the rehearsal's command would read ``-m elastic_moe_plugin.megatron_lm --cpu
SCRIPT ARGS`` instead, with the gradient-clipping redirect still to add.
"""

import runpy

from elastic_moe_plugin import cpu_runtime
from elastic_moe_plugin.cpu_runtime import grad_clip, megatron_training

# Megatron torch.compiles TopKRouter._apply_expert_bias: slow inductor work on CPU for one small function
# (docs/performance.md)
cpu_runtime.disable_torch_compile()
cpu_runtime.enable(training=True)
megatron_training.enable()
grad_clip.enable()

if __name__ == "__main__":
    runpy.run_module("elastic_moe_plugin.megatron_lm", run_name="__main__", alter_sys=True)
