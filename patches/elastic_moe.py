"""ms-swift plugin file: ``swift sft ... --external_plugins "$(elastic-moe plugin-path)"``.

Identical to ``patches/elastic_moe.py`` in the repository (a test keeps them equal). All logic
lives in :mod:`elastic_moe_plugin.swift`; configuration comes from ``ELASTIC_MOE_*``.
"""

from elastic_moe_plugin.swift import install

install()
