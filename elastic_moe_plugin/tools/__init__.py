"""Tools built on the library: demo, bench, evaluation, diagnostics, the gate lab and recipes.

Nothing under :mod:`elastic_moe_plugin.core` or the framework adapters imports this package; a
training process that only calls ``mcore.apply`` or ``hf.apply`` never loads it.
"""

from pathlib import Path

#: recipes (``<setting>/*.yaml``, ``overlays/``) and evaluation suites (``eval/``), shipped as
#: package data; a source checkout's top-level ``configs/`` is a link to this folder
PACKAGE_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
