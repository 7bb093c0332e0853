"""The compatibility-layer tests (the CPU layer runs real Megatron); without megatron-core installed, none is collected."""

from megatron_support import *  # noqa: F401,F403 - the shared Megatron fixtures
from megatron_support import HAVE_MEGATRON

if not HAVE_MEGATRON:
    collect_ignore_glob = ["test_*.py"]
