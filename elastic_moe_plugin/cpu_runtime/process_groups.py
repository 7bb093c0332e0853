"""Process groups for tests and tools: gloo, then Megatron's model-parallel groups and RNG seeds.

Megatron-LM's training loop makes its own groups (``initialize_megatron``); this is for code that
builds Megatron modules directly (the tests, the demo, the benchmarks, ``diagnose``). Call through
``cpu_runtime.initialize_model_parallel`` / ``cpu_runtime.destroy``, which require the runtime on.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

from elastic_moe_plugin.cpu_runtime.errors import MegatronCPUError


class _Owned:
    """What :func:`initialize_model_parallel` created, so :func:`destroy` removes only that."""

    process_group = False
    store_dir: str | None = None


def initialize_model_parallel(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    *,
    seed: int = 1234,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **kwargs: Any,
) -> None:
    """Create a gloo process group if needed, then Megatron's model-parallel groups and RNG seeds.

    The default process group comes from, in order: an existing one (must be gloo);
    ``init_method``/``rank``/``world_size`` (e.g. ``"file:///tmp/x"`` from each spawned worker);
    the torchrun environment (``MASTER_ADDR`` and ``WORLD_SIZE`` set); otherwise a single-process
    group on a private file store. Then calls Megatron's
    ``parallel_state.initialize_model_parallel`` (extra ``kwargs`` are passed through) and
    ``tensor_parallel.model_parallel_cuda_manual_seed(seed)``.

    Raises:
        MegatronCPUError: the runtime is not enabled, the existing group is not gloo, or Megatron's
            model-parallel state is already initialised (call ``cpu_runtime.destroy()`` first).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        raise MegatronCPUError("Megatron model parallel state is already initialised; call cpu_runtime.destroy() first")
    if dist.is_initialized():
        if dist.get_backend() != "gloo":
            raise MegatronCPUError(f"the default process group uses {dist.get_backend()!r}; the CPU runtime needs gloo")
    else:
        if init_method is not None:
            if rank is None or world_size is None:
                raise MegatronCPUError("init_method needs rank and world_size as well")
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        elif "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo", init_method="env://")
        else:
            _Owned.store_dir = tempfile.mkdtemp(prefix="elastic_moe_cpu_runtime_")
            store = dist.FileStore(os.path.join(_Owned.store_dir, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        _Owned.process_group = True
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        **kwargs,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear down Megatron's model-parallel groups, and the process group if this module made it."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    if _Owned.process_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _Owned.process_group = False
    if _Owned.store_dir is not None:
        shutil.rmtree(_Owned.store_dir, ignore_errors=True)
        _Owned.store_dir = None


__all__ = ["destroy", "initialize_model_parallel"]
