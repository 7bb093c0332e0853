"""The one start-up bootstrap of child processes: what a launcher's every process switches on
before it imports anything, chosen by one environment variable.

A launcher that re-launches itself (``megatron sft`` re-runs its entry script, torchrun starts one
process per rank) loses whatever its parent switched on in-process. Python's ``site`` imports the
first ``sitecustomize`` module on ``sys.path`` at the start of every interpreter, so this package's
folder (:func:`directory`) first on ``PYTHONPATH`` reaches each of them; its ``sitecustomize.py``
calls :func:`start`, which switches on what :data:`BOOTSTRAP_ENV` names, comma-separated, in
:data:`FEATURES`' order:

- ``megatron_swift``: the CPU runtime for Megatron-SWIFT
  (:func:`elastic_moe_plugin.cpu_runtime.megatron_swift.enable`: the runtime with its training loop,
  host-tensor gradient clipping and the mcore-bridge scope), torch.compile off, and Transformer
  Engine's attention switches cleared (a shell set up for GPUs may export them; megatron-core
  asserts they are unset under the CPU flags' local attention). Where CUDA is available the runtime
  refuses, and the process stops with its message rather than go on half set up. For ``megatron
  sft`` on a CPU (``elastic-moe launch RECIPE --rehearse``, the tests, ``bench --only e2e``);
- ``engines``: DeepSpeed ZeRO and FSDP2 through accelerate on CPU ranks
  (:func:`elastic_moe_plugin.cpu_runtime.engines.enable`: ``zero.Init`` initialises DeepSpeed's
  communication first, and accelerate enables FSDP for ``MULTI_CPU``). For ``swift sft
  --deepspeed ...`` or an FSDP2 config on a CPU (``elastic-moe launch RECIPE --rehearse``, the
  tests); where CUDA is available it refuses, as ``megatron_swift`` does;
- ``titan``: torchtitan's trainer on CPU ranks (:func:`elastic_moe_plugin.cpu_runtime.titan.enable`:
  the device type ``"cpu"``, a stand-in for MinimalAsyncEP's triton kernels, FSDP2's gradient
  reduction on gloo, FlexAttention and the experts' grouped GEMM on the CPU). For ``torchrun -m
  torchtitan.train`` on a CPU; only in torchrun's workers (``LOCAL_RANK`` set): the launcher, and
  any other interpreter that inherits the environment, runs no trainer and is left untouched (no
  torch import added to its start). Where CUDA is available it refuses, as ``megatron_swift`` does;
- ``grad_clip``: host-tensor gradient clipping alone
  (:mod:`elastic_moe_plugin.cpu_runtime.grad_clip`), so a recipe keeps its ``--clip-grad`` under
  ``python -m elastic_moe_plugin.megatron_lm --cpu``, which switches the rest of the runtime on
  itself (the rehearsal of a pretraining recipe);
- ``step_probe``: the bench's wrapper of a Megatron or torchtitan trainer's ``train_step``
  (:mod:`elastic_moe_plugin.tools.bench.step_probe`, configured by its own ``E2E_BENCH_*``
  variables; ``bench --only e2e``).

Then it runs the ``sitecustomize`` this folder shadows, if any (one later on ``sys.path``: e.g. the
tests' start-up hook), so both take effect. Every import hook a feature registers goes through the
package's one finder (:mod:`elastic_moe_plugin.core.import_hooks`).

Opt-in twice: the folder lies inside the package, which no ``PYTHONPATH`` of a normal install
contains, and with the variable unset or empty it switches nothing on. A name it does not know
stops the process with the names it does (a typo must not silently run a GPU stack on the CPU).

:func:`environment` is what a parent adds to a child's environment.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

#: the variable naming what to switch on (not ``ELASTIC_MOE_*``: those are routing settings, and an
#: unknown one is an error of the config)
BOOTSTRAP_ENV = "EMOE_BOOTSTRAP"
#: Transformer Engine's attention switches, cleared by ``megatron_swift``
TE_ATTENTION_SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def directory() -> Path:
    """The folder to put first on a child's ``PYTHONPATH`` (its ``sitecustomize`` calls :func:`start`)."""
    return Path(__file__).resolve().parent


