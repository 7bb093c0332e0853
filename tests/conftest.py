"""Shared test settings.

Megatron-core's ``jit_fuser`` wraps a few functions in ``torch.compile``; on CPU the first call
costs ~14 s of inductor compile per process, so tests run with compile disabled (the Makefile
exports the same variable).
"""

import os

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
