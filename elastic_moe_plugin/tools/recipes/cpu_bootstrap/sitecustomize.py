"""Start-up module that switches on the CPU runtime for Megatron-SWIFT in every process of a run.

``megatron sft`` re-launches itself (``python .../swift/cli/_megatron/sft.py ARGS``, or torchrun with
one process per rank when ``NPROC_PER_NODE`` is set), so a runtime switched on in the launching
process is gone in the processes that train. Python's ``site`` imports the first ``sitecustomize``
module on ``sys.path`` at the start of every interpreter; with this folder first on ``PYTHONPATH``
(the rehearsal, ``elastic-moe launch RECIPE --rehearse``, and the tests put it there, see
:func:`elastic_moe_plugin.tools.recipes.rehearse.cpu_bootstrap_dir`), each of those processes runs
:func:`elastic_moe_plugin.cpu_runtime.megatron_swift.enable` before ms-swift, megatron-core or
mcore-bridge is imported.

Opt-in by construction: the folder lies inside the package, which no ``PYTHONPATH`` of a normal
install contains, so only a command that names it runs this file. Where CUDA is available the
runtime refuses, and this start-up stops the process with that message rather than continue half
set up.

A ``sitecustomize`` that this folder shadows (one later on ``sys.path``, e.g. the tests' start-up
hook of ``tests/swift/conftest.py``) is run afterwards, so both take effect.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _enable() -> None:
    from elastic_moe_plugin import cpu_runtime
    from elastic_moe_plugin.cpu_runtime import MegatronCPUError, megatron_swift

    # Megatron compiles TopKRouter._apply_expert_bias with torch.compile: slow inductor work on CPU for
    # one small function (docs/performance.md)
    cpu_runtime.disable_torch_compile()
    # Transformer Engine's attention switches mean nothing without TE, and the CPU flags' local
    # attention backend makes megatron-core assert they are unset or 0. A shell set up for GPUs may
    # export them, and a process that built a megatron-core model set them in its environment.
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)
    try:
        megatron_swift.enable()
    except MegatronCPUError as error:
        raise SystemExit(f"elastic-moe CPU bootstrap ({__file__}): {error}") from None


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [entry for entry in sys.path if entry and os.path.abspath(entry) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", entries)
    if (
        spec is None
        or spec.loader is None
        or spec.origin is None
        or os.path.abspath(spec.origin) == os.path.abspath(__file__)
    ):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_elastic_moe_shadowed_sitecustomize"] = module
    spec.loader.exec_module(module)


_enable()
_run_shadowed_sitecustomize()
