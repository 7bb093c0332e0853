"""megatron-core on a CPU-only torch: a triton-only module, two import-time bindings, a sentinel
0.16.1 lacks, a torch norm usable with sequence parallelism, and one warning.

Installed by :func:`install` (every ``cpu_runtime.enable()``). Module attributes are set now if the
module is imported, else right after its import (:meth:`AttributePatches.when_imported`), so
``enable()`` may come before or after ``import megatron.core``.

* ``sys.modules["megatron.core.transformer.moe.ops.paged_stash"]`` -> a stand-in whose kernels
  raise :class:`MegatronCPUError` if launched (they only run with ``moe_paged_stash=True``).
  megatron-core 0.19 imports that module unconditionally (``import megatron.core`` reaches it
  through the pipeline schedules), and it does ``import triton`` at its top. Installed only when
  triton is not importable; the ``triton`` package itself is never stubbed, because torch probes it
  (``torch.utils._triton``, inductor) and a stub sends torch down its triton paths.
* ``megatron.core.tensor_parallel.random._lazy_call`` and the same name in
  ``megatron.core.distributed.fsdp.src.megatron_fsdp.utils`` (import-time copies of
  ``torch.cuda._lazy_call``) -> run the callback now. On a CPU torch CUDA is never "initialized",
  so torch would queue Megatron's ``_set_cuda_rng_state`` callback forever and every RNG fork would
  silently do nothing. ``torch.cuda._lazy_call`` itself is left alone.
* ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` -> ``None`` when the module lacks it.
  megatron-core 0.16.1 only defines that name when Transformer Engine imports, so without TE
  ``router_gating_linear`` raises NameError (on a GPU too); ``None`` is the "TE absent" value its
  own code tests for (0.19 defines it so), which selects Megatron's ``torch.mm`` path.
* ``megatron.core.transformer.torch_norm.WrappedTorchNorm`` (the norm of the local specs,
  ``--transformer-impl local``) with ``config.sequence_parallel`` -> the same torch ``LayerNorm`` /
  ``RMSNorm`` the stock class builds, whose parameters carry ``sequence_parallel = True``, as
  Transformer Engine's and apex's norms mark theirs. The stock class asserts "sequence parallel not
  supported by torch LayerNorm" instead, so TP > 1 MoE training (for which Megatron requires
  sequence parallelism) could not run on CPU at all. Why it is exact: a norm is per token, so each
  tensor-parallel rank normalises its own sequence shard with the replicated weight; the weight's
  gradient is then the sum over the shards, which ``finalize_model_grads`` forms by all-reducing
  every parameter marked ``sequence_parallel`` over the TP group (the same step Megatron applies to
  the router weight). Without sequence parallelism the stock constructor runs unchanged.
* The warning "CPU RNG state changed within GPU RNG context" of
  ``megatron.core.tensor_parallel.random`` is filtered: with the emulation the "GPU" generator *is*
  the CPU generator, so that check fires on every fork that draws random numbers.

Also here, for callers: :func:`in_rng_tracker_fork` (host-sync counters) and
:func:`disable_torch_compile`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from elastic_moe_plugin.core.patching import AttributePatches
from elastic_moe_plugin.cpu_runtime import fused_router, hybrid
from elastic_moe_plugin.cpu_runtime.errors import MegatronCPUError

PAGED_STASH_MODULE = "megatron.core.transformer.moe.ops.paged_stash"
TORCH_NORM_MODULE = "megatron.core.transformer.torch_norm"

_RNG_LOGGER_NAME = "megatron.core.tensor_parallel.random"
_RNG_FORK_WARNING = "CPU RNG state changed within GPU RNG context"
#: both bind ``from torch.cuda import _lazy_call`` at import time
_LAZY_CALL_ALIASES = ("megatron.core.tensor_parallel.random", "megatron.core.distributed.fsdp.src.megatron_fsdp.utils")
_MOE_UTILS_MODULE = "megatron.core.transformer.moe.moe_utils"


# ------------------------------------------------------------------------------ paged stash
class _UnavailableTritonKernel:
    """Stand-in for a triton kernel: importable, raises if launched."""

    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __getitem__(self, grid: Any) -> _UnavailableTritonKernel:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise MegatronCPUError(
            f"{PAGED_STASH_MODULE}.{self.__name__} is a CPU stand-in installed by "
            "elastic_moe_plugin.cpu_runtime; the real kernel needs triton and a GPU. "
            "Set moe_paged_stash=False, or run on a GPU without elastic_moe_plugin.cpu_runtime."
        )

    def __repr__(self) -> str:
        return f"<unavailable triton kernel {self.__name__} (cpu_runtime stand-in)>"


def _paged_stash_stand_in() -> types.ModuleType:
    module = types.ModuleType(
        PAGED_STASH_MODULE, "CPU stand-in for Megatron's triton paged-stash kernels (elastic_moe_plugin.cpu_runtime)."
    )
    vars(module).update(
        # Same value as upstream; it only sizes launch grids, which never run here.
        GLOBAL_BLOCK_SIZE=1024,
        paged_stash_copy_kernel=_UnavailableTritonKernel("paged_stash_copy_kernel"),
        paged_stash_pop_kernel=_UnavailableTritonKernel("paged_stash_pop_kernel"),
        __all__=["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"],
        __cpu_runtime_stand_in__=True,
    )
    return module


def _install_paged_stash_stand_in(patches: AttributePatches) -> None:
    if PAGED_STASH_MODULE in sys.modules:
        return  # the real module (or an earlier stand-in) is already importable
    if importlib.util.find_spec("triton") is not None:
        return  # the real module imports fine
    stand_in = _paged_stash_stand_in()
    sys.modules[PAGED_STASH_MODULE] = stand_in

    def remove() -> None:
        # Megatron modules imported meanwhile keep their references; a fresh import would again
        # need triton, exactly as without the runtime.
        if sys.modules.get(PAGED_STASH_MODULE) is stand_in:
            del sys.modules[PAGED_STASH_MODULE]

    patches.on_restore(remove)


# ------------------------------------------------------------------------------ module attributes
def _call_now(callable: Callable[[], Any], **kwargs: Any) -> None:
    """Megatron's alias of torch.cuda._lazy_call -> run now (CPU torch never initialises CUDA)."""
    callable()


