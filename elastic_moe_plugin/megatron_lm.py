"""``python -m elastic_moe_plugin.megatron_lm SCRIPT ...``: see :mod:`elastic_moe_plugin.mcore.megatron_lm`."""

import sys

from elastic_moe_plugin.mcore.megatron_lm import Launch, main, parse_argv, split_argv

__all__ = ["Launch", "main", "parse_argv", "split_argv"]

if __name__ == "__main__":
    sys.exit(main())
