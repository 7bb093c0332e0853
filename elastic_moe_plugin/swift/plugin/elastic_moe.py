"""ms-swift plugin file, loaded by ``swift sft ... --plugin elastic_moe`` (the installed start-up hook
passes this file to ``--external_plugins``), by ``--external_plugins patches/elastic_moe.py`` from a
checkout, or by ``--external_plugins "$(elastic-moe plugin-path)"``.

``patches/elastic_moe.py`` is a symbolic link to this file. The installed file sits alone in its
directory because ms-swift puts a plugin's directory first on ``sys.path``. All logic lives in
:mod:`elastic_moe_plugin.swift`; configuration comes from ``ELASTIC_MOE_*``.
"""

from elastic_moe_plugin.swift import install

install()
