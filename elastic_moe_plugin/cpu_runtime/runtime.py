"""Explicit opt-in layer that lets the real megatron-core MoE code run on a CPU-only torch.

For tests and the CPU demo only. Megatron's own logic is never replaced: CUDA *runtime* entry
points (``torch.cuda.*``, including Megatron's import-time alias of ``torch.cuda._lazy_call``)
are redirected to CPU or no-op equivalents, two ``torch.distributed`` calls are adapted to what
gloo accepts, 0.16.1's missing "Transformer Engine absent" sentinel is supplied, and an
importable stand-in is provided for the one triton-only module megatron-core 0.19 imports
unconditionally.

Usage::

    from elastic_moe_plugin import cpu_runtime

    cpu_runtime.disable_torch_compile()   # optional, saves ~14 s of inductor compile
    cpu_runtime.enable()                  # before or after ``import megatron.core``
    cpu_runtime.initialize_model_parallel(ep=1)
    ...                                    # build and run real Megatron modules on CPU
    cpu_runtime.destroy()
    cpu_runtime.disable()                 # restores every patched attribute by identity

``enable()`` refuses to run when ``torch.cuda.is_available()`` is True (pass ``force=True``
only in tests), so it cannot silently hide a real GPU in production.

Redirected while enabled (verified against megatron-core 0.16.1 and 0.19.2):

* ``torch.cuda.current_device`` -> ``torch.device("cpu")``: Router.gating moves its weight
  there, and router buffers, mapping outputs and RNG bookkeeping are allocated there.
* ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream`` /
  ``synchronize`` -> no-op stand-ins: the alltoall dispatcher (DtoH side stream), MoELayer and
  shared experts create streams and events; CPU execution is already synchronous.
* ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` (and the same names in
  ``torch.cuda.random``) and ``torch.cuda.default_generators`` -> the CPU default generator:
  ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` then behave on CPU
  tensors exactly as they do on CUDA tensors (fork swaps the generator state, exit restores it).
  ``manual_seed_all`` is deliberately left alone: ``torch.manual_seed`` calls it, so mapping it
  to ``torch.manual_seed`` would recurse.
* Megatron's import-time alias ``megatron.core.tensor_parallel.random._lazy_call`` (a copy of
  ``torch.cuda._lazy_call``) -> run the callback now. On a CPU torch CUDA is never
  "initialized", so torch would queue Megatron's ``_set_cuda_rng_state`` callback forever and
  every RNG fork would silently do nothing. ``torch.cuda._lazy_call`` itself is left alone.
* ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` -> ``None`` when the module lacks
  it. megatron-core 0.16.1 only defines that name when Transformer Engine imports, so without TE
  ``router_gating_linear`` raises NameError (on a GPU too); ``None`` is the "TE absent" value its
  own code tests for (0.19 defines it so), which selects Megatron's torch.mm path.
* ``torch.distributed.all_to_all_single``: split sizes given as tensors become int lists. On a
  GPU Megatron's ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` turns the alltoall split sizes
  into numpy arrays, but it only converts CUDA tensors, so on CPU they stay tensors, which
  ``all_to_all_single`` rejects.
* ``torch.distributed.all_gather`` on a gloo group with unequal first dimensions: pads to the
  largest, gathers, and copies back (gloo rejects unequal sizes; NCCL accepts them). Used by
  the alltoall dispatcher when expert tensor parallelism is > 1. gloo's list ``reduce_scatter``
  already accepts unequal sizes on torch 2.13 and is left alone.
* ``sys.modules["megatron.core.transformer.moe.ops.paged_stash"]`` -> a stand-in whose kernels
  raise :class:`MegatronCPUError` if launched (they only run with ``moe_paged_stash=True``). It
  is installed only when triton is not importable; the ``triton`` package itself is not stubbed
  because that breaks torch's own probes.
* ``torch.cuda.initial_seed`` (and ``torch.cuda.random.initial_seed``) -> the CPU default
  generator's seed: the seed ``model_parallel_cuda_manual_seed`` gave the "CUDA" generator, from
  which the plugin seeds κ's own stream (:mod:`elastic_moe_plugin.mcore.budget_rng`).
* The warning "CPU RNG state changed within GPU RNG context" from
  ``megatron.core.tensor_parallel.random`` is filtered: with the emulation the "GPU" generator
  *is* the CPU generator, so that check fires on every fork that draws random numbers.

Megatron modules imported *after* enable() get their attributes fixed by the post-import hook of
:class:`~elastic_moe_plugin.core.patching.AttributePatches` (``when_imported``), right after the
module executes, so the import order does not matter.

Redirected as well with ``enable(training=True)``, for Megatron-LM's own training loop
(``megatron.training``: ``pretrain``, ``train_step``, ``training_log``, checkpointing; verified
against the megatron-core 0.19.2 wheel, whose ``megatron.training`` also needs
:mod:`elastic_moe_plugin.cpu_runtime.megatron_training` on Python 3.11):

* ``torch.cuda.device_count`` -> 1 and ``torch.cuda.set_device`` -> no-op. Megatron-LM's
  ``_initialize_distributed`` builds the model-parallel groups, and ``_set_random_seed`` seeds the
  RNG tracker, only when ``device_count() > 0``; it then calls ``set_device(local_rank)``.
* ``megatron.training.training.initialize_megatron`` -> called with ``allow_no_cuda=True``:
  ``pretrain`` passes nothing, and the function then asserts ``torch.cuda.is_available()``, which
  this layer leaves False (faking it would send other libraries down their CUDA paths).
* CUDA device arguments -> the CPU, through a ``TorchFunctionMode`` entered on the thread that calls
  ``enable``: ``device="cuda"`` / ``"cuda:N"`` / ``torch.device("cuda", N)`` / an ordinal, in any
  torch function (``megatron.training`` allocates its loss accumulators, the train/valid/test flags
  it broadcasts, timers and more with ``device='cuda'``, at some 70 call sites), the device of
  ``Tensor.to(...)``, and ``Tensor.cuda()`` (returns the tensor). Other arguments pass through.
* ``megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue``
  (``_get_write_results_queue`` in 0.16, which hard-codes the start method) -> its
  multiprocessing Manager is started with 'fork', not 'spawn'. A spawned process re-imports the
  training script in a fresh interpreter where this layer (and the paged-stash stand-in) is off, so
  it dies importing megatron.core and the torch_dist save fails with ``EOFError``. Megatron spawns
  because forking a process holding a CUDA context is unsafe; without CUDA, fork is safe.

Flags a CPU run of ``megatron.training`` passes itself (choices of the run, not redirected):
``--distributed-backend gloo``, ``--transformer-impl local``, ``--use-cpu-initialization``,
``--no-gradient-accumulation-fusion``, ``--no-persist-layer-norm``, ``--no-bias-gelu-fusion`` and
``--disable-bias-linear`` (no fused kernels without Transformer Engine; the bias add of
SequentialMLP experts fails in autograd), and ``--clip-grad 0``:
``clip_grad_by_total_norm_fp32`` asserts ``grad.type() == 'torch.cuda.FloatTensor'``.

Caller-side notes: ``GPTModel`` (both versions) builds its default causal mask with ``device="cuda"``, so
pass an explicit ``attention_mask``; with EP=TP=1 and ``add_bias_linear=True`` the expert MLP's
in-place bias add fails in autograd on any device, so use ``add_bias_linear=False``.

Not covered: fused permute/router (need Transformer Engine), grouped GEMM, CUDA graphs, the flex
dispatcher (DeepEP/HybridEP/NCCL-EP), paged stash, fp8/fp4, NCCL-specific options (SHARP, high
priority streams), and pipeline parallelism (untested). Use ``use_cpu_initialization=True``, the
local specs (``get_gpt_layer_local_spec``) and ``SequentialMLP`` experts.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from elastic_moe_plugin.core.patching import AttributePatches

logger = logging.getLogger(__name__)

__all__ = [
    "PAGED_STASH_MODULE",
    "MegatronCPUError",
    "destroy",
    "disable",
    "disable_torch_compile",
    "enable",
    "enabled",
    "in_rng_tracker_fork",
    "initialize_model_parallel",
    "is_enabled",
]

PAGED_STASH_MODULE = "megatron.core.transformer.moe.ops.paged_stash"

_RNG_LOGGER_NAME = "megatron.core.tensor_parallel.random"
_RNG_FORK_WARNING = "CPU RNG state changed within GPU RNG context"

_CPU = torch.device("cpu")


class MegatronCPUError(RuntimeError):
    """Raised when the CPU compatibility layer cannot do what was asked."""


class _State:
    """Everything enable() changed, so disable() can put it back."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.active = False
        self.patches = AttributePatches()
        self.originals: dict = {}
        self.stand_in: types.ModuleType | None = None
        self.log_filter: logging.Filter | None = None
        self.owned_process_group = False
        self.store_dir: str | None = None
        self.training = False
        self.device_mode: _CudaDevicesOnCPU | None = None


