import sys

from elastic_moe_plugin.cli import main

sys.exit(main())
