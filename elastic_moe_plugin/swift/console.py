"""What the plugin prints in an ms-swift process: its INFO lines in ms-swift's output, and the message
of a plugin error that stops the run on its own line, before the traceback.

:func:`~elastic_moe_plugin.swift.installer.install` sets both up first, on every rank, so that the
start-up checks that follow (settings, the model of ``--model``) are readable when they fail.
Standard library only.
"""

from __future__ import annotations

import logging
import os
import sys

#: the attribute that marks the plugin's excepthook, so a second call (or another copy of this module) adds none
_HOOK_MARK = "__elastic_moe_hook__"


def ensure_log_handler() -> None:
    """Show the plugin's INFO lines in ms-swift's output, in ms-swift's format (``[INFO:swift] ...``).

    ms-swift configures only its own ``swift`` logger; without a handler the package's logger would
    print nothing below WARNING. A handler the application already attached (to this logger or
    the root) wins."""
    package_logger = logging.getLogger("elastic_moe_plugin")
    if package_logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(levelname)s:elastic_moe] %(message)s"))
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False


def report_errors_first() -> None:
    """Print a plugin error that ends the process on its own line before the traceback.

    ms-swift prints the traceback of whatever stops it, a long one whose last line would be the
    plugin's message. ``sys.excepthook`` runs for the exception that ends the process (on every
    rank, torchrun workers included), so the message comes first, then the usual traceback: a
    :class:`ConfigError` as ``elastic-moe: configuration error: ...``, a model or framework the
    plugin cannot route (:class:`UnsupportedFrameworkError`) as ``elastic-moe: error: ...``."""
    if getattr(sys.excepthook, _HOOK_MARK, False):
        return
    previous = sys.excepthook

    def excepthook(kind, error, traceback):
        from elastic_moe_plugin.core.errors import ConfigError, UnsupportedFrameworkError

        if os.environ.get("LOCAL_RANK", "0") == "0":
            if isinstance(error, ConfigError):
                sys.stderr.write(f"\nelastic-moe: configuration error: {error}\n\n")
            elif isinstance(error, UnsupportedFrameworkError):
                sys.stderr.write(f"\nelastic-moe: error: {error}\n\n")
            sys.stderr.flush()
        previous(kind, error, traceback)

    setattr(excepthook, _HOOK_MARK, True)
    sys.excepthook = excepthook


__all__ = ["ensure_log_handler", "report_errors_first"]
