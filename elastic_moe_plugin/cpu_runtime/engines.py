"""DeepSpeed ZeRO and FSDP2 through accelerate on a CPU-only torch with gloo: two decisions.

transformers' ``Trainer`` and ``swift sft`` hand their engine to accelerate. On a CPU host
(``use_cpu=True``, several processes) accelerate picks ``DistributedType.MULTI_CPU`` with gloo and
then leaves each engine one step short of what it does on a GPU (verified against accelerate 1.16
with deepspeed 0.19.8 and torch 2.13):

1. **DeepSpeed's communication layer is not initialised when ZeRO-3 builds the model.** On a GPU,
   ``PartialState`` calls ``deepspeed.comm.init_distributed`` while ``TrainingArguments`` builds it
   for a DeepSpeed run; on the CPU path (``use_cpu``) it initialises only ``torch.distributed``. A
   model built afterwards under ZeRO-3 (``from_pretrained`` inside ``deepspeed.zero.Init``, as
   ms-swift and every ZeRO-3 recipe build it) then reads its batch configuration against a world of
   one, before ``zero.Init`` initialises the layer itself: ``AssertionError: Check batch related
   parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step *
   world_size 4 != 2 * 1 * 1``. With :func:`enable`, ``zero.Init`` first initialises
   ``deepspeed.comm`` on the process group ``torch.distributed`` already holds (gloo), the call
   accelerate makes on a GPU.
2. **FSDP is enabled only for accelerator device types.** ``AcceleratorState`` turns an FSDP plugin
   (or ``ACCELERATE_USE_FSDP=true``) into ``DistributedType.FSDP`` for ``MULTI_GPU``, ``MULTI_XPU``
   and the other device families, never for ``MULTI_CPU``: the run silently falls back to DDP. With
   :func:`enable`, ``MULTI_CPU`` is one of them; FSDP2's ``fully_shard`` then shards the decoder
   layers over gloo with DTensor weights.

Nothing else is replaced: the engines, their optimizers, checkpoints and collectives are the
frameworks' own. DeepSpeed's CPU accelerator JIT-compiles its ``deepspeed_shm_comm`` op at the first
``init_distributed`` (into ``TORCH_EXTENSIONS_DIR``; the Makefile points it inside ``build/``, so it
is compiled once per checkout).

Part of the opt-in CPU runtime (:mod:`elastic_moe_plugin.cpu_runtime`): no adapter imports it and a
GPU run never loads it. Switched on by :func:`enable` in-process, or in every process of a launcher
by the child bootstrap's ``engines`` feature (:mod:`elastic_moe_plugin.tools.child_bootstrap`).
"""

from __future__ import annotations

import functools
import inspect
import os
import types
from typing import Any

import torch

from elastic_moe_plugin.core.patching import AttributePatches, PatchSwitch
from elastic_moe_plugin.cpu_runtime.errors import MegatronCPUError

__all__ = ["ACCELERATE_STATE_MODULE", "ZERO_INIT_MODULE", "disable", "enable", "is_enabled"]

#: the module holding ``AcceleratorState``
ACCELERATE_STATE_MODULE = "accelerate.state"
#: the module holding ``deepspeed.zero.Init``
ZERO_INIT_MODULE = "deepspeed.runtime.zero.partition_parameters"


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def _initialising_deepspeed_comm(stock):
    @functools.wraps(stock)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from deepspeed import comm

        distributed = torch.distributed
        if not comm.is_initialized() and distributed.is_available() and distributed.is_initialized():
            # on the group torch.distributed already holds (gloo), as accelerate does on a GPU
            comm.init_distributed(dist_backend=distributed.get_backend(), auto_mpi_discovery=False)
        stock(self, *args, **kwargs)

    return __init__


def _enabling_fsdp(stock):
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stock(self, *args, **kwargs)
        fsdp_plugin = signature.bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        wanted = fsdp_plugin is not None or _flag("ACCELERATE_USE_FSDP")
        if not wanted or self.distributed_type != DistributedType.MULTI_CPU:
            return
        # what accelerate does for the accelerator device types, in the same order
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no" and fsdp_plugin is not None:
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type

    return __init__


def _install(patches: AttributePatches) -> None:
    def redirect_accelerate(module: types.ModuleType) -> None:
        patches.wrap(module.AcceleratorState, "__init__", _enabling_fsdp)

    def redirect_deepspeed(module: types.ModuleType) -> None:
        patches.wrap(module.Init, "__init__", _initialising_deepspeed_comm)

    patches.when_imported(ACCELERATE_STATE_MODULE, redirect_accelerate)
    patches.when_imported(ZERO_INIT_MODULE, redirect_deepspeed)


_SWITCH = PatchSwitch(_install)


def enable(force: bool = False) -> None:
    """Make the two CPU decisions as accelerate makes them on a GPU (idempotent; before or after
    ``accelerate`` and ``deepspeed`` are imported, before the ``TrainingArguments`` are built).

    Raises:
        MegatronCPUError: CUDA is available and ``force`` is False (on a GPU accelerate needs none of
            this, and a redirect could only hide a misconfiguration).
    """
    if not _SWITCH.is_on and torch.cuda.is_available() and not force:
        raise MegatronCPUError(
            "torch.cuda.is_available() is True: the CPU engines runtime is for CPU-only hosts; run DeepSpeed or "
            "FSDP on the GPU without elastic_moe_plugin.cpu_runtime.engines."
        )
    _SWITCH.on()


def disable() -> None:
    """Restore ``AcceleratorState.__init__`` and ``zero.Init.__init__`` by identity (idempotent)."""
    _SWITCH.off()


def is_enabled() -> bool:
    """Whether the two decisions are redirected."""
    return _SWITCH.is_on
