"""The CPU runtime: run the real Megatron-core, Megatron-LM's training loop and Megatron-SWIFT on a
CPU-only torch with gloo. Explicit and opt-in; a GPU run never loads it.

Nothing here is needed to train on GPUs. It exists so the tests, the demo, the benchmarks on CPU
and ``python -m elastic_moe_plugin.megatron_lm --cpu`` exercise the frameworks' own code paths on
a machine without CUDA. It redirects the CUDA *runtime* (devices, streams, events, RNG) and stands
in for GPU-only components (triton kernels) with local equivalents, scoped so that the framework
sees what it would see without them. :mod:`.runtime` lists every redirection.
"""

from elastic_moe_plugin.cpu_runtime.runtime import (
    PAGED_STASH_MODULE,
    MegatronCPUError,
    destroy,
    disable,
    disable_torch_compile,
    enable,
    enabled,
    in_rng_tracker_fork,
    initialize_model_parallel,
    is_enabled,
)

__all__ = [
    "PAGED_STASH_MODULE", "MegatronCPUError", "destroy", "disable", "disable_torch_compile", "enable", "enabled",
    "in_rng_tracker_fork", "initialize_model_parallel", "is_enabled",
]
