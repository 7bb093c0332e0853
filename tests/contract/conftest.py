"""The adapter-contract suite runs both adapters: the Megatron fixtures come from megatron_support."""

from megatron_support import *  # noqa: F401,F403 - the shared Megatron fixtures