def _fix_lazy_call_alias(patches: AttributePatches, module: types.ModuleType) -> None:
    if getattr(module, "_lazy_call", None) is torch.cuda._lazy_call:
        patches.set(module, "_lazy_call", _call_now)


def _fix_missing_te_general_gemm(patches: AttributePatches, module: types.ModuleType) -> None:
    if not hasattr(module, "te_general_gemm"):
        patches.set(module, "te_general_gemm", None)


class _WithoutSequenceParallel:
    """A read-only view of a ``TransformerConfig`` that answers ``sequence_parallel = False``.

    The stock ``WrappedTorchNorm`` reads only config fields; through this view it keeps every check
    but the one this runtime answers (its other assertions still reject what torch norms lack).
    """

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        if name == "sequence_parallel":
            return False
        return getattr(self._config, name)


def _sequence_parallel_norm(stock: Any) -> Any:
    stock_new = stock.__func__ if isinstance(stock, staticmethod) else stock

    def __new__(cls, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """The stock torch norm; with ``config.sequence_parallel`` its parameters are marked
        ``sequence_parallel`` so their gradients are all-reduced over the TP group (module docstring)."""
        if not getattr(config, "sequence_parallel", False):
            return stock_new(cls, config, *args, **kwargs)
        norm = stock_new(cls, _WithoutSequenceParallel(config), *args, **kwargs)
        for parameter in norm.parameters():
            parameter.sequence_parallel = True
        return norm

    # A plain function: ``cls.__new__`` looked up on the class is called with ``cls`` first either
    # way, and a staticmethod's ``__wrapped__`` is read-only (AttributePatches marks replacements).
    return __new__


def _fix_torch_norm(patches: AttributePatches, module: types.ModuleType) -> None:
    norm_class = getattr(module, "WrappedTorchNorm", None)
    if isinstance(norm_class, type) and "__new__" in vars(norm_class):
        patches.wrap(norm_class, "__new__", _sequence_parallel_norm)


_MODULE_FIXUPS: dict[str, Callable[[AttributePatches, types.ModuleType], None]] = {
    **dict.fromkeys(_LAZY_CALL_ALIASES, _fix_lazy_call_alias),
    _MOE_UTILS_MODULE: _fix_missing_te_general_gemm,
    TORCH_NORM_MODULE: _fix_torch_norm,
}


# ------------------------------------------------------------------------------ the warning
class _DropEmulatedRngWarning(logging.Filter):
    """Drops Megatron's fork warning, which always fires when the CUDA RNG is the CPU RNG."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _RNG_FORK_WARNING


def install(patches: AttributePatches) -> None:
    """Make megatron-core importable and runnable on CPU (module docstring)."""
    _install_paged_stash_stand_in(patches)
    for module_name, fixup in _MODULE_FIXUPS.items():
        patches.when_imported(module_name, functools.partial(fixup, patches))
    hybrid.install(patches)  # HybridStack's final norm (megatron-core 0.19's HybridModel)
    fused_router.install(patches)  # Transformer Engine's fused router functions, unfused
    log_filter = _DropEmulatedRngWarning()
    logging.getLogger(_RNG_LOGGER_NAME).addFilter(log_filter)
    patches.on_restore(lambda: logging.getLogger(_RNG_LOGGER_NAME).removeFilter(log_filter))


# ------------------------------------------------------------------------------ for callers
def in_rng_tracker_fork() -> bool:
    """Whether Megatron's ``CudaRNGStatesTracker.fork`` is on the calling stack.

    For host-sync counters under this runtime. ``fork`` ends with
    ``torch.all(cpu_rng_state == torch.get_rng_state()).item()``, a comparison of two states of the
    *CPU* generator: host tensors on a GPU too, so that read never waits for the device. Here every
    tensor is a host tensor, so a counter of device reads cannot tell it by its device and asks
    this instead. (Dropout in tensor-parallel regions runs inside such a fork; κ no longer does: it
    is drawn on the host, :mod:`elastic_moe_plugin.core.budget_stream`.)
    """
    frame: types.FrameType | None = sys._getframe(1)
    suffix = os.path.join("tensor_parallel", "random.py")
    while frame is not None:
        if frame.f_code.co_name == "fork" and frame.f_code.co_filename.endswith(suffix):
            return True
        frame = frame.f_back
    return False


def disable_torch_compile() -> None:
    """Make ``torch.compile`` a no-op in this process and its children (TORCH_COMPILE_DISABLE=1).

    Megatron wraps ``TopKRouter._apply_expert_bias`` in ``torch.compile`` (``jit_fuser``); its
    first call waits for inductor to compile it, which is slow on CPU (docs/performance.md). Not
    undone by ``cpu_runtime.disable()``. Setting ``TORCH_COMPILE_DISABLE=1`` in the environment
    before starting Python has the same effect.
    """
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    # torch reads the variable when torch._dynamo.config is first imported; if that already
    # happened, set the flag it produced (it is checked per call).
    if "torch._dynamo.config" in sys.modules:
        from torch._dynamo import config as dynamo_config

        dynamo_config.disable = True


__all__ = ["PAGED_STASH_MODULE", "TORCH_NORM_MODULE", "disable_torch_compile", "in_rng_tracker_fork", "install"]
