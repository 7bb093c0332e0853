"""The opt-in CPU layer runs the real megatron-core MoE code; results are checked by hand.

Every reference below is written out from the definitions (softmax over the top-k logits, a
dense sum over experts, the Switch aux loss) with the weights the layer holds; no Megatron code.
The two-process test spawns workers that import this module by name (pytest's default
``prepend`` import mode).
"""

import importlib.util
import logging
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from elastic_moe_plugin import cpu_runtime

pytestmark = pytest.mark.megatron

cpu_runtime.disable_torch_compile()
with cpu_runtime.enabled():
    pytest.importorskip("megatron.core")

HIDDEN, FFN, EXPERTS, TOPK = 16, 32, 8, 2
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32 throughout


@pytest.fixture(autouse=True, scope="module")
def _cpu_layer():
    with cpu_runtime.enabled():
        yield


@pytest.fixture
def single_process():
    cpu_runtime.initialize_model_parallel(seed=1234)
    try:
        yield
    finally:
        _clear_moe_tracker()
        cpu_runtime.destroy()


# ------------------------------------------------------------------------------------------------
# helpers shared by the single- and multi-process tests
# ------------------------------------------------------------------------------------------------


def _clear_moe_tracker():
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # 0.16
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
    else:
        get_moe_metrics_tracker().clear()


def _config(dispatcher="alltoall", tp=1, ep=1, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = {
        "num_layers": 1,
        "hidden_size": HIDDEN,
        "ffn_hidden_size": FFN,
        "moe_ffn_hidden_size": FFN,
        "num_attention_heads": 2,
        "num_moe_experts": EXPERTS,
        "moe_router_topk": TOPK,
        "moe_token_dispatcher_type": dispatcher,
        "moe_grouped_gemm": False,
        "use_cpu_initialization": True,
        # With EP=TP=1 the expert RowParallelLinear returns its input as-is and MLP's expert bias
        # add modifies it in place: an autograd error on any device. References stay bias-free.
        "add_bias_linear": False,
        "activation_func": F.gelu,
        "gated_linear_unit": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": tp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": tp,
        "sequence_parallel": tp > 1,
    }
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _moe_submodules():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mlp = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False).submodules.mlp
    # 0.16: a ModuleSpec; 0.19: a functools.partial carrying the same MoESubmodules.
    return mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]


def _moe_layer(config):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer = MoELayer(config=config, submodules=_moe_submodules())
    layer.set_layer_number(1)
    assert isinstance(layer.experts, SequentialMLP)
    return layer


def _seeded(shape, seed, scale=0.3):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _full_weights():
    """Deterministic weights for all experts: router [E, H], fc1 [E, F, H], fc2 [E, H, F]."""
    router = _seeded((EXPERTS, HIDDEN), 1, scale=1.0)
    fc1 = torch.stack([_seeded((FFN, HIDDEN), 100 + e) for e in range(EXPERTS)])
    fc2 = torch.stack([_seeded((HIDDEN, FFN), 200 + e) for e in range(EXPERTS)])
    return router, fc1, fc2


