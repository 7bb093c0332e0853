"""Where the demo's runs train (``DemoSettings.device``): the CPU runtime, or one CUDA GPU.

- ``"cpu"`` (the default, on any machine): Megatron on the CPU through the opt-in
  :mod:`elastic_moe_plugin.cpu_runtime`, on for all the runs (forced on a CUDA machine: the demo runs
  on the CPU by design); per run, gloo and Megatron's model-parallel state
  (``cpu_runtime.initialize_model_parallel`` / ``cpu_runtime.destroy``).
- ``"cuda"`` (``elastic-moe compare --device cuda``): Megatron's own CUDA path on the current CUDA
  device, as ``elastic-moe bench``'s CUDA modes set it up; per run, an NCCL process group of world
  size 1 on a free local port (unless the caller made one), ``parallel_state.initialize_model_parallel()``
  and ``tensor_parallel.model_parallel_cuda_manual_seed(seed)``. This path never imports the CPU
  runtime (a GPU run never loads it). torch.compile is off unless ``TORCH_COMPILE_DISABLE`` is set,
  as on the CPU: the same eager code on both devices, and no compile time in a GPU's budget.

On both devices the model is initialised on the CPU (the model config's ``use_cpu_initialization``)
from the same seed, so both start from the same weights; the corpus' batches are drawn on the CPU.
:mod:`.train` moves the model and the batches to :func:`torch_device` and returns CPU tensors.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator

import torch

from elastic_moe_plugin.core.errors import ConfigError


def check_available(device: str) -> None:
    """Refuse ``device="cuda"`` without a CUDA device, before anything is built or loaded.

    Raises:
        ConfigError: ``device`` is "cuda" and ``torch.cuda.is_available()`` is False.
    """
    if device != "cuda" or torch.cuda.is_available():
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    found = f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none, a CPU-only build'})"
    found += f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    raise ConfigError(
        f"device='cuda' (--device cuda) trains on a CUDA GPU, and this machine has none that torch can use: "
        f"{found}, torch.cuda.is_available() is False. Train on the CPU with --device cpu (device='cpu'), "
        "or run on a machine with a CUDA GPU and a CUDA build of torch.",
        field="device",
        fixes=({"device": "cpu"},),
    )


def torch_device(device: str) -> torch.device:
    """The torch device the runs of ``device`` train on (for "cuda": the current CUDA device)."""
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def device_entry(device: str) -> dict[str, str]:
    """``{"device": ...}`` for the output files, with the GPU's name on "cuda"."""
    if device != "cuda" or not torch.cuda.is_available():
        return {"device": device}
    return {"device": device, "device_name": torch.cuda.get_device_name(torch.cuda.current_device())}


def _compile_off_unless_set() -> None:
    """``TORCH_COMPILE_DISABLE=1`` unless the environment already says; torch reads the variable when
    ``torch._dynamo.config`` is first imported, so set the flag it produced if that happened."""
    if "TORCH_COMPILE_DISABLE" in os.environ:
        return
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    if "torch._dynamo.config" in sys.modules:
        from torch._dynamo import config as dynamo_config

        dynamo_config.disable = True


@contextlib.contextmanager
def megatron_runtime(device: str) -> Iterator[None]:
    """What every run of ``device`` needs, for all the runs of one :func:`~.train.train_runs`."""
    if device == "cuda":
        _compile_off_unless_set()
        yield
        return
    from elastic_moe_plugin import cpu_runtime

    cpu_runtime.disable_torch_compile()
    cuda = torch.cuda.is_available()
    if cuda:
        print("elastic-moe demo: CUDA is available, but this demo runs on the CPU by design.", file=sys.stderr)
    with cpu_runtime.enabled(force=cuda):
        yield


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _cuda_process_group() -> bool:
    """An NCCL process group of world size 1, made here unless one exists; returns whether it was made.

    Raises:
        ConfigError: the existing group has several ranks (the demo trains one model on one GPU).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        return True
    if dist.get_world_size() != 1:
        raise ConfigError(
            f"device='cuda' trains one model on one GPU, and this process already belongs to a process group "
            f"of {dist.get_world_size()} ranks ({dist.get_backend()}): run elastic-moe compare --device cuda "
            "as a single process, without torchrun.",
            field="device",
        )
    return False


@contextlib.contextmanager
def model_parallel(device: str, seed: int) -> Iterator[None]:
    """Megatron's model-parallel state and RNG seeds for one run (``seed``), torn down on exit."""
    if device != "cuda":
        from elastic_moe_plugin import cpu_runtime

        cpu_runtime.initialize_model_parallel(seed=seed)
        try:
            yield
        finally:
            cpu_runtime.destroy()
        return
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    made_group = _cuda_process_group()
    try:
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        # The group made here goes with the run, as cpu_runtime.destroy() does on the CPU:
        # destroy_model_parallel() only drops Megatron's references (it destroys its gloo groups
        # alone), so the NCCL subgroups of every run, and the communicators their collectives
        # opened, would pile up over a study's runs; destroying the default group frees them all,
        # and the next run makes a fresh one (world size 1: well under a second).
        if made_group and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["check_available", "device_entry", "megatron_runtime", "model_parallel", "torch_device"]