_STATE = _State()


# --------------------------------------------------------------------------------------------
# Stand-ins for the CUDA runtime
# --------------------------------------------------------------------------------------------


class _CPUEvent:
    """No-op torch.cuda.Event: CPU work is complete when the Python call returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        """No-op."""

    def wait(self, stream: Any = None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, end_event: Any) -> float:
        """No timing on CPU; always 0."""
        return 0.0


class _CPUStream:
    """No-op torch.cuda.Stream: there is a single in-order CPU 'stream'."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = _CPU
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        """No-op."""

    def wait_event(self, event: Any) -> None:
        """No-op."""

    def record_event(self, event: Any = None) -> Any:
        """Return the given event, or a new completed one."""
        return event if event is not None else _CPUEvent()

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True


_DEFAULT_STREAM = _CPUStream()


def _current_device() -> torch.device:
    """torch.cuda.current_device -> the CPU device (usable wherever Megatron passes device=)."""
    return _CPU


def _current_stream(device: Any = None) -> _CPUStream:
    """torch.cuda.current_stream/default_stream -> the single CPU stand-in stream."""
    return _DEFAULT_STREAM


@contextlib.contextmanager
def _stream(stream: Any = None) -> Iterator[None]:
    """torch.cuda.stream(s) -> no-op context: CPU ops run in program order."""
    yield


