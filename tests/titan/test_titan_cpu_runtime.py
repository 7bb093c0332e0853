"""``cpu_runtime.titan``: each stand-in against the torchtitan 0.3.0 and torch it answers for, and the
switch's lifecycle (restored by identity) and its child-bootstrap feature. The trainer itself running
under the runtime (``torchrun -m torchtitan.train``) is the end-to-end tests' concern."""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan")

from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

from elastic_moe_plugin.cpu_runtime import MegatronCPUError, titan
from elastic_moe_plugin.tools import child_bootstrap

#: the torchtitan modules every stand-in lands in (the experiments' importers are left unimported)
TORCHTITAN_MODULES = (
    titan.TOOLS_UTILS_MODULE,
    *[name for name in titan.DEVICE_IMPORTERS if ".experiments." not in name],
    titan.ATTENTION_MODULE,
    titan.MOE_MODULE,
)


@pytest.fixture
def runtime_off():
    """The runtime off for the test, and back as it was after (a session fixture may have it on)."""
    was_on = titan.is_enabled()
    titan.disable()
    yield
    titan.disable()
    if was_on:
        titan.enable(force=True)


def _import_torchtitan() -> dict[str, object]:
    return {name: importlib.import_module(name) for name in TORCHTITAN_MODULES}


def _redirectable(modules: dict[str, object]) -> dict[tuple[object, str], object]:
    """Every attribute the runtime redirects, as it is now."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    owners = [
        (modules[name], attribute) for name in TORCHTITAN_MODULES[:-2] for attribute in _device_names(modules[name])
    ]
    owners += [
        (modules[titan.ATTENTION_MODULE].FlexAttention, "_compiled_flex_attn"),
        (modules[titan.MOE_MODULE].GroupedExperts, "_grouped_mm"),
        (_fsdp_collectives, "_get_gradient_divide_factors"),
        (torch.distributed, "set_timeout"),
    ]
    return {(owner, attribute): vars(owner).get(attribute) for owner, attribute in owners}


def _device_names(module: object) -> list[str]:
    """``device_type`` and/or ``device_module``: the names ``module`` holds (parallel_dims copies only the
    type, the profiler only the module)."""
    names = [name for name in ("device_type", "device_module") if name in vars(module)]
    assert names, module
    return names


def _assert_redirected(modules: dict[str, object]) -> None:
    for name in TORCHTITAN_MODULES[:-2]:
        module = vars(modules[name])
        assert module.get("device_type", "cpu") == "cpu", name
        assert module.get("device_module", titan.CPU_DEVICE_MODULE) is titan.CPU_DEVICE_MODULE, name
        _device_names(modules[name])  # holds one of them at least
    assert modules[titan.ATTENTION_MODULE].FlexAttention._compiled_flex_attn is titan.dense_flex_attention
    assert modules[titan.MOE_MODULE].GroupedExperts._grouped_mm is titan.fp32_grouped_mm


def test_torchtitan_sees_the_cpu_and_disable_restores_every_attribute_by_identity(runtime_off):
    titan.enable(force=True)
    titan.enable(force=True)  # idempotent
    modules = _import_torchtitan()  # in a fresh process: the importers copy the redirected names
    _assert_redirected(modules)
    device = titan.CPU_DEVICE_MODULE
    assert (device.get_device_name(), device.current_device(), device.device_count()) == ("cpu", 0, 1)
    assert device.get_device_properties().total_memory > 0 and device.memory_stats() == {}
    assert device.Stream is torch.cpu.Stream  # the rest is torch.cpu's
    titan.disable()
    stock = _redirectable(modules)
    stock_type, stock_module = modules[titan.TOOLS_UTILS_MODULE].get_device_info()
    stock_values = {"device_type": stock_type, "device_module": stock_module}
    for name in TORCHTITAN_MODULES[:-2]:  # what torchtitan binds without the runtime, in every importer
        for attribute in _device_names(modules[name]):
            assert stock[modules[name], attribute] is stock_values[attribute], (name, attribute)

    titan.enable(force=True)  # after the import: set now
    _assert_redirected(modules)
    assert all(_redirectable(modules)[key] is not value for key, value in stock.items() if key[1] != "set_timeout")
    titan.disable()
    titan.disable()
    assert not titan.is_enabled()
    assert all(now is stock[key] for key, now in _redirectable(modules).items())


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="triton imports: no stand-in")
def test_minimal_async_ep_kernels_stand_in_is_importable_raises_if_launched_and_leaves(runtime_off):
    titan.enable(force=True)
    from torchtitan.distributed.minimal_async_ep import api

    assert sys.modules[titan.KERNELS_MODULE].__cpu_runtime_stand_in__
    with pytest.raises(MegatronCPUError, match="MinimalAsyncEP needs triton and GPUs"):
        api.fill_dispatch_metadata_kernel()
    titan.disable()
    assert titan.KERNELS_MODULE not in sys.modules


def test_set_timeout_is_c10d_set_pg_timeout_and_only_added_where_missing(runtime_off, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_set_pg_timeout", lambda *args: calls.append(args))
    was_there = hasattr(torch.distributed, "set_timeout")
    titan.enable(force=True)
    torch.distributed.set_timeout(datetime.timedelta(seconds=7), None)
    titan.disable()
    if was_there:  # a torch that has it keeps its own
        assert not calls
    else:
        assert calls == [(datetime.timedelta(seconds=7), None)]
        assert not hasattr(torch.distributed, "set_timeout")


@pytest.fixture
def one_process_gloo_world(monkeypatch):
    """A gloo world of one process, and a second group on the "fake" backend (not gloo)."""
    import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29000 + torch.randint(0, 999, ()).item()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield torch.distributed.new_group(backend="gloo"), torch.distributed.new_group(backend="fake")
    finally:
        torch.distributed.destroy_process_group()


def test_fsdp_gradient_division_sums_then_divides_on_gloo_only(runtime_off, one_process_gloo_world):
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    gloo, fake = one_process_gloo_world

    def factors(group):  # a gradient divide factor, as torchtitan sets one on every FSDP module
        return _fsdp_collectives._get_gradient_divide_factors(group, None, torch.float32, "cpu", 2.0)

    assert factors(gloo)[2] != ReduceOp.SUM  # stock: PREMUL_SUM(1/2), which gloo refuses
    titan.enable(force=True)
    assert factors(gloo) == (None, 2.0, ReduceOp.SUM, ReduceOp.SUM)  # SUM, then divide by 2
    pre, post, reduce_scatter_op, _ = factors(fake)
    assert (pre, post) == (None, None) and reduce_scatter_op != ReduceOp.SUM  # not gloo: stock's choice


def _causal(b, h, q_index, kv_index):
    return q_index >= kv_index


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_dense_flex_attention_is_causal_sdpa_and_its_lse_forward_and_backward(kv_heads):
    torch.manual_seed(0)
    batch, heads, length, head_dim = 2, 4, 24, 8
    q = torch.randn(batch, heads, length, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, requires_grad=True) for _ in range(2))
    block_mask = create_block_mask(_causal, None, None, length, length, device="cpu")
    out, aux = titan.dense_flex_attention(
        q, k, v, block_mask=block_mask, enable_gqa=kv_heads != heads, return_aux=AuxRequest(lse=True)
    )
    weights = torch.randn_like(out)
    (out * weights).sum().add(aux.lse.sum()).backward()
    got = [out, aux.lse, q.grad, k.grad, v.grad]

    q_ref, k_ref, v_ref = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out_ref = F.scaled_dot_product_attention(q_ref, k_ref, v_ref, is_causal=True, enable_gqa=kv_heads != heads)
    k_full = k_ref.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q_ref @ k_full.transpose(-2, -1)) * head_dim**-0.5
    lse_ref = torch.logsumexp(scores.masked_fill(~torch.ones(length, length).tril().bool(), -torch.inf), dim=-1)
    (out_ref * weights).sum().add(lse_ref.sum()).backward()
    for name, value, expected in zip(
        ["out", "lse", "dq", "dk", "dv"], got, [out_ref, lse_ref, q_ref.grad, k_ref.grad, v_ref.grad], strict=True
    ):
        torch.testing.assert_close(value, expected, atol=1e-6, rtol=1e-6, msg=name)


def test_dense_flex_attention_returns_as_flex_attention_and_refuses_score_mod():
    q = torch.randn(1, 2, 4, 8)
    row_without_key = create_block_mask(lambda b, h, qi, ki: qi > 0, None, None, 4, 4, device="cpu")
    out, lse = titan.dense_flex_attention(q, q, q, block_mask=row_without_key, return_lse=True)
    assert out[:, :, 0].eq(0).all() and lse[:, :, 0].isneginf().all()  # flex's answer, not softmax's NaN
    torch.testing.assert_close(titan.dense_flex_attention(q, q, q), F.scaled_dot_product_attention(q, q, q))
    with pytest.raises(MegatronCPUError, match="not score_mod"):
        titan.dense_flex_attention(q, q, q, score_mod=lambda score, b, h, qi, ki: score)


def test_fp32_grouped_mm_is_one_fp32_matmul_per_expert():
    torch.manual_seed(0)
    tokens = torch.randn(10, 16).bfloat16().requires_grad_()
    weights = torch.randn(3, 16, 8).bfloat16().requires_grad_()
    offsets = torch.tensor([3, 3, 8], dtype=torch.int32)  # expert 1 empty; rows 8 and 9 past the last offset
    got = titan.fp32_grouped_mm(None, A=tokens, B_t=weights, offs=offsets)
    expected = torch.zeros(10, 8)
    for expert, (start, end) in enumerate([(0, 3), (3, 3), (3, 8)]):
        expected[start:end] = tokens[start:end].detach().float() @ weights[expert].detach().float()
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected.bfloat16())
    stock = torch._grouped_mm(tokens.detach(), weights.detach(), offs=offsets)  # rows past offs[-1]: unset
    torch.testing.assert_close(got[:8], stock[:8])
    got.float().sum().backward()
    assert weights.grad[1].eq(0).all() and tokens.grad[8:].eq(0).all()


def test_enable_refuses_when_cuda_is_available_unless_forced(runtime_off, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(MegatronCPUError, match="the torchtitan CPU runtime is for CPU-only hosts"):
        titan.enable()
    assert not titan.is_enabled()
    titan.enable(force=True)
    assert titan.is_enabled()


def test_child_bootstrap_titan_feature_runs_in_torchrun_workers_only(runtime_off, monkeypatch):
    bootstrap = child_bootstrap.BOOTSTRAP_ENV
    assert list(child_bootstrap.FEATURES).index("titan") == list(child_bootstrap.FEATURES).index("engines") + 1
    assert child_bootstrap.requested({bootstrap: "titan,engines"}) == ["engines", "titan"]
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    child_bootstrap.FEATURES["titan"]()  # torchrun's launcher: left alone
    assert not titan.is_enabled()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="EMOE_BOOTSTRAP=titan"):
        child_bootstrap.FEATURES["titan"]()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    child_bootstrap.FEATURES["titan"]()
    assert titan.is_enabled()