def _load_weights(layer, router, fc1, fc2, tp_rank=0, tp=1):
    """Copy the full weights into the layer: fc1 is split by rows, fc2 by columns across TP."""
    shard = FFN // tp
    cols = slice(tp_rank * shard, (tp_rank + 1) * shard)
    with torch.no_grad():
        layer.router.weight.copy_(router)
        for e, expert in zip(layer.local_expert_indices, layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(fc1[e][cols])
            expert.linear_fc2.weight.copy_(fc2[e][:, cols])


def _dense_reference(x2d, router, fc1, fc2):
    """Σ_e p_te · fc2_e(gelu(fc1_e x_t)), p = softmax over the top-k logits (Megatron default)."""
    logits = x2d @ router.t()
    chosen = torch.zeros_like(logits, dtype=torch.bool)
    chosen.scatter_(1, logits.topk(TOPK, dim=-1).indices, True)
    probs = torch.softmax(logits.masked_fill(~chosen, float("-inf")), dim=-1)
    out = torch.zeros_like(x2d)
    for e in range(EXPERTS):
        out = out + probs[:, e : e + 1] * (F.gelu(x2d @ fc1[e].t()) @ fc2[e].t())
    return out, probs, chosen


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _run_layer(layer, x, upstream):
    """Forward + backward through the real layer; returns the output and the input gradient."""
    x = _leaf(x)
    out, bias = layer(x)
    assert bias is None
    out.backward(upstream)
    return out.detach(), x.grad


# ------------------------------------------------------------------------------------------------
# the compatibility layer itself
# ------------------------------------------------------------------------------------------------


def _attribute_snapshot():
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.transformer.moe import moe_utils

    owners = [torch.cuda, torch.cuda.random, torch.distributed, mrandom, moe_utils]
    snapshot = {o.__name__: {k: id(v) for k, v in vars(o).items()} for o in owners}
    snapshot["sys.modules"] = cpu_runtime.PAGED_STASH_MODULE in sys.modules
    snapshot["meta_path"] = [id(f) for f in sys.meta_path]
    snapshot["filters"] = [id(f) for f in logging.getLogger(mrandom.__name__).filters]
    return snapshot


def test_disable_restores_every_attribute_by_identity():
    cpu_runtime.disable()
    try:
        import megatron.core.tensor_parallel.random as mrandom

        before = _attribute_snapshot()
        originals = (torch.cuda.current_device, torch.cuda.Stream, mrandom._lazy_call)
        cpu_runtime.enable()
        cpu_runtime.enable()  # idempotent
        assert cpu_runtime.is_enabled()
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.cuda.Stream is not originals[1]
        assert mrandom._lazy_call is not originals[2]
        assert _attribute_snapshot() != before
        cpu_runtime.disable()
        cpu_runtime.disable()  # idempotent
        assert not cpu_runtime.is_enabled()
        assert _attribute_snapshot() == before
        restored = (torch.cuda.current_device, torch.cuda.Stream, mrandom._lazy_call)
        assert all(now is then for now, then in zip(restored, originals))
    finally:
        cpu_runtime.enable()


def test_refuses_when_cuda_is_available_unless_forced(monkeypatch):
    cpu_runtime.disable()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(cpu_runtime.MegatronCPUError, match="force=True"):
            cpu_runtime.enable()
        assert not cpu_runtime.is_enabled()
        with cpu_runtime.enabled(force=True):
            assert cpu_runtime.is_enabled()
        assert not cpu_runtime.is_enabled()
    finally:
        monkeypatch.undo()
        cpu_runtime.enable()


def test_enable_before_import_fixes_megatron_modules_as_they_load():
    # A fresh interpreter: here megatron is imported after enable(), through the import hook.
    code = textwrap.dedent(
        """
        import torch
        from elastic_moe_plugin import cpu_runtime
        cpu_runtime.enable()
        import megatron.core.tensor_parallel.random as mrandom
        import megatron.core.transformer.moe.moe_utils as moe_utils
        assert mrandom._lazy_call is not torch.cuda._lazy_call
        assert moe_utils.te_general_gemm is None  # 0.16.1 without TE lacks the name
        cpu_runtime.disable()
        assert mrandom._lazy_call is torch.cuda._lazy_call
        print("hook ok")
        """
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and "hook ok" in result.stdout, result.stderr[-3000:]


def test_training_redirects_run_cuda_devices_on_the_cpu_and_disable_undoes_them():
    """enable(training=True): device count 1, set_device a no-op, CUDA device arguments on the CPU."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async

    cpu_runtime.disable()
    try:
        before = _attribute_snapshot()
        queue_name = _results_queue_function(filesystem_async)
        stock_queue = getattr(filesystem_async, queue_name)
        cpu_runtime.enable()
        assert torch.cuda.device_count() == 0 or torch.cuda.is_available()  # the runtime layer alone: untouched
        cpu_runtime.enable(training=True)  # adds to the layer that is on
        assert torch.cuda.device_count() == 1
        torch.cuda.set_device(3)  # no-op
        assert torch.zeros(2, device="cuda").device == torch.device("cpu")
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device == torch.device("cpu")
        assert torch.empty(2, device=0).device == torch.device("cpu")
        x = torch.ones(2)
        assert x.cuda() is x and x.to("cuda:1").device == torch.device("cpu")
        assert x.to(torch.float64).dtype == torch.float64  # other arguments pass through
        assert getattr(filesystem_async, queue_name) is not stock_queue
        cpu_runtime.disable()
        assert _attribute_snapshot() == before and getattr(filesystem_async, queue_name) is stock_queue
        if not torch.cuda.is_available():
            with pytest.raises((AssertionError, RuntimeError)):  # the mode is gone: a CPU torch has no CUDA
                torch.zeros(2, device="cuda")
    finally:
        cpu_runtime.disable()
        cpu_runtime.enable()


def _results_queue_function(module) -> str:
    """0.17+: ``get_write_results_queue(mp_mode)``; 0.16: ``_get_write_results_queue()``."""
    return "get_write_results_queue" if hasattr(module, "get_write_results_queue") else "_get_write_results_queue"


def test_checkpoint_writer_results_queue_is_started_by_fork():
    """A spawned Manager would re-import the test in a fresh interpreter without this layer."""
    code = textwrap.dedent(
        """
        import multiprocessing
        from elastic_moe_plugin import cpu_runtime
        cpu_runtime.enable(training=True)
        import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async
        started = []
        original = multiprocessing.get_context
        multiprocessing.get_context = lambda method=None: started.append(method) or original(method)
        filesystem_async.mp.get_context = multiprocessing.get_context
        name = "get_write_results_queue" if hasattr(filesystem_async, "get_write_results_queue") else "_get_write_results_queue"
        queue = getattr(filesystem_async, name)()
        queue.put(42)
        assert queue.get() == 42 and started == ["fork"], started
        print("queue ok")
        """
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0 and "queue ok" in result.stdout, result.stderr[-3000:]


def _wheel_training_is_importable() -> bool:
    import importlib.util

    import megatron.core

    training = importlib.util.find_spec("megatron.training")
    return training is not None and (pathlib.Path(training.origin).parents[1]
                                     == pathlib.Path(megatron.core.__file__).parents[1])


@pytest.mark.skipif(not _wheel_training_is_importable(),
                    reason="no megatron.training next to this megatron.core (the megatron-core 0.16.1 wheel ships none)")
def test_megatron_training_imports_with_both_layers_and_initializes_without_cuda():
    """The wheel's megatron.training on this Python: typing.override (3.11), the dataset helpers'
    build skipped when the compiled extension imports, initialize_megatron(allow_no_cuda=True)."""
    code = textwrap.dedent(
        """
        import subprocess, typing
        from elastic_moe_plugin import cpu_runtime
        from elastic_moe_plugin.cpu_runtime import megatron_training
        cpu_runtime.enable(training=True)
        megatron_training.enable()
        import megatron.training.training as training
        import megatron.core.datasets.utils as dataset_utils
        assert training.initialize_megatron.keywords == {"allow_no_cuda": True}
        stock = training.initialize_megatron.func
        calls = []
        subprocess.run = lambda *a, **k: calls.append(a)  # the stock helper would run `make`
        assert dataset_utils.compile_helpers() is None and calls == []
        megatron_training.disable()
        cpu_runtime.disable()
        assert training.initialize_megatron is stock
        assert not getattr(dataset_utils.compile_helpers, "__elastic_moe_patched__", False)
        print("training ok", hasattr(typing, "override"))
        """
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                            check=False, env={**os.environ, "TORCH_COMPILE_DISABLE": "1"})
    assert result.returncode == 0 and "training ok" in result.stdout, result.stderr[-3000:]
    if sys.version_info < (3, 12):
        assert "training ok False" in result.stdout, "disable() must remove the typing.override it added"


def test_paged_stash_stand_in_raises_clearly():
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        pytest.skip("triton is installed, so the real module is used")
    stand_in = sys.modules[cpu_runtime.PAGED_STASH_MODULE]
    assert stand_in.GLOBAL_BLOCK_SIZE > 0
    with pytest.raises(cpu_runtime.MegatronCPUError, match="moe_paged_stash=False"):
        stand_in.paged_stash_copy_kernel[(1,)](None)


def test_initialize_requires_the_layer():
    cpu_runtime.disable()
    try:
        with pytest.raises(cpu_runtime.MegatronCPUError, match="enable"):
            cpu_runtime.initialize_model_parallel()
    finally:
        cpu_runtime.enable()


def test_rng_tracker_forks_on_the_cpu_generator(single_process):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    # model_parallel_cuda_manual_seed(1234): default stream seeded 1234, TP stream 1234 + 2718.
    default = torch.Generator().manual_seed(1234)
    model_parallel = torch.Generator().manual_seed(1234 + 2718)
    with tracker.fork():
        a = torch.rand(5)
    b = torch.rand(5)
    with tracker.fork():
        c = torch.rand(5)
    torch.testing.assert_close(a, torch.rand(5, generator=model_parallel), rtol=0, atol=0)
    torch.testing.assert_close(b, torch.rand(5, generator=default), rtol=0, atol=0)
    torch.testing.assert_close(c, torch.rand(5, generator=model_parallel), rtol=0, atol=0)


def test_cuda_initial_seed_is_the_seed_megatron_gave_the_generator(single_process):
    """model_parallel_cuda_manual_seed seeds the "CUDA" generator through torch.cuda.manual_seed;
    torch.cuda.initial_seed reads it back (the budget stream is seeded from it)."""
    from megatron.core import tensor_parallel

    assert torch.cuda.initial_seed() == torch.cuda.random.initial_seed() == 1234
    tensor_parallel.model_parallel_cuda_manual_seed(77)
    assert torch.cuda.initial_seed() == 77


def test_activation_recompute_replays_forked_dropout(single_process):
    from megatron.core import tensor_parallel

    def block(x):
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return F.dropout(x, p=0.5, training=True) * x

    x = _leaf(_seeded((64,), 7, scale=1.0) + 2.0)
    y = tensor_parallel.checkpoint(block, False, x)
    y.sum().backward()
    # d/dx [m·x/(1-p) · x] = 2·m·x/(1-p) = 2·y/x: holds only if recompute drew the same mask.
    assert 0 < int((y != 0).sum()) < 64
    torch.testing.assert_close(x.grad, 2 * y.detach() / x.detach(), **TOL)


# ------------------------------------------------------------------------------------------------
# real Megatron MoE modules on CPU
# ------------------------------------------------------------------------------------------------


def test_topk_router_matches_softmax_topk_reference(single_process):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    router = TopKRouter(_config(), pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    x = _seeded((6, 3, HIDDEN), 3, scale=1.0)
    probs, routing_map = router(x)

    assert routing_map.dtype == torch.bool and routing_map.shape == (18, EXPERTS)
    assert routing_map.sum(dim=1).tolist() == [TOPK] * 18
    logits = x.reshape(-1, HIDDEN) @ router.weight.detach().t()
    ref_map = torch.zeros_like(routing_map).scatter(1, logits.topk(TOPK, dim=1).indices, True)
    ref_probs = torch.softmax(logits.masked_fill(~ref_map, float("-inf")), dim=1)
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(probs, ref_probs, rtol=0, atol=1e-6)


def test_topk_router_aux_loss_gradient_matches_switch_formula(single_process):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    coeff = 0.1
    config = _config(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=coeff)
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    x = _seeded((8, 2, HIDDEN), 4, scale=1.0)
    upstream = _seeded((16, EXPERTS), 5, scale=1.0)
    probs, _ = router(x)
    (probs * upstream).sum().backward()

    weight = _leaf(router.weight)
    logits = x.reshape(-1, HIDDEN) @ weight.t()
    chosen = torch.zeros_like(logits, dtype=torch.bool)
    chosen.scatter_(1, logits.topk(TOPK, dim=1).indices, True)
    sparse = torch.softmax(logits.masked_fill(~chosen, float("-inf")), dim=1)
    # Switch loss: E · Σ_i f_i P_i, f_i = c_i / (T·k) from a static top-k, P_i = mean_t p_ti.
    scores = torch.softmax(logits, dim=1)
    tokens = logits.shape[0]
    f = chosen.sum(0).float() / (tokens * TOPK)
    aux = coeff * EXPERTS * (f * scores.mean(0)).sum()
    main = (sparse * upstream).sum()
    (without_aux,) = torch.autograd.grad(main, weight, retain_graph=True)
    (main + aux).backward()
    torch.testing.assert_close(router.weight.grad, weight.grad, **TOL)
    assert (router.weight.grad - without_aux).abs().max() > 1e-4, "aux loss had no effect"


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_moe_layer_matches_dense_reference(single_process, dispatcher):
    layer = _moe_layer(_config(dispatcher))
    router_w, fc1, fc2 = _full_weights()
    _load_weights(layer, router_w, fc1, fc2)
    x = _seeded((8, 2, HIDDEN), 11, scale=1.0)
    upstream = _seeded((8, 2, HIDDEN), 12, scale=1.0)
    out, x_grad = _run_layer(layer, x, upstream)

    ref_x, ref_router, ref_fc1, ref_fc2 = map(_leaf, (x.reshape(-1, HIDDEN), router_w, fc1, fc2))
    ref_out, _, chosen = _dense_reference(ref_x, ref_router, ref_fc1, ref_fc2)
    ref_out.backward(upstream.reshape(-1, HIDDEN))

    assert chosen.sum(0).min() > 0, "pick inputs that reach every expert"
    torch.testing.assert_close(out.reshape(-1, HIDDEN), ref_out.detach(), **TOL)
    torch.testing.assert_close(x_grad.reshape(-1, HIDDEN), ref_x.grad, **TOL)
    torch.testing.assert_close(layer.router.weight.grad, ref_router.grad, **TOL)
    for e, expert in enumerate(layer.experts.local_experts):
        torch.testing.assert_close(expert.linear_fc1.weight.grad, ref_fc1.grad[e], **TOL)
        torch.testing.assert_close(expert.linear_fc2.weight.grad, ref_fc2.grad[e], **TOL)


def test_tiny_gpt_model_trains_on_cpu(single_process):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=64,
        num_attention_heads=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=8
    )
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
    assert len(routers) == 2
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    # Megatron builds the default causal mask with device="cuda"; pass it explicitly.
    causal = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)[None, None]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = model(ids, positions, causal, labels=ids)
        assert loss.shape == (2, 8)
        loss.mean().backward()
        losses.append(loss.mean().item())
        for router in routers:
            assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
        optimizer.step()
    assert math.isfinite(losses[0]) and abs(losses[0] - math.log(64)) < 0.5
    assert losses[-1] < losses[0] - 0.1, losses


# ------------------------------------------------------------------------------------------------
# two processes over gloo
# ------------------------------------------------------------------------------------------------

WORLD, BATCH = 2, 2
_MP_SCENARIOS = {
    # name: (dispatcher, tp, ep, local sequence length per rank). The alltoall dispatcher takes
    # unequal token counts per rank; with tp=2 they make the TP all_gather/reduce_scatter
    # unequal, which gloo's all_gather rejects (this is what cpu_runtime pads).
    "ep2_alltoall": ("alltoall", 1, 2, (4, 3)),
    "ep2_allgather": ("allgather", 1, 2, (4, 4)),
    "tp2_alltoall": ("alltoall", 2, 1, (4, 3)),
}


def _rank_inputs(rank, seq_lens):
    shape = (seq_lens[rank], BATCH, HIDDEN)
    return _seeded(shape, 300 + rank, scale=1.0), _seeded(shape, 400 + rank, scale=1.0)


def _mp_worker(rank, tmpdir):
    torch.set_num_threads(1)
    cpu_runtime.enable()
    from megatron.core import parallel_state

    results = {}
    for name, (dispatcher, tp, ep, seq_lens) in _MP_SCENARIOS.items():
        cpu_runtime.initialize_model_parallel(
            tp=tp,
            ep=ep,
            etp=tp,
            init_method=f"file://{tmpdir}/store_{name}",
            rank=rank,
            world_size=WORLD,
        )
        try:
            layer = _moe_layer(_config(dispatcher, tp=tp, ep=ep))
            tp_rank = parallel_state.get_expert_tensor_parallel_rank()
            router_w, fc1, fc2 = _full_weights()
            _load_weights(layer, router_w, fc1, fc2, tp_rank=tp_rank, tp=tp)
            x, upstream = _rank_inputs(rank, seq_lens)
            out, x_grad = _run_layer(layer, x, upstream)

            # Reference over every rank's tokens: experts see all of them, the router (replicated,
            # grads reduced later by finalize_model_grads) and the input only their own.
            inputs = [_rank_inputs(r, seq_lens) for r in range(WORLD)]
            leaves = [_leaf(xr.reshape(-1, HIDDEN)) for xr, _ in inputs]
            ref_router, ref_fc1, ref_fc2 = map(_leaf, (router_w, fc1, fc2))
            total = 0
            for r, xr in enumerate(leaves):
                ref_out, _, _ = _dense_reference(xr, ref_router, ref_fc1, ref_fc2)
                total = total + (ref_out * inputs[r][1].reshape(-1, HIDDEN)).sum()
                if r == rank:
                    mine = ref_out.detach()
            own_router_grad = torch.autograd.grad(
                (
                    _dense_reference(leaves[rank], ref_router, ref_fc1, ref_fc2)[0]
                    * upstream.reshape(-1, HIDDEN)
                ).sum(),
                ref_router,
            )[0]
            total.backward()

            torch.testing.assert_close(out.reshape(-1, HIDDEN), mine, **TOL)
            torch.testing.assert_close(x_grad.reshape(-1, HIDDEN), leaves[rank].grad, **TOL)
            torch.testing.assert_close(layer.router.weight.grad, own_router_grad, **TOL)
            shard = FFN // tp
            cols = slice(tp_rank * shard, (tp_rank + 1) * shard)
            for e, expert in zip(layer.local_expert_indices, layer.experts.local_experts):
                torch.testing.assert_close(
                    expert.linear_fc1.weight.grad, ref_fc1.grad[e][cols], **TOL
                )
                torch.testing.assert_close(
                    expert.linear_fc2.weight.grad, ref_fc2.grad[e][:, cols], **TOL
                )
            results[name] = out
        finally:
            cpu_runtime.destroy()
    torch.save(results, os.path.join(tmpdir, f"out_{rank}.pt"))


@pytest.mark.slow
def test_two_process_gloo_matches_single_process(single_process, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_mp_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)

    outputs = [torch.load(tmp_path / f"out_{rank}.pt") for rank in range(WORLD)]
    # The same tokens through one process (EP=TP=1) with the same weights.
    layer = _moe_layer(_config("alltoall"))
    _load_weights(layer, *_full_weights())
    for name, (_, _, _, seq_lens) in _MP_SCENARIOS.items():
        x = torch.cat([_rank_inputs(r, seq_lens)[0] for r in range(WORLD)], dim=0)
        single = layer(x)[0].detach().split(list(seq_lens), dim=0)
        for rank in range(WORLD):
            torch.testing.assert_close(
                outputs[rank][name], single[rank], **TOL, msg=f"{name} rank {rank}"
            )


# ------------------------------------------------------------------------------------------------
# the lifecycle of the two parts, and what each part adds
# ------------------------------------------------------------------------------------------------


def test_a_failed_training_install_leaves_the_runtime_as_it_was(monkeypatch):
    from elastic_moe_plugin.cpu_runtime import training_loop

    def broken(patches):
        patches.set(torch.cuda, "device_count", lambda: 99)
        raise RuntimeError("planted")

    cpu_runtime.disable()
    try:
        stock_count = torch.cuda.device_count
        monkeypatch.setattr(training_loop, "install", broken)
        with pytest.raises(RuntimeError, match="planted"):
            cpu_runtime.enable(training=True)  # this call turned the runtime on: it goes off again
        assert not cpu_runtime.is_enabled() and torch.cuda.device_count is stock_count
        cpu_runtime.enable()
        with pytest.raises(RuntimeError, match="planted"):
            cpu_runtime.enable(training=True)  # the runtime was on before: it stays on
        assert cpu_runtime.is_enabled() and not cpu_runtime.is_enabled(training=True)
        assert torch.cuda.device_count is stock_count
    finally:
        monkeypatch.undo()
        cpu_runtime.disable()
        cpu_runtime.enable()


def _norm_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                  persist_layer_norm=False)
    values.update(overrides)
    return TransformerConfig(**values)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_the_torch_norm_takes_sequence_parallel_and_marks_its_parameters(normalization):
    """With ``sequence_parallel`` the local spec's norm is the stock torch norm, its parameters marked
    ``sequence_parallel`` (finalize_model_grads then all-reduces their gradients over TP, as for TE's
    norm); without it, and after disable(), the stock constructor runs (and refuses SP again)."""
    from megatron.core.transformer import torch_norm

    replacement = vars(torch_norm.WrappedTorchNorm)["__new__"]
    assert replacement.__elastic_moe_patched__
    stock_new = replacement.__wrapped__
    config = _norm_config(normalization=normalization)
    # TransformerConfig refuses sequence_parallel without TP > 1 at construction; the norm only reads it
    config.sequence_parallel = True
    norm = torch_norm.WrappedTorchNorm(config=config, hidden_size=HIDDEN, eps=1e-5)
    expected = torch.nn.LayerNorm if normalization == "LayerNorm" else torch.nn.RMSNorm
    assert type(norm) is expected and norm.normalized_shape == (HIDDEN,) and norm.eps == 1e-5
    assert [getattr(p, "sequence_parallel", None) for p in norm.parameters()] == [True] * len(list(norm.parameters()))
    x = _seeded((5, HIDDEN), 21, scale=2.0)
    if normalization == "LayerNorm":
        reference = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    else:
        reference = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), reference, **TOL)

    plain = torch_norm.WrappedTorchNorm(config=_norm_config(normalization=normalization), hidden_size=HIDDEN)
    assert all(not hasattr(p, "sequence_parallel") for p in plain.parameters())
    with pytest.raises(AssertionError, match="persist_layer_norm"):  # the stock checks still run
        broken = _norm_config(normalization=normalization)
        broken.sequence_parallel, broken.persist_layer_norm = True, True
        torch_norm.WrappedTorchNorm(config=broken, hidden_size=HIDDEN)

    cpu_runtime.disable()
    try:
        assert vars(torch_norm.WrappedTorchNorm)["__new__"] is stock_new and isinstance(stock_new, staticmethod)
        with pytest.raises(AssertionError, match="sequence parallel not supported"):
            torch_norm.WrappedTorchNorm(config=config, hidden_size=HIDDEN)
    finally:
        cpu_runtime.enable()


@pytest.mark.skipif(not _wheel_training_is_importable(),
                    reason="no megatron.training next to this megatron.core (the megatron-core 0.16.1 wheel ships none)")
def test_training_loop_answers_device_arch_and_checks_flags_and_restores_every_binding():
    """In a fresh interpreter, enable(training=True) before megatron.training is imported:
    ``get_device_arch_version`` answers 0 in ``utils`` and in the copy ``arguments`` binds at import,
    ``set_global_variables`` checks the CPU flags first, the JIT warm-up leaves the CPU generator where
    it was, and disable() gives every binding its stock function back (also the ones bound from a
    module patched earlier)."""
    code = textwrap.dedent(
        """
        import argparse, torch
        from elastic_moe_plugin import cpu_runtime
        from elastic_moe_plugin.cpu_runtime import megatron_training, training_loop
        cpu_runtime.enable(training=True)
        megatron_training.enable()
        import megatron.training.utils.common_utils as common_utils
        import megatron.training.utils as utils
        import megatron.training.arguments as arguments
        import megatron.training.global_vars as global_vars
        import megatron.training.initialize as initialize
        owners = {"common_utils": common_utils, "utils": utils, "arguments": arguments}
        stock_arch = common_utils.get_device_arch_version.__wrapped__
        assert all(o.get_device_arch_version() == 0 for o in owners.values())
        stock_globals = global_vars.set_global_variables.__wrapped__
        assert arguments.set_global_variables.__wrapped__ is stock_globals
        good = argparse.Namespace(distributed_backend="gloo", transformer_impl="local",
                                  gradient_accumulation_fusion=False, no_persist_layer_norm=True, clip_grad=0.0)
        training_loop.check_cpu_arguments(good)
        bad = argparse.Namespace(**{**vars(good), "distributed_backend": "nccl", "clip_grad": 1.0})
        try:
            arguments.set_global_variables(bad)
        except cpu_runtime.MegatronCPUError as error:
            message = str(error)
        assert "--distributed-backend gloo (got 'nccl'" in message and "--clip-grad 0 (got 1.0" in message, message
        assert "--transformer-impl local (got" not in message, message
        from elastic_moe_plugin.cpu_runtime import grad_clip

        grad_clip.enable()  # clipping on host tensors: a recipe's own --clip-grad is then accepted
        try:
            training_loop.check_cpu_arguments(argparse.Namespace(**{**vars(good), "clip_grad": 1.0}))
            try:
                training_loop.check_cpu_arguments(bad)
                raise AssertionError("the waiver of --clip-grad waived --distributed-backend too")
            except cpu_runtime.MegatronCPUError as error:
                assert "--distributed-backend gloo" in str(error) and "--clip-grad" not in str(error), error
        finally:
            grad_clip.disable()
        assert initialize._warmup_jit_function.__elastic_moe_patched__
        stock_warmup = initialize._warmup_jit_function.__wrapped__
        megatron_training.disable()
        cpu_runtime.disable()
        assert all(o.get_device_arch_version is stock_arch for o in owners.values())
        assert global_vars.set_global_variables is stock_globals is arguments.set_global_variables
        assert initialize._warmup_jit_function is stock_warmup
        # the JIT warm-up's wrapper leaves the CPU generator where it was: a warm-up that draws from it,
        # wrapped as enable() wraps whatever the module holds
        def warmup():
            return torch.rand(7)
        initialize._warmup_jit_function = warmup
        cpu_runtime.enable(training=True)
        assert initialize._warmup_jit_function.__wrapped__ is warmup
        state = torch.default_generator.get_state()
        drawn = initialize._warmup_jit_function()
        assert torch.equal(torch.default_generator.get_state(), state) and drawn.shape == (7,)
        cpu_runtime.disable()
        assert initialize._warmup_jit_function is warmup
        initialize._warmup_jit_function = stock_warmup
        print("training loop ok")
        """
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                            check=False, env={**os.environ, "TORCH_COMPILE_DISABLE": "1"})
    assert result.returncode == 0 and "training loop ok" in result.stdout, result.stderr[-3000:]


def test_dataset_helpers_build_is_skipped_only_without_a_makefile(tmp_path):
    """A Megatron-LM checkout has ``megatron/core/datasets/Makefile``: its stock build runs; the wheel
    has none (and ships the compiled helpers): the build, which would fail, is skipped."""
    import types

    from elastic_moe_plugin.core.patching import AttributePatches
    from elastic_moe_plugin.cpu_runtime import megatron_training

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        pytest.skip("this megatron-core has no compiled dataset helpers")
    module = types.ModuleType("fake_dataset_utils")
    module.__file__ = str(tmp_path / "utils.py")
    builds = []
    module.compile_helpers = lambda: builds.append("make")
    patches = AttributePatches()
    megatron_training._fix_dataset_utils(patches, module)  # the unit test of this private fix itself
    try:
        assert module.compile_helpers() is None and builds == []
        (tmp_path / "Makefile").write_text("default:\n")
        module.compile_helpers()
        assert builds == ["make"]
    finally:
        patches.restore()
