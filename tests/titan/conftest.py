"""Shared fixtures of the torchtitan door tests: the real torchtitan 0.3.0 on a CPU.

- The CPU runtime for torchtitan (:mod:`elastic_moe_plugin.cpu_runtime.titan`) is switched on before
  anything imports torchtitan (its device type, the triton-only kernels module, FlexAttention's
  CPU backward; the module says why each). CI puts torchtitan first on ``PYTHONPATH`` in the
  ``titan`` lane (Makefile); without torchtitan importable every test here is skipped at collection.
- ``titan_clean`` (every test module applies it through ``pytestmark``): ``titan.remove()`` before
  and after each test, so no test sees another's patch.
- ``debug_model(**router)``: torchtitan's registered DeepSeek-V3 ``debugmodel`` (6 layers, MoE in
  layers 1-5, 8 experts, top-3, softmax scores, no ``route_norm``, the aux-loss-free bias on), built
  on the CPU from its own config with a fixed seed, in training mode; ``router`` keyword arguments
  replace the routers' options (``score_func``, ``route_norm``, ``route_scale``, groups) in every
  layer. ``tokens()`` / ``forward(model, tokens)`` run it as the trainer does (positions and the
  FlexAttention document mask of the model itself).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None

if not HAVE_TORCHTITAN:
    collect_ignore_glob = ["test_*.py"]
else:
    from elastic_moe_plugin.cpu_runtime import titan as titan_cpu_runtime

    titan_cpu_runtime.enable()

BATCH, SEQ, VOCAB = 2, 16, 2000


@pytest.fixture
def titan_clean() -> Iterator[None]:
    from elastic_moe_plugin import titan

    titan.remove()
    yield
    titan.remove()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def debug_model(seed: int = 0, **router) -> torch.nn.Module:
    """torchtitan's DeepSeek-V3 debug model, built and initialised on the CPU with ``seed``."""
    from torchtitan.models.deepseek_v3 import model_registry

    config = model_registry("debugmodel").model
    for layer in config.layers:
        if layer.moe is not None:
            for name, value in router.items():
                setattr(layer.moe.router, name, value)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model.train()


def tokens(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def forward(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The model's logits for ``batch``, with positions and its own attention masks, as the trainer runs it."""
    positions = torch.arange(batch.shape[1]).expand_as(batch)
    return model(batch, positions, model.get_attention_masks(positions))
