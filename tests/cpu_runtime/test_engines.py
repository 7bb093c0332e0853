"""``cpu_runtime.engines``: accelerate's FSDP decision on a CPU host, made with the real accelerate
(a one-process gloo world), and the switch's lifecycle. Its DeepSpeed half (``zero.Init`` initialising
DeepSpeed's communication first) and both engines training are proven on 2 processes by
tests/hf/test_hf_engines.py."""

from __future__ import annotations

import os

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from elastic_moe_plugin.cpu_runtime import MegatronCPUError, engines  # noqa: E402


@pytest.fixture
def one_process_world(monkeypatch):
    """accelerate's view of a launched CPU process (LOCAL_RANK set, gloo), its state reset after."""
    from accelerate.state import AcceleratorState

    port = 29000 + torch.randint(0, 999, ()).item()
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")  # restored after: Accelerator sets it for an FSDP plugin
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    engines.disable()


def _distributed_type(**plugins) -> str:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_FSDP"] = "false"  # set by the last Accelerator given an FSDP plugin
    return str(Accelerator(cpu=True, **plugins).state.distributed_type)


def test_fsdp_on_cpu_ranks_is_fsdp_with_the_runtime_and_silently_ddp_without(one_process_world):
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    assert _distributed_type(fsdp_plugin=plugin) == "DistributedType.MULTI_CPU"  # accelerate 1.16's own choice
    engines.enable()
    assert _distributed_type(fsdp_plugin=plugin) == "DistributedType.FSDP"
    assert _distributed_type() == "DistributedType.MULTI_CPU"  # no FSDP asked: nothing changes


def test_disable_restores_both_constructors_by_identity():
    import deepspeed.runtime.zero.partition_parameters as zero
    from accelerate.state import AcceleratorState

    stock = (vars(AcceleratorState)["__init__"], vars(zero.Init)["__init__"])
    try:
        engines.enable()
        engines.enable()  # idempotent
        assert engines.is_enabled()
        assert vars(AcceleratorState)["__init__"] is not stock[0] and vars(zero.Init)["__init__"] is not stock[1]
    finally:
        engines.disable()
        engines.disable()
    assert not engines.is_enabled()
    assert (vars(AcceleratorState)["__init__"], vars(zero.Init)["__init__"]) == stock
    assert all(now is then for now, then in zip((vars(AcceleratorState)["__init__"], vars(zero.Init)["__init__"]), stock))


def test_refuses_when_cuda_is_available_unless_forced(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(MegatronCPUError, match="CPU-only hosts; run DeepSpeed or FSDP on the GPU without"):
        engines.enable()
    assert not engines.is_enabled()
    try:
        engines.enable(force=True)
        assert engines.is_enabled()
    finally:
        engines.disable()
