"""``python -m elastic_moe_plugin.megatron_lm SCRIPT ...``: see :mod:`elastic_moe_plugin.mcore.megatron_lm`."""

import sys

from elastic_moe_plugin.mcore.megatron_lm import main, split_argv

__all__ = ["main", "split_argv"]

if __name__ == "__main__":
    sys.exit(main())
