"""Opt-in shims that let the megatron-core *wheel*'s ``megatron.training`` run on Python 3.11.

Nothing here concerns CUDA (that is :mod:`elastic_moe_plugin.cpu_runtime`): these are a
Python-version shim and a packaging gap of the wheel, both hit on a GPU machine too. Megatron-LM
run from its own checkout on Python >= 3.12 needs neither.

Usage (before ``megatron.training`` is imported)::

    from elastic_moe_plugin.cpu_runtime import megatron_training

    megatron_training.enable()
    ...                                # import and run megatron.training
    megatron_training.disable()        # restores every attribute by identity

What ``enable()`` changes (verified against the megatron-core 0.19.2 wheel):

* ``typing.override`` (added in Python 3.12, PEP 698) -> ``typing_extensions.override``, its
  backport, when ``typing`` lacks it. ``megatron/training/models/gpt.py`` (and the config modules
  it imports) do ``from typing import override``; the wheel declares ``Requires-Python >= 3.12``
  but is otherwise importable on 3.11. On 3.12 and later nothing is set.
* ``megatron.core.datasets.utils.compile_helpers`` -> skips the build when there is no Makefile
  to build with and the compiled dataset helpers (``megatron.core.datasets.helpers_cpp``) already
  import. ``initialize_megatron`` runs ``make -C megatron/core/datasets`` on rank 0 and exits the
  job when it fails; the wheel ships the compiled extension but not the Makefile, so the build
  always fails there. A Megatron-LM checkout has its Makefile, and its stock build runs unchanged
  (``scripts/build_megatron_dataset_helpers.sh`` builds the helpers of a checkout beforehand). Applied
  when the module is imported.

Both are what Megatron-LM needs on Python 3.11 wherever it runs, so
``python -m elastic_moe_plugin.megatron_lm --cpu`` switches them on with the CPU runtime; each does
nothing where it is not needed (Python >= 3.12; a tree with its Makefile).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

from elastic_moe_plugin.core.patching import AttributePatches, PatchSwitch

__all__ = ["DATASET_UTILS_MODULE", "disable", "enable", "enabled", "is_enabled"]

DATASET_UTILS_MODULE = "megatron.core.datasets.utils"
_HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


def _compiled_helpers_import() -> bool:
    try:
        importlib.import_module(_HELPERS_MODULE)
    except ImportError:
        return False
    return True


def _skip_build_when_compiled(datasets_dir: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def factory(original: Callable[[], Any]) -> Callable[[], Any]:
        @functools.wraps(original)
        def compile_helpers() -> Any:
            if not os.path.isfile(os.path.join(datasets_dir, "Makefile")) and _compiled_helpers_import():
                return None  # the wheel's prebuilt extension: there is nothing to build (and no Makefile)
            return original()

        return compile_helpers

    return factory


def _fix_dataset_utils(patches: AttributePatches, module: types.ModuleType) -> None:
    # the folder the stock build runs ``make -C`` in: the one of the module itself
    assert module.__file__ is not None  # megatron's dataset utils are a source file, never a namespace package
    patches.wrap(
        module, "compile_helpers", _skip_build_when_compiled(os.path.dirname(os.path.abspath(module.__file__)))
    )


def _install(patches: AttributePatches) -> None:
    if not hasattr(typing, "override"):
        import typing_extensions

        patches.set(typing, "override", typing_extensions.override)
    patches.when_imported(DATASET_UTILS_MODULE, functools.partial(_fix_dataset_utils, patches))


_SWITCH = PatchSwitch(_install)


def enable() -> None:
    """Install the shims (idempotent). Call before ``megatron.training`` is imported."""
    _SWITCH.on()


def disable() -> None:
    """Remove the shims (idempotent), restoring every attribute by identity."""
    _SWITCH.off()


def is_enabled() -> bool:
    """Whether the shims are installed."""
    return _SWITCH.is_on


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Context manager: :func:`enable` on entry; on exit :func:`disable` unless it was already on."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()
