"""What Megatron-LM's training loop (``megatron.training``) asks of a GPU, answered on the CPU.

Installed by :func:`install` for ``cpu_runtime.enable(training=True)``, with the device answers of
:func:`elastic_moe_plugin.cpu_runtime.cuda.install_training`. Each is set when its module is
imported (now, if it already is); verified against the megatron-core 0.19.2 wheel's
``megatron.training`` and a source tree of that release (``megatron/core`` and ``megatron/training`` of
the 0.19.2 sdist, its dataset helpers built by ``scripts/build_megatron_dataset_helpers.sh``).

* ``megatron.training.global_vars.set_global_variables`` (and the copies ``arguments`` and
  ``initialize`` bind at import; every Megatron-LM version calls it right after ``validate_args``)
  -> first checks the validated arguments for what no CPU run can do without, and raises one
  :class:`MegatronCPUError` naming every missing flag and why it is needed (:data:`CPU_ARGUMENTS`),
  on every rank, before Megatron initialises anything. Without the check each would fail later on
  its own, and not by name: "Distributed package doesn't have NCCL built in", "'NoneType' object is
  not callable" (no Transformer Engine), apex's missing CUDA extension, torch's norm rejecting
  ``persist_layer_norm``, or ``clip_grad_by_total_norm_fp32`` asserting CUDA tensors.
* ``megatron.training.training.initialize_megatron`` -> called with ``allow_no_cuda=True``:
  ``pretrain`` passes nothing, and the function then asserts ``torch.cuda.is_available()``, which
  this runtime leaves False (faking it would send other libraries down their CUDA paths).
* ``get_device_arch_version`` (``megatron.training.utils``, and the copy ``megatron.training.arguments``
  binds at import) -> 0, "no GPU architecture". The stock function reads
  ``torch.cuda.get_device_properties("cuda:0").major``, which raises without CUDA, and
  ``validate_args`` calls it whenever tensor or context parallelism is > 1. 0 takes the branches of
  GPUs before Blackwell (< 10): Megatron then requires ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP or
  CP > 1, as it does on those GPUs, and no Blackwell-only option (high-priority stream groups) is
  switched on.
* ``megatron.training.initialize._warmup_jit_function`` -> runs with the CPU generator's state saved
  and restored. It feeds the fused bias-GELU/bias-dropout functions random inputs sized by the
  tensor-parallel size, drawn with ``device="cuda"``: on a GPU from the CUDA generator, leaving the
  CPU generator, from which ``--use-cpu-initialization`` draws every weight, untouched. Here the
  "CUDA" generator *is* the CPU one (:mod:`.cuda`), so without this the warm-up would shift every
  weight by a TP-dependent number of draws, and a TP=2 run would start from other weights than a
  TP=1 run of the same seed, which on a GPU it does not. (The warm-up leaves no trace in the "CUDA"
  stream then; only dropout outside an RNG-tracker fork draws from it, and no CPU run can reproduce
  a GPU's dropout masks anyway.)
* ``megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue``
  (``_get_write_results_queue`` in 0.16, which hard-codes the start method) -> its multiprocessing
  Manager is started with 'fork', not 'spawn'. A spawned process re-imports the training script in a
  fresh interpreter where this runtime (and the paged-stash stand-in) is off, so it dies importing
  megatron.core and the torch_dist save fails with ``EOFError``. Megatron spawns because forking a
  process holding a CUDA context is unsafe; without CUDA, fork is safe.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from elastic_moe_plugin.core.patching import AttributePatches
from elastic_moe_plugin.cpu_runtime.errors import MegatronCPUError

TRAINING_MODULE = "megatron.training.training"
INITIALIZE_MODULE = "megatron.training.initialize"
FILESYSTEM_ASYNC_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
#: where ``get_device_arch_version`` is defined or bound at import (wheel 0.19: a ``utils`` package)
DEVICE_ARCH_MODULES = ("megatron.training.utils.common_utils", "megatron.training.utils", "megatron.training.arguments")
#: the answer of ``get_device_arch_version`` on the CPU (module docstring)
CPU_DEVICE_ARCH_VERSION = 0
#: where ``set_global_variables`` is defined or bound at import (``initialize`` in older releases)
GLOBAL_VARS_MODULES = ("megatron.training.global_vars", "megatron.training.arguments", "megatron.training.initialize")


@dataclasses.dataclass(frozen=True)
class CPUArgument:
    """One Megatron-LM setting a CPU run needs: the validated ``args`` attribute, its required value,
    the flag that sets it, and why (what fails without it)."""

    attribute: str
    value: Any
    flag: str
    reason: str


#: what every CPU run of ``megatron.training`` needs (each verified by a run without it)
CPU_ARGUMENTS = (
    CPUArgument("distributed_backend", "gloo", "--distributed-backend gloo", "torch has no NCCL without CUDA"),
    CPUArgument("transformer_impl", "local", "--transformer-impl local", "Transformer Engine needs a GPU"),
    CPUArgument(
        "gradient_accumulation_fusion",
        False,
        "--no-gradient-accumulation-fusion",
        "the fusion is apex's CUDA extension",
    ),
    CPUArgument(
        "no_persist_layer_norm",
        True,
        "--no-persist-layer-norm",
        "the persistent norm is apex's fused kernel; torch's norm refuses it",
    ),
    CPUArgument(
        "clip_grad",
        0.0,
        "--clip-grad 0",
        "Megatron's clipping asserts CUDA tensors; the grad norm is still computed and logged",
    ),
)


def check_cpu_arguments(args: Any) -> None:
    """Raise one :class:`MegatronCPUError` listing every :data:`CPU_ARGUMENTS` entry ``args`` misses.

    An attribute ``args`` does not have (another Megatron-LM release) is not checked, nor is
    ``--clip-grad`` while :mod:`.grad_clip` (clipping on host tensors) is enabled: the rehearsals
    enable it so that a recipe keeps its own ``--clip-grad``.
    """
    from elastic_moe_plugin.cpu_runtime import grad_clip

    waived = {"clip_grad"} if grad_clip.is_enabled() else set()
    missing = [
        f"{item.flag} (got {getattr(args, item.attribute)!r}: {item.reason})"
        for item in CPU_ARGUMENTS
        if item.attribute not in waived
        and hasattr(args, item.attribute)
        and getattr(args, item.attribute) != item.value
    ]
    if missing:
        raise MegatronCPUError(
            "Megatron-LM on the CPU (elastic_moe_plugin.cpu_runtime) needs "
            + "; ".join(missing)
            + ". A CPU run passes all of: "
            + " ".join(item.flag for item in CPU_ARGUMENTS if item.attribute not in waived)
            + " (docs/megatron.md, 'Megatron-LM on the CPU')."
        )


def _checked_first(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def set_global_variables(args: Any, *rest: Any, **kwargs: Any) -> Any:
        check_cpu_arguments(args)
        return stock(args, *rest, **kwargs)

    return set_global_variables


def _fix_set_global_variables(patches: AttributePatches, module: types.ModuleType) -> None:
    # wrap: the bindings in arguments/initialize may be taken from a global_vars patched here already
    if callable(vars(module).get("set_global_variables")):
        patches.wrap(module, "set_global_variables", _checked_first)


def _fix_initialize_megatron(patches: AttributePatches, module: types.ModuleType) -> None:
    if callable(getattr(module, "initialize_megatron", None)):
        patches.set(module, "initialize_megatron", functools.partial(module.initialize_megatron, allow_no_cuda=True))


def _cpu_device_arch_version(stock: Any) -> Any:
    def get_device_arch_version() -> int:
        """get_device_arch_version -> 0: the CPU has no GPU architecture (module docstring)."""
        return CPU_DEVICE_ARCH_VERSION

    return get_device_arch_version


def _fix_device_arch_version(patches: AttributePatches, module: types.ModuleType) -> None:
    # wrap, not set: ``arguments`` binds the name at import, possibly from a ``utils`` already patched
    # here; wrap unwraps a marked replacement, so ``restore`` gives every binding the stock function.
    if callable(vars(module).get("get_device_arch_version")):
        patches.wrap(module, "get_device_arch_version", _cpu_device_arch_version)


def _keep_cpu_generator(stock: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(stock)
    def _warmup_jit_function(*args: Any, **kwargs: Any) -> Any:
        state = torch.default_generator.get_state()
        try:
            return stock(*args, **kwargs)
        finally:
            torch.default_generator.set_state(state)  # the weights are drawn from it next (module docstring)

    return _warmup_jit_function


def _fix_jit_warmup(patches: AttributePatches, module: types.ModuleType) -> None:
    if callable(vars(module).get("_warmup_jit_function")):
        patches.wrap(module, "_warmup_jit_function", _keep_cpu_generator)


def _fix_results_queue(patches: AttributePatches, module: types.ModuleType) -> None:
    original = getattr(module, "get_write_results_queue", None)
    if callable(original):  # 0.17+: the start method is an argument
        patches.set(module, "get_write_results_queue", lambda mp_mode="spawn": original("fork"))
    elif callable(getattr(module, "_get_write_results_queue", None)):  # 0.16 hard-codes 'spawn'
        writer: Any = module  # megatron's checkpoint writer: its globals have no types here

        def _get_write_results_queue() -> Any:
            if writer._results_queue is None:  # the module's own cache, as the stock function keeps it
                writer._results_queue = writer.mp.get_context("fork").Manager().Queue()
            return writer._results_queue

        patches.set(module, "_get_write_results_queue", _get_write_results_queue)


def install(patches: AttributePatches) -> None:
    """Answer what ``megatron.training`` asks of CUDA (module docstring)."""
    for module_name in GLOBAL_VARS_MODULES:
        patches.when_imported(module_name, functools.partial(_fix_set_global_variables, patches))
    patches.when_imported(TRAINING_MODULE, functools.partial(_fix_initialize_megatron, patches))
    for module_name in DEVICE_ARCH_MODULES:
        patches.when_imported(module_name, functools.partial(_fix_device_arch_version, patches))
    patches.when_imported(INITIALIZE_MODULE, functools.partial(_fix_jit_warmup, patches))
    patches.when_imported(FILESYSTEM_ASYNC_MODULE, functools.partial(_fix_results_queue, patches))


__all__ = ["CPU_ARGUMENTS", "CPU_DEVICE_ARCH_VERSION", "CPUArgument", "check_cpu_arguments", "install"]
