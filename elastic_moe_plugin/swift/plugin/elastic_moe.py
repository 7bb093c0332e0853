"""ms-swift plugin file: ``--external_plugins patches/elastic_moe.py`` from a checkout, or
``--external_plugins "$(elastic-moe plugin-path)"`` for the installed package's copy.

The two copies are identical (a test keeps them equal). The installed copy sits alone in its
directory because ms-swift puts a plugin's directory first on ``sys.path``. All logic lives in
:mod:`elastic_moe_plugin.swift`; configuration comes from ``ELASTIC_MOE_*``.
"""

from elastic_moe_plugin.swift import install

install()