def _synchronize(device: Any = None) -> None:
    """torch.cuda.synchronize -> no-op: CPU ops are synchronous."""


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """torch.cuda.get_rng_state -> state of the CPU default generator."""
    return torch.default_generator.get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """torch.cuda.set_rng_state -> set the CPU default generator."""
    torch.default_generator.set_state(new_state)


def _manual_seed(seed: int) -> None:
    """torch.cuda.manual_seed -> seed the CPU default generator (not torch.manual_seed: recursion)."""
    torch.default_generator.manual_seed(int(seed))


def _initial_seed() -> int:
    """torch.cuda.initial_seed -> the CPU default generator's seed (what _manual_seed set)."""
    return torch.default_generator.initial_seed()


class _CPUGenerators:
    """torch.cuda.default_generators -> every index maps to the CPU default generator."""

    def __getitem__(self, index: Any) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[torch.Generator]:
        yield torch.default_generator


_CPU_GENERATORS = _CPUGenerators()


def _call_now(callable: Callable[[], Any], **kwargs: Any) -> None:
    """Megatron's alias of torch.cuda._lazy_call -> run now (CPU torch never initialises CUDA)."""
    callable()


_CUDA_REDIRECTS = {
    "current_device": _current_device,
    "Stream": _CPUStream,
    "Event": _CPUEvent,
    "current_stream": _current_stream,
    "default_stream": _current_stream,
    "stream": _stream,
    "synchronize": _synchronize,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "manual_seed": _manual_seed,
    "initial_seed": _initial_seed,
    "default_generators": _CPU_GENERATORS,
}
_CUDA_RANDOM_REDIRECTS = ("get_rng_state", "set_rng_state", "manual_seed", "initial_seed")


