"""The CPU runtime: the real Megatron-core and Megatron-LM's training loop on a CPU-only torch with gloo.

Explicit and opt-in: nothing here is needed to train on GPUs, no adapter imports it, and a GPU run
never loads it. It exists so the tests, the demo, the benchmarks and
``python -m elastic_moe_plugin.megatron_lm --cpu SCRIPT ...`` run the frameworks' own code paths on a
machine without CUDA. Megatron's logic is never replaced: only the CUDA *runtime* is redirected,
and GPU-only components (triton kernels, Transformer Engine's sequence-parallel norm) have local
stand-ins, each scoped so the framework sees what it would see without them.

What it redirects, by concern (each module lists its redirections and says why):

- :mod:`.cuda`: ``torch.cuda``'s device, stream, event and RNG calls answered on the CPU (the
  default generator serves as the "CUDA" one, so Megatron's RNG tracker forks as on a GPU); with
  ``training=True`` also ``device_count``/``set_device`` and every ``device="cuda"`` argument.
- :mod:`.distributed`: ``all_to_all_single`` and ``all_gather`` called the way NCCL allows and gloo
  does not (tensor split sizes, unequal sizes).
- :mod:`.megatron_core`: the triton-only paged-stash module (a stand-in; ``triton`` itself is never
  stubbed), Megatron's import-time alias of ``torch.cuda._lazy_call``, 0.16.1's missing
  ``te_general_gemm`` sentinel, a torch norm usable with sequence parallelism (so TP > 1 MoE
  training runs), and one warning that the emulation always triggers.
- :mod:`.hybrid` (megatron-core 0.19's ``HybridModel``): ``HybridStack``'s final norm, built with
  Transformer Engine's ``TENorm`` whatever the spec says, as the torch norm; and the local stack spec
  ``hybrid.hybrid_stack_spec`` (attention, MLP and MoE layers of local modules; Mamba only where
  ``mamba_ssm`` imports), which ``--cpu`` passes as ``--spec`` to a ``--hybrid-layer-pattern`` run.
- :mod:`.fused_router`: Transformer Engine's fused router functions (what ``moe_router_fusion``
  calls), computed by megatron-core's own unfused ones, so a fused router runs where TE is absent.
- :mod:`.training_loop` (``training=True``): ``initialize_megatron(allow_no_cuda=True)``,
  ``get_device_arch_version``, and the checkpoint writer's results queue started by fork.
- :mod:`.megatron_training`: not CUDA, and a switch of its own: the megatron-core wheel's
  ``megatron.training`` on Python 3.11 (``typing.override``) and without its dataset-helper Makefile.
- :mod:`.engines` (a switch of its own, not part of :func:`enable`): DeepSpeed ZeRO and FSDP2
  through accelerate on CPU ranks, for the transformers and ``swift sft`` doors (``zero.Init``
  initialises DeepSpeed's communication first; accelerate enables FSDP for ``MULTI_CPU``).
- :mod:`.titan` (a switch of its own, not part of :func:`enable`): torchtitan's trainer
  (``torchrun -m torchtitan.train``) on CPU ranks: the device type ``"cpu"`` with a device module
  answering what torchtitan asks, a stand-in for MinimalAsyncEP's triton kernels, torch 2.13's
  missing ``torch.distributed.set_timeout``, FSDP2's gradient reduction on gloo (no
  ``PREMUL_SUM``), FlexAttention as dense attention (no CPU backward) and the experts' grouped GEMM
  as float32 matmuls (speed).
- :mod:`.process_groups`: gloo plus Megatron's model-parallel groups for code that builds Megatron
  modules itself (:func:`initialize_model_parallel`, :func:`destroy`).

Usage::

    from elastic_moe_plugin import cpu_runtime

    cpu_runtime.disable_torch_compile()   # optional, skips inductor's slow CPU compile (docs/performance.md)
    cpu_runtime.enable()                  # before or after ``import megatron.core``
    cpu_runtime.initialize_model_parallel(ep=1)
    ...                                    # build and run real Megatron modules on CPU
    cpu_runtime.destroy()
    cpu_runtime.disable()                 # restores every redirected attribute by identity

    cpu_runtime.enable(training=True)     # + what Megatron-LM's training loop needs

One lifecycle: :func:`enable` installs through :class:`~elastic_moe_plugin.core.patching.PatchSwitch`
(idempotent; a failed install rolls back), Megatron modules imported later are fixed right after
their import (``AttributePatches.when_imported``), and :func:`disable` restores every attribute by
identity, removes the stand-in module and cancels pending installs. ``enable()`` refuses to run when
``torch.cuda.is_available()`` is True unless ``force=True`` (tests only), so it cannot silently hide
a real GPU.

Flags a CPU run of ``megatron.training`` passes itself (choices of the run, not redirected; the
docs/megatron.md, "Megatron-LM on the CPU", says why each, and :data:`.training_loop.CPU_ARGUMENTS` refuses a
run without the first five, naming them): ``--distributed-backend gloo``, ``--transformer-impl
local``, ``--no-gradient-accumulation-fusion``, ``--no-persist-layer-norm``, ``--clip-grad 0``;
``--disable-bias-linear`` for MoE layers at TP = EP = 1 (the experts' in-place bias add fails in
autograd on any device); with TP or CP > 1 ``CUDA_DEVICE_MAX_CONNECTIONS=1`` and, for MoE,
``--sequence-parallel``, as on a GPU. ``--use-cpu-initialization`` is not required; with it the
weights are the same at every TP size.

Caller-side notes: ``GPTModel`` (both versions) builds its default causal mask with
``device="cuda"``, so outside the training loop pass an explicit ``attention_mask``; with EP=TP=1
and ``add_bias_linear=True`` the expert MLP's in-place bias add fails in autograd on any device, so
use ``add_bias_linear=False``.

Not covered: fused permute (needs Transformer Engine), grouped GEMM, CUDA graphs, the flex
dispatcher (DeepEP/HybridEP/NCCL-EP), paged stash, fp8/fp4, FSDP, NCCL-specific options (SHARP,
high priority streams), and pipeline parallelism in Megatron-LM's training loop (untested there).
Use ``use_cpu_initialization=True``, the local specs (``get_gpt_layer_local_spec``; for a
``HybridModel``, :data:`.hybrid.hybrid_stack_spec`) and ``SequentialMLP`` experts. Verified against
megatron-core 0.16.1 and 0.19.2.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from elastic_moe_plugin.core.patching import AttributePatches, PatchSwitch
from elastic_moe_plugin.cpu_runtime import cuda, distributed, megatron_core, process_groups, training_loop
from elastic_moe_plugin.cpu_runtime.errors import MegatronCPUError
from elastic_moe_plugin.cpu_runtime.megatron_core import PAGED_STASH_MODULE, disable_torch_compile, in_rng_tracker_fork

logger = logging.getLogger(__name__)


def _install_runtime(patches: AttributePatches) -> None:
    megatron_core.install(patches)  # first: the stand-in must be importable before any megatron import
    cuda.install(patches)
    distributed.install(patches)


def _install_training(patches: AttributePatches) -> None:
    cuda.install_training(patches)
    training_loop.install(patches)


_RUNTIME = PatchSwitch(_install_runtime)
_TRAINING = PatchSwitch(_install_training)  # only on while _RUNTIME is
_LOCK = threading.RLock()  # enable/disable compose the two switches


def enable(force: bool = False, *, training: bool = False) -> None:
    """Turn the runtime on (idempotent). Callable before or after ``import megatron.core``.

    Args:
        force: activate even though ``torch.cuda.is_available()`` is True. For tests only:
            on a GPU machine this would route Megatron's device placement to the CPU.
        training: also redirect what Megatron-LM's training loop (``megatron.training``) needs
            (:mod:`.training_loop`, and the device answers of :mod:`.cuda`). Adds to a runtime
            already on; :func:`disable` removes both.

    Raises:
        MegatronCPUError: CUDA is available and ``force`` is False.
    """
    with _LOCK:
        turned_on = False
        if not _RUNTIME.is_on:
            if torch.cuda.is_available():
                if not force:
                    raise MegatronCPUError(
                        "torch.cuda.is_available() is True: refusing to redirect the CUDA runtime to the CPU. "
                        "Run Megatron on the GPU without elastic_moe_plugin.cpu_runtime, or pass force=True in a "
                        "test that really wants the CPU path."
                    )
                logger.warning("cpu_runtime forced on although CUDA is available")
            turned_on = _RUNTIME.on()
        if training:
            try:
                _TRAINING.on()
            except BaseException:
                if turned_on:
                    _RUNTIME.off()
                raise
        logger.debug("cpu_runtime enabled (training loop: %s)", _TRAINING.is_on)


def disable() -> None:
    """Turn the runtime off (idempotent), restoring every redirected attribute by identity.

    Also removes the paged-stash stand-in from ``sys.modules`` and cancels installs still waiting for
    an import. Megatron modules imported while enabled stay imported and behave as stock code
    afterwards.
    """
    with _LOCK:
        _TRAINING.off()
        if _RUNTIME.off():
            logger.debug("cpu_runtime disabled")


def is_enabled(*, training: bool = False) -> bool:
    """Whether the runtime is on; with ``training=True``, whether its training-loop part is on too."""
    return _TRAINING.is_on if training else _RUNTIME.is_on


@contextlib.contextmanager
def enabled(force: bool = False, *, training: bool = False) -> Iterator[None]:
    """Context manager: :func:`enable` on entry; on exit :func:`disable` unless it was already on."""
    was_enabled = is_enabled()
    enable(force=force, training=training)
    try:
        yield
    finally:
        if not was_enabled:
            disable()


def _requires_runtime(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if not is_enabled():
            raise MegatronCPUError(f"call cpu_runtime.enable() before {function.__name__}()")
        return function(*args, **kwargs)

    return checked


initialize_model_parallel = _requires_runtime(process_groups.initialize_model_parallel)
destroy = process_groups.destroy

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
