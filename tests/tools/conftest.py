"""The tool tests; the Megatron fixtures serve the bench and the demo/diagnostics tests that load
Megatron checkpoints (those are marked ``megatron``)."""

from megatron_support import *  # noqa: F401,F403 - the shared Megatron fixtures