# --------------------------------------------------------------------------------------------
# Megatron-LM's training loop (megatron.training): enable(training=True)
# --------------------------------------------------------------------------------------------


def _device_count() -> int:
    """torch.cuda.device_count -> 1: the CPU is the one "device" of each process."""
    return 1


def _set_device(device: Any) -> None:
    """torch.cuda.set_device -> no-op: there is one CPU device, always current."""


_TRAINING_CUDA_REDIRECTS = {"device_count": _device_count, "set_device": _set_device}


def _on_cpu(device: Any) -> Any:
    """A CUDA device (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda", N)``, an ordinal N) -> CPU."""
    if isinstance(device, str) and device.split(":", 1)[0] == "cuda":
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    return device


class _CudaDevicesOnCPU(TorchFunctionMode):
    """Runs torch functions that name a CUDA device on the CPU instead.

    ``device=`` of any torch function (factories such as ``torch.tensor(..., device="cuda")``,
    ``torch.zeros``, ``torch.empty``, ...) and the device of ``Tensor.to(...)`` map to the CPU;
    ``Tensor.cuda()`` returns the tensor itself. Everything else passes through untouched.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _on_cpu(kwargs["device"])}
        if func is _TENSOR_CUDA:
            return args[0]
        if func is _TENSOR_TO and len(args) > 1:
            args = (args[0], _on_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TO = torch.Tensor.to


def _fix_initialize_megatron(module: types.ModuleType) -> None:
    """``pretrain`` calls ``initialize_megatron()`` without ``allow_no_cuda``, which then asserts
    ``torch.cuda.is_available()``; this layer leaves that False (other libraries would take their
    CUDA paths), so pass ``allow_no_cuda=True``."""
    if _STATE.training and callable(getattr(module, "initialize_megatron", None)):
        _patch(module, "initialize_megatron", functools.partial(module.initialize_megatron, allow_no_cuda=True))


def _fix_results_queue(module: types.ModuleType) -> None:
    """The torch_dist checkpoint writer collects results through a multiprocessing Manager started
    with 'spawn'. A spawned process re-imports the training script in a fresh interpreter where
    this layer (and the paged-stash stand-in) is off, so it dies on ``import megatron.core`` and the
    save fails with EOFError. Megatron spawns because forking a process that holds a CUDA context
    is unsafe; without CUDA, fork is safe and the child inherits this layer."""
    if not _STATE.training:
        return
    original = getattr(module, "get_write_results_queue", None)
    if callable(original):  # 0.17+: the start method is an argument
        _patch(module, "get_write_results_queue", lambda mp_mode="spawn": original("fork"))
    elif callable(getattr(module, "_get_write_results_queue", None)):  # 0.16 hard-codes 'spawn'

        def _get_write_results_queue():
            if module._results_queue is None:  # the module's own cache, as the stock function keeps it
                module._results_queue = module.mp.get_context("fork").Manager().Queue()
            return module._results_queue

        _patch(module, "_get_write_results_queue", _get_write_results_queue)


_TRAINING_FIXUPS = {
    "megatron.training.training": _fix_initialize_megatron,
    "megatron.core.dist_checkpointing.strategies.filesystem_async": _fix_results_queue,
}


# --------------------------------------------------------------------------------------------
# torch.distributed adaptations for gloo
# --------------------------------------------------------------------------------------------


def _as_int_list(split_sizes: Any) -> Any:
    if split_sizes is None or isinstance(split_sizes, list):
        return split_sizes
    return [int(s) for s in split_sizes]


def _all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """all_to_all_single with tensor split sizes converted to int lists (CUDA path gives numpy)."""
    return _STATE.originals["all_to_all_single"](
        output,
        input,
        output_split_sizes=_as_int_list(output_split_sizes),
        input_split_sizes=_as_int_list(input_split_sizes),
        group=group,
        async_op=async_op,
    )


def _all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """all_gather that pads unequal first dimensions on gloo (gloo rejects them, NCCL does not)."""
    original = _STATE.originals["all_gather"]
    shapes = {tuple(t.shape) for t in tensor_list}
    if (
        async_op
        or len(shapes) <= 1
        or len({shape[1:] for shape in shapes}) != 1
        or torch.distributed.get_backend(group) != "gloo"
    ):
        return original(tensor_list, tensor, group=group, async_op=async_op)
    longest = max(t.shape[0] for t in tensor_list)
    padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
    padded[: tensor.shape[0]].copy_(tensor)
    gathered = [torch.empty_like(padded) for _ in tensor_list]
    original(gathered, padded, group=group)
    for out, full in zip(tensor_list, gathered):
        out.copy_(full[: out.shape[0]])
    return None


_DISTRIBUTED_REDIRECTS = {"all_to_all_single": _all_to_all_single, "all_gather": _all_gather}


# --------------------------------------------------------------------------------------------
# Stand-in for the triton-only paged-stash kernels (megatron-core >= 0.19)
# --------------------------------------------------------------------------------------------


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


def _make_paged_stash_stand_in() -> types.ModuleType:
    module = types.ModuleType(
        PAGED_STASH_MODULE,
        "CPU stand-in for Megatron's triton paged-stash kernels (elastic_moe_plugin.testing).",
    )
    # Same value as upstream; it only sizes launch grids, which never run here.
    module.GLOBAL_BLOCK_SIZE = 1024
    module.paged_stash_copy_kernel = _UnavailableTritonKernel("paged_stash_copy_kernel")
    module.paged_stash_pop_kernel = _UnavailableTritonKernel("paged_stash_pop_kernel")
    module.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    module.__cpu_runtime_stand_in__ = True
    return module


def _install_paged_stash_stand_in() -> None:
    if PAGED_STASH_MODULE in sys.modules:
        return  # the real module (or an earlier stand-in) is already importable
    if importlib.util.find_spec("triton") is not None:
        return  # the real module imports fine
    if _STATE.stand_in is None:
        _STATE.stand_in = _make_paged_stash_stand_in()
    sys.modules[PAGED_STASH_MODULE] = _STATE.stand_in


def _remove_paged_stash_stand_in() -> None:
    if _STATE.stand_in is not None and sys.modules.get(PAGED_STASH_MODULE) is _STATE.stand_in:
        # Megatron modules imported meanwhile keep their references; a fresh import would
        # again need triton, exactly as without this layer.
        del sys.modules[PAGED_STASH_MODULE]


# --------------------------------------------------------------------------------------------
# Attributes of Megatron modules (applied at enable(), or right after a later import)
# --------------------------------------------------------------------------------------------


def _fix_lazy_call_alias(module: types.ModuleType) -> None:
    if getattr(module, "_lazy_call", None) is torch.cuda._lazy_call:
        _patch(module, "_lazy_call", _call_now)


def _fix_missing_te_general_gemm(module: types.ModuleType) -> None:
    if not hasattr(module, "te_general_gemm"):
        _patch(module, "te_general_gemm", None)


_MEGATRON_FIXUPS = {
    # Both bind ``from torch.cuda import _lazy_call`` at import time.
    "megatron.core.tensor_parallel.random": _fix_lazy_call_alias,
    "megatron.core.distributed.fsdp.src.megatron_fsdp.utils": _fix_lazy_call_alias,
    "megatron.core.transformer.moe.moe_utils": _fix_missing_te_general_gemm,
    # enable(training=True) only (each checks _STATE.training)
    **_TRAINING_FIXUPS,
}


# --------------------------------------------------------------------------------------------
# enable / disable
# --------------------------------------------------------------------------------------------


class _DropEmulatedRngWarning(logging.Filter):
    """Drops Megatron's fork warning, which always fires when the CUDA RNG is the CPU RNG."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _RNG_FORK_WARNING


