"""What ms-swift knows the plugin by: the file ``--external_plugins`` imports and the callback name
``--callbacks`` looks up.

Standard library only: the start-up hook (:mod:`.plugin_flag`) reads both at interpreter start of
ms-swift's entry processes, and ``elastic-moe plugin-path`` prints the file without loading any
framework.
"""

from __future__ import annotations

from pathlib import Path

CALLBACK_NAME = "elastic_moe"
#: alone in its directory: ms-swift inserts a plugin's directory first on sys.path, and the package
#: directory itself (swift.py, config.py, ...) would shadow top-level modules of those names
PLUGIN_FILE = Path(__file__).parent / "plugin" / "elastic_moe.py"


def plugin_path() -> Path:
    """The installed plugin file, for ``--external_plugins "$(elastic-moe plugin-path)"``."""
    return PLUGIN_FILE


__all__ = ["CALLBACK_NAME", "PLUGIN_FILE", "plugin_path"]
