"""Keeps the plugin's own file out of the ``args.json`` that ms-swift saves with a training run.

ms-swift writes ``args.json`` with the run and copies it into every checkpoint
(``BaseArguments.save_args``), and replays its ``external_plugins`` in ``swift
infer/export/deploy``. A path into this environment would not resolve in an environment without the
plugin, and inference needs none: a checkpoint routes static top-k. So the wrapped ``save_args``
writes the file without this plugin in ``external_plugins`` and records it under the key
``elastic_moe_plugin`` instead (version, file, settings), which ms-swift does not read; the
arguments object itself is left as it was.

One patch per process (:func:`args_json_patch`), idempotent, however many copies of the plugin file
ms-swift imports.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from elastic_moe_plugin.swift.entry import importable
from elastic_moe_plugin.swift.names import PLUGIN_FILE


def _is_this_plugin_file(path: str) -> bool:
    """Whether ``path`` (as ms-swift holds it: relative to the working directory, or absolute) is the
    packaged plugin file: the same file (``patches/elastic_moe.py`` links to it) or a copy of it."""
    try:
        if os.path.realpath(path) == os.path.realpath(PLUGIN_FILE):
            return True
        return Path(path).read_bytes() == PLUGIN_FILE.read_bytes()
    except OSError:
        return False


def _save_args_without_replay(original):
    """``BaseArguments.save_args`` that writes ``args.json`` without this plugin's file in
    ``external_plugins`` (ms-swift would replay it in ``swift infer/export/deploy``, which need no
    plugin) and with the record under ``elastic_moe_plugin``; the arguments object is unchanged."""
    import functools

    @functools.wraps(original)
    def save_args(self, *args, **kwargs):
        plugins = getattr(self, "external_plugins", None)
        listed = [plugins] if isinstance(plugins, str) else list(plugins or [])
        ours = [path for path in listed if _is_this_plugin_file(path)]
        if not ours:
            return original(self, *args, **kwargs)
        from elastic_moe_plugin import __version__

        config = _active_config()
        self.external_plugins = [path for path in listed if path not in ours]
        self.elastic_moe_plugin = {
            "version": __version__,
            "external_plugins": [os.path.abspath(path) for path in ours],
            "config": None if config is None else config.to_dict(),
            "note": (
                "left out of external_plugins: a checkpoint routes static top-k at inference, so swift "
                "infer/export/deploy need no plugin; pass --plugin elastic_moe again to train on elastically"
            ),
        }
        try:
            return original(self, *args, **kwargs)
        finally:
            self.external_plugins = plugins
            del self.elastic_moe_plugin

    return save_args


def _install_args_json(patches) -> None:
    if not importable("swift.arguments"):
        return
    try:
        from swift.arguments.base_args import base_args
    except ImportError:  # swift without its trainer stack
        return
    patches.wrap(base_args.BaseArguments, "save_args", _save_args_without_replay)


def _active_config():
    """The config the adapters run with in this process (None before install)."""
    for name in ("elastic_moe_plugin.hf", "elastic_moe_plugin.mcore"):
        module = sys.modules.get(name)
        if module is not None and module.active_config() is not None:
            return module.active_config()
    return None


_ARGS_JSON = None


def args_json_patch():
    """The ``args.json`` patch (one per process), built on first use: ``core.patching`` imports torch,
    which the start-up hook must not pay for."""
    global _ARGS_JSON
    if _ARGS_JSON is None:
        from elastic_moe_plugin.core.patching import PatchSwitch

        _ARGS_JSON = PatchSwitch(_install_args_json)
    return _ARGS_JSON


__all__ = ["args_json_patch"]