def _patch(owner: Any, name: str, replacement: Any) -> None:
    _STATE.patches.set(owner, name, replacement)


def _undo() -> None:
    if _STATE.device_mode is not None:
        _STATE.device_mode.__exit__(None, None, None)
        _STATE.device_mode = None
    _STATE.training = False
    _STATE.patches.restore()
    _STATE.originals.clear()
    _remove_paged_stash_stand_in()
    if _STATE.log_filter is not None:
        logging.getLogger(_RNG_LOGGER_NAME).removeFilter(_STATE.log_filter)
        _STATE.log_filter = None


def enable(force: bool = False, *, training: bool = False) -> None:
    """Turn the layer on (idempotent). Callable before or after ``import megatron.core``.

    Args:
        force: activate even though ``torch.cuda.is_available()`` is True. For tests only:
            on a GPU machine this would route Megatron's device placement to the CPU.
        training: also redirect what Megatron-LM's training loop (``megatron.training``) needs
            (module docstring). Adds to a layer already on; :func:`disable` removes both.

    Raises:
        MegatronCPUError: CUDA is available and ``force`` is False.
    """
    with _STATE.lock:
        if not _STATE.active:
            _enable_runtime(force)
        if training and not _STATE.training:
            try:
                _enable_training()
            except BaseException:
                _undo()
                _STATE.active = False
                raise