def _megatron_swift() -> None:
    from elastic_moe_plugin import cpu_runtime
    from elastic_moe_plugin.cpu_runtime import MegatronCPUError, megatron_swift

    # Megatron compiles TopKRouter._apply_expert_bias with torch.compile: slow inductor work on CPU
    # for one small function (docs/performance.md)
    cpu_runtime.disable_torch_compile()
    for name in TE_ATTENTION_SWITCHES:
        os.environ.pop(name, None)
    try:
        megatron_swift.enable()
    except MegatronCPUError as error:
        raise SystemExit(f"elastic-moe child bootstrap ({BOOTSTRAP_ENV}=megatron_swift): {error}") from None


def _engines() -> None:
    from elastic_moe_plugin.cpu_runtime import MegatronCPUError, engines

    try:
        engines.enable()
    except MegatronCPUError as error:
        raise SystemExit(f"elastic-moe child bootstrap ({BOOTSTRAP_ENV}=engines): {error}") from None


def _titan() -> None:
    if "LOCAL_RANK" not in os.environ:
        return  # torchrun's launcher (or another helper process): no trainer runs here
    from elastic_moe_plugin.cpu_runtime import MegatronCPUError, titan

    try:
        titan.enable()
    except MegatronCPUError as error:
        raise SystemExit(f"elastic-moe child bootstrap ({BOOTSTRAP_ENV}=titan): {error}") from None


def _grad_clip() -> None:
    from elastic_moe_plugin.cpu_runtime import grad_clip

    grad_clip.enable()


def _step_probe() -> None:
    from elastic_moe_plugin.tools.bench import step_probe

    step_probe.install(os.environ)


#: name -> what it switches on, in the order they run
FEATURES: dict[str, Callable[[], None]] = {
    "megatron_swift": _megatron_swift,
    "engines": _engines,
    "titan": _titan,
    "grad_clip": _grad_clip,
    "step_probe": _step_probe,
}


def requested(environ: Mapping[str, str]) -> list[str]:
    """The features :data:`BOOTSTRAP_ENV` names, in :data:`FEATURES`' order.

    Raises:
        ValueError: a name that is no feature (the message lists them).
    """
    names = [name.strip() for name in environ.get(BOOTSTRAP_ENV, "").split(",") if name.strip()]
    unknown = [name for name in names if name not in FEATURES]
    if unknown:
        raise ValueError(
            f"{BOOTSTRAP_ENV}={environ.get(BOOTSTRAP_ENV)!r}: {', '.join(unknown)} is no start-up feature; "
            f"expected a comma-separated list of {', '.join(FEATURES)}."
        )
    return [name for name in FEATURES if name in names]


def environment(features: Iterable[str], pythonpath: str | None = None) -> dict[str, str]:
    """``PYTHONPATH`` (this folder first, then ``pythonpath``) and :data:`BOOTSTRAP_ENV` for a child
    that starts with ``features``.

    Raises:
        ValueError: a name that is no feature.
    """
    value = ",".join(features)
    requested({BOOTSTRAP_ENV: value})
    path = os.pathsep.join([str(directory()), *filter(None, [pythonpath])])
    return {"PYTHONPATH": path, BOOTSTRAP_ENV: value}


def start(sitecustomize: str) -> None:
    """Switch on what :data:`BOOTSTRAP_ENV` names, then run the ``sitecustomize`` that the one at
    ``sitecustomize`` (this folder's) shadows. Called by this folder's ``sitecustomize.py``."""
    try:
        features = requested(os.environ)
    except ValueError as error:
        raise SystemExit(f"elastic-moe child bootstrap: {error}") from None
    for name in features:
        FEATURES[name]()
    _run_shadowed_sitecustomize(sitecustomize)


def _run_shadowed_sitecustomize(sitecustomize: str) -> None:
    """The first ``sitecustomize`` on ``sys.path`` after this folder, run as Python's ``site`` would."""
    here = os.path.dirname(os.path.abspath(sitecustomize))
    absolute = [os.path.abspath(entry) if entry else "" for entry in sys.path]
    after = absolute.index(here) + 1 if here in absolute else 0
    entries = [entry for entry in sys.path[after:] if entry and os.path.abspath(entry) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", entries)
    if spec is None or spec.loader is None or spec.origin is None:
        return
    if os.path.abspath(spec.origin) == os.path.abspath(sitecustomize):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_elastic_moe_shadowed_sitecustomize"] = module
    spec.loader.exec_module(module)


__all__ = ["BOOTSTRAP_ENV", "FEATURES", "TE_ATTENTION_SWITCHES", "directory", "environment", "requested", "start"]
