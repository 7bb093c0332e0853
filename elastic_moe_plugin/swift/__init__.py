"""ms-swift integration: what ``--plugin elastic_moe`` (or ``--external_plugins FILE``) loads, and the callbacks.

Usage (ms-swift 4.6; docs/swift.md)::

    ELASTIC_MOE_SCHEDULE=6-10 swift sft    ... --plugin elastic_moe
    ELASTIC_MOE_SCHEDULE=6-10 megatron sft ... --plugin elastic_moe
    # the fallback, where the start-up hook is not installed (an editable checkout):
    ELASTIC_MOE_SCHEDULE=6-10 swift sft    ... --external_plugins "$(elastic-moe plugin-path)" --callbacks elastic_moe

``--plugin`` is this package's: :mod:`.plugin_flag` (a start-up hook installed with the wheel, and
by ``make setup`` into an editable checkout's venv) rewrites it into the second form in ms-swift's
entry processes. ms-swift has no ``--plugin`` flag; its hook is ``--external_plugins FILE``.
``swift sft`` and ``megatron sft`` re-launch a child process (or torchrun), and the child imports the
file (``plugin/elastic_moe.py``) on every rank in ``BaseArguments.__post_init__``, before any model
is built. The file calls :func:`install`.

Modules, one job each:

- :mod:`.names`: the plugin file and the callback name ms-swift knows it by;
- :mod:`.entry`: which ms-swift command this process runs, and how ms-swift reads its arguments;
- :mod:`.plugin_flag`: the ``--plugin`` start-up hook;
- :mod:`.installer`: :func:`install`, what the plugin file does (validate, patch, register);
- :mod:`.model_check`: whether the model to train has a router the plugin covers;
- :mod:`.console`: the plugin's log lines and its errors printed before ms-swift's traceback;
- :mod:`.saved_args`: the plugin's file kept out of the ``args.json`` that inference replays;
- :mod:`.callbacks`: the ``elastic_moe`` callback, which logs the plan and the routing metrics.

Every name below is imported on first access: the start-up hook imports this package in every
ms-swift entry process before ms-swift itself, so importing it loads no framework and no submodule.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic_moe_plugin.swift.installer import install
    from elastic_moe_plugin.swift.model_check import require_covered_routers
    from elastic_moe_plugin.swift.names import CALLBACK_NAME, PLUGIN_FILE, plugin_path

__all__ = ["CALLBACK_NAME", "PLUGIN_FILE", "install", "plugin_path", "require_covered_routers"]

#: name here -> (its module, its name there)
_EXPORTS = {
    "CALLBACK_NAME": ("elastic_moe_plugin.swift.names", "CALLBACK_NAME"),
    "PLUGIN_FILE": ("elastic_moe_plugin.swift.names", "PLUGIN_FILE"),
    "plugin_path": ("elastic_moe_plugin.swift.names", "plugin_path"),
    "install": ("elastic_moe_plugin.swift.installer", "install"),
    "require_covered_routers": ("elastic_moe_plugin.swift.model_check", "require_covered_routers"),
}


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