def _enable_runtime(force: bool) -> None:
    if torch.cuda.is_available():
        if not force:
            raise MegatronCPUError(
                "torch.cuda.is_available() is True: refusing to redirect the CUDA runtime to "
                "the CPU. Run Megatron on the GPU without elastic_moe_plugin.cpu_runtime, or pass force=True "
                "in a test that really wants the CPU path."
            )
        logger.warning("cpu_runtime forced on although CUDA is available")
    try:
        _install_paged_stash_stand_in()
        for name, replacement in _CUDA_REDIRECTS.items():
            _patch(torch.cuda, name, replacement)
        for name in _CUDA_RANDOM_REDIRECTS:
            _patch(torch.cuda.random, name, _CUDA_REDIRECTS[name])
        if torch.distributed.is_available():
            for name, replacement in _DISTRIBUTED_REDIRECTS.items():
                _STATE.originals[name] = getattr(torch.distributed, name)
                _patch(torch.distributed, name, replacement)
        for module_name, fixup in _MEGATRON_FIXUPS.items():
            # now if imported, else right after its import (core.patching's one post-import hook)
            _STATE.patches.when_imported(module_name, fixup)
        _STATE.log_filter = _DropEmulatedRngWarning()
        logging.getLogger(_RNG_LOGGER_NAME).addFilter(_STATE.log_filter)
    except BaseException:
        _undo()
        raise
    _STATE.active = True
    logger.debug("cpu_runtime enabled: %d attributes redirected", len(_STATE.patches))


def _enable_training() -> None:
    _STATE.training = True
    for name, replacement in _TRAINING_CUDA_REDIRECTS.items():
        _patch(torch.cuda, name, replacement)
    for module_name, fixup in _TRAINING_FIXUPS.items():
        module = sys.modules.get(module_name)
        if module is not None:
            fixup(module)
    # The mode stack is per thread: this covers the thread that runs the training loop.
    _STATE.device_mode = _CudaDevicesOnCPU()
    _STATE.device_mode.__enter__()


