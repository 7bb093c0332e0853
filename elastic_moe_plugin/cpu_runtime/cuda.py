"""Stand-ins for the CUDA *runtime*: devices, streams, events, the RNG, CUDA device arguments.

Megatron's own logic is left alone; only what it asks of ``torch.cuda`` is answered on the CPU.

Installed by :func:`install` (every ``cpu_runtime.enable()``), on ``torch.cuda`` (and the RNG names
on ``torch.cuda.random`` too):

* ``current_device`` -> ``torch.device("cpu")``: ``Router.gating`` moves its weight there, and
  router buffers, mapping outputs and RNG bookkeeping are allocated there.
* ``Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream`` / ``synchronize``
  -> no-op stand-ins: the alltoall dispatcher (its DtoH side stream), ``MoELayer`` and shared experts
  create streams and events; CPU execution is already synchronous and in program order.
* ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` / ``initial_seed`` and
  ``default_generators`` -> the CPU default generator. ``model_parallel_cuda_manual_seed`` and
  ``get_cuda_rng_tracker().fork()`` then behave on CPU tensors exactly as they do on CUDA tensors
  (fork swaps the generator state, exit restores it), and ``initial_seed`` reads back the seed
  ``model_parallel_cuda_manual_seed`` gave the "CUDA" generator, from which κ's own stream is seeded
  (:mod:`elastic_moe_plugin.mcore.budget_rng`). ``manual_seed_all`` is deliberately left alone:
  ``torch.manual_seed`` calls it, so mapping it to ``torch.manual_seed`` would recurse.

Installed by :func:`install_training` (``enable(training=True)``, for Megatron-LM's training loop):

* ``device_count`` -> 1 and ``set_device`` -> no-op. Megatron-LM's ``_initialize_distributed``
  builds the model-parallel groups, and ``_set_random_seed`` seeds the RNG tracker, only when
  ``device_count() > 0``; it then calls ``set_device(local_rank)``.
* CUDA device arguments -> the CPU, through a ``TorchFunctionMode`` entered on the thread that calls
  ``enable``: ``device="cuda"`` / ``"cuda:N"`` / ``torch.device("cuda", N)`` / an ordinal, in any
  torch function (``megatron.training`` allocates its loss accumulators, the train/valid/test flags
  it broadcasts, timers and more with ``device='cuda'``, at some 70 call sites), the device of
  ``Tensor.to(...)``, and ``Tensor.cuda()`` (returns the tensor). Other arguments pass through.

``torch.cuda.is_available()`` stays False throughout: faking it would send other libraries down
their CUDA paths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from elastic_moe_plugin.core.patching import AttributePatches

_CPU = torch.device("cpu")


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


_RUNTIME_REDIRECTS: dict[str, Any] = {
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
    "default_generators": _CPUGenerators(),
}
#: ``torch.cuda.random`` holds its own bindings of these (Megatron imports some from there)
_RANDOM_MODULE_REDIRECTS = ("get_rng_state", "set_rng_state", "manual_seed", "initial_seed")


def install(patches: AttributePatches) -> None:
    """Redirect the CUDA runtime calls of megatron-core (module docstring, first list)."""
    for name, replacement in _RUNTIME_REDIRECTS.items():
        patches.set(torch.cuda, name, replacement)
    for name in _RANDOM_MODULE_REDIRECTS:
        patches.set(torch.cuda.random, name, _RUNTIME_REDIRECTS[name])


# ------------------------------------------------------------------------------ training loop
def _device_count() -> int:
    """torch.cuda.device_count -> 1: the CPU is the one "device" of each process."""
    return 1


def _set_device(device: Any) -> None:
    """torch.cuda.set_device -> no-op: there is one CPU device, always current."""


def _on_cpu(device: Any) -> Any:
    """A CUDA device (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda", N)``, an ordinal N) -> CPU."""
    if isinstance(device, str) and device.split(":", 1)[0] == "cuda":
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    return device


_TENSOR_CUDA: Callable[..., Any] = torch.Tensor.cuda
_TENSOR_TO: Callable[..., Any] = torch.Tensor.to


class CudaDevicesOnCPU(TorchFunctionMode):
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


def install_training(patches: AttributePatches) -> None:
    """Answer the device questions of Megatron-LM's training loop (module docstring, second list).

    The device mode is entered here, on the calling thread (torch's mode stack is per thread: this
    covers the thread that runs the training loop), and left when ``patches`` are restored.
    """
    patches.set(torch.cuda, "device_count", _device_count)
    patches.set(torch.cuda, "set_device", _set_device)
    mode = CudaDevicesOnCPU()
    mode.__enter__()
    patches.on_restore(lambda: mode.__exit__(None, None, None))


__all__ = ["CudaDevicesOnCPU", "install", "install_training"]