def disable() -> None:
    """Turn the layer off (idempotent), restoring every patched attribute by identity.

    Also removes the import hook and the paged-stash stand-in from ``sys.modules``. Megatron
    modules imported while enabled stay imported and behave as stock code afterwards.
    """
    with _STATE.lock:
        if not _STATE.active:
            return
        _undo()
        _STATE.active = False
        logger.debug("cpu_runtime disabled")


def is_enabled() -> bool:
    """Whether the layer is currently on (with or without the training-loop part)."""
    return _STATE.active


@contextlib.contextmanager
def enabled(force: bool = False, *, training: bool = False) -> Iterator[None]:
    """Context manager: enable() on entry; on exit disable() unless it was already enabled."""
    was_enabled = is_enabled()
    enable(force=force, training=training)
    try:
        yield
    finally:
        if not was_enabled:
            disable()


def in_rng_tracker_fork() -> bool:
    """Whether Megatron's ``CudaRNGStatesTracker.fork`` is on the calling stack.

    For host-sync counters under this layer. ``fork`` ends with
    ``torch.all(cpu_rng_state == torch.get_rng_state()).item()``, a comparison of two states of the
    *CPU* generator: host tensors on a GPU too, so that read never waits for the device. Here every
    tensor is a host tensor, so a counter of device reads cannot tell it by its device and asks
    this instead. (κ is drawn inside such a fork: :mod:`elastic_moe_plugin.mcore.budget_rng`.)
    """
    frame = sys._getframe(1)
    suffix = os.path.join("tensor_parallel", "random.py")
    while frame is not None:
        if frame.f_code.co_name == "fork" and frame.f_code.co_filename.endswith(suffix):
            return True
        frame = frame.f_back
    return False


def disable_torch_compile() -> None:
    """Make ``torch.compile`` a no-op in this process and its children (TORCH_COMPILE_DISABLE=1).

    Megatron wraps ``TopKRouter._apply_expert_bias`` in ``torch.compile`` (``jit_fuser``); its
    first call costs ~14 s of inductor compile on CPU. Not undone by :func:`disable`. Setting
    ``TORCH_COMPILE_DISABLE=1`` in the environment before starting Python has the same effect.
    """
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    # torch reads the variable when torch._dynamo.config is first imported; if that already
    # happened, set the flag it produced (it is checked per call).
    dynamo_config = sys.modules.get("torch._dynamo.config")
    if dynamo_config is not None:
        dynamo_config.disable = True


# --------------------------------------------------------------------------------------------
# Process groups for tests
# --------------------------------------------------------------------------------------------


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
        MegatronCPUError: the layer is not enabled, the existing group is not gloo, or Megatron's
            model-parallel state is already initialised (call :func:`destroy` first).
    """
    if not is_enabled():
        raise MegatronCPUError("call cpu_runtime.enable() before initialize_model_parallel()")
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        raise MegatronCPUError(
            "Megatron model parallel state is already initialised; call cpu_runtime.destroy() "
            "first"
        )
    if dist.is_initialized():
        if dist.get_backend() != "gloo":
            raise MegatronCPUError(
                f"the default process group uses {dist.get_backend()!r}; the CPU runtime needs gloo"
            )
    else:
        if init_method is not None:
            if rank is None or world_size is None:
                raise MegatronCPUError("init_method needs rank and world_size as well")
            dist.init_process_group(
                "gloo", init_method=init_method, rank=rank, world_size=world_size
            )
        elif "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo", init_method="env://")
        else:
            _STATE.store_dir = tempfile.mkdtemp(prefix="elastic_moe_cpu_runtime_")
            store = dist.FileStore(os.path.join(_STATE.store_dir, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        _STATE.owned_process_group = True
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
    if _STATE.owned_process_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _STATE.owned_process_group = False
    if _STATE.store_dir is not None:
        shutil.rmtree(_STATE.store_dir, ignore_errors=True)
        _STATE.store_dir = None
