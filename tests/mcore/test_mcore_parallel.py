"""Elastic routing across Megatron's parallelism, on CPU with gloo (``elastic_moe_plugin.cpu_runtime``).

Multi-process scenarios (``slow``) run in ONE ``torch.multiprocessing.spawn`` per world size: the
workers run every scenario in turn (a fresh process group and Megatron state each) and save what
they saw; the test functions below then check one scenario each in the pytest process. Workers
import this module by name (pytest's default ``prepend`` import mode), so its top level imports
no Megatron module before ``cpu_runtime.enable``.

Equivalence means: outputs and gradients (input, router weight, expert weights) of the parallel run
equal a single-process run over the concatenated tokens with the SAME κ. The workers record κ per
token (``mcore.routing_records``); the reference forces it by replacing our own
``megatron_support.force_budgets``. Gradients that Megatron reduces later in
``finalize_model_grads`` (router weight over the ranks holding different tokens, expert weights over
the expert-data-parallel group) are all-reduced (summed) by the worker, as that step would.
fp32 throughout; max abs error <= 1e-5.

Also here (single process): activation recompute (full and selective) replays κ exactly, and the
options elastic routing refuses, each with its message.
"""

from __future__ import annotations

import datetime
import os
import traceback

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from elastic_moe_plugin import ElasticConfig, mcore
from elastic_moe_plugin.core.budget_stream import BudgetStream
from elastic_moe_plugin.mcore import budget_rng
from elastic_moe_plugin.mcore import routing as routing_module
from elastic_moe_plugin.mcore.routing import UnsupportedMegatronError
from elastic_moe_plugin import cpu_runtime
from megatron_support import force_budgets

pytestmark = [pytest.mark.megatron]

H, FFN, E, K = 16, 32, 8, 2
SCHEDULE = "1-3"  # b = 3 around k = 2
S, B = 8, 2  # tokens per rank: S·B = 16 (the layer's local input [S, B, H])
SEED = 1234
ATOL = 1e-5  # max abs error, fp32
TIMEOUT = datetime.timedelta(seconds=120)  # a rank stuck in a collective fails instead of hanging


# ================================================================================ shared helpers
def _seeded(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _full_weights():
    """Router [E, H], fc1 [E, F, H], fc2 [E, H, F]: the same full weights on every rank."""
    router = _seeded((E, H), 1)
    fc1 = torch.stack([_seeded((FFN, H), 100 + e, 0.3) for e in range(E)])
    fc2 = torch.stack([_seeded((H, FFN), 200 + e, 0.3) for e in range(E)])
    return router, fc1, fc2


def _tokens(index, seq=S):
    """(input, upstream gradient) [seq, B, H] of token shard ``index``."""
    return _seeded((seq, B, H), 300 + index), _seeded((seq, B, H), 400 + index)


def _config(dispatcher="alltoall", tp=1, ep=1, sp=None, pp=1, num_layers=1, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(
        num_layers=num_layers, hidden_size=H, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN, num_attention_heads=2,
        num_moe_experts=E, moe_router_topk=K, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, use_cpu_initialization=True,
        add_bias_linear=False, activation_func=F.gelu, gated_linear_unit=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=(tp > 1) if sp is None else sp,
    )
    if pp > 1:
        values["pipeline_dtype"] = torch.float32
    values.update(overrides)
    return TransformerConfig(**values)


def _moe_submodules():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mlp = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp
    return mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]  # 0.16 / 0.19


def _moe_layer(config):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer = MoELayer(config=config, submodules=_moe_submodules())
    layer.set_layer_number(1)
    return layer


def _load_weights(layer, router, fc1, fc2, etp_rank=0, etp=1):
    """Full weights into the layer: its local experts, fc1 rows / fc2 columns split over ETP."""
    cols = slice(etp_rank * FFN // etp, (etp_rank + 1) * FFN // etp)
    with torch.no_grad():
        layer.router.weight.copy_(router)
        for e, expert in zip(layer.local_expert_indices, layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(fc1[e][cols])
            expert.linear_fc2.weight.copy_(fc2[e][:, cols])


def _run_layer(layer, x, upstream):
    """Forward + backward of a real MoELayer; returns (out, x.grad, κ)."""
    x = x.detach().clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    out.backward(upstream)
    return out.detach(), x.grad, mcore.routing_records(layer)[0].budgets


def _router(config, layer_number=1):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    router = TopKRouter(config=config, pg_collection=get_default_pg_collection())
    router.set_layer_number(layer_number)
    return router.train()


def _router_kappa(config, x):
    """(κ, budget-stream state right before the draw) of one training router forward."""
    router = _router(config)
    state = budget_rng.state()
    router(x)
    return mcore.routing_records(router)[0].budgets, state


def _shard_budgets(state, shard, num_tokens, sampling="iid"):
    """κ of the stream ``state`` (the tracker entry's tensor) for token shard ``shard``: the closed
    form of ``core.budget_stream`` at (seed, counter, shard)."""
    schedule = ElasticConfig(schedule=SCHEDULE).budget_schedule(K)
    return BudgetStream.from_state(state).draw(schedule, sampling, shard, num_tokens)[0].budgets


def _disjoint_uniforms(state, shards, num_tokens) -> bool:
    """No two of ``shards`` draw their κ from the same uniforms."""
    stream = BudgetStream.from_state(state)
    uniforms = [stream.uniforms(shard, num_tokens) for shard in shards]
    return all(np.intersect1d(uniforms[a], uniforms[b]).size == 0
               for a in range(len(shards)) for b in range(a + 1, len(shards)))


# ================================================================================ workers
def _init(rank, world, init_method, **parallel):
    torch.distributed.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                         timeout=TIMEOUT)
    cpu_runtime.initialize_model_parallel(seed=SEED, **parallel)


def _teardown():
    mcore.remove()
    cpu_runtime.destroy()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    try:  # the MoE metrics tracker is sized at its first record
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # 0.16
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker as destroy_moe_metrics_tracker
    destroy_moe_metrics_tracker()


def _all_reduced(tensor, group=None):
    tensor = tensor.clone()
    torch.distributed.all_reduce(tensor, group=group)
    return tensor


def _layer_scenario(rank, world, init_method, *, dispatcher, tp=1, ep=1, sp=None, sampling="iid", aux=0.0):
    """One MoE layer, elastic; every rank holds a different token shard (index = global rank)."""
    from megatron.core import parallel_state

    _init(rank, world, init_method, tp=tp, ep=ep, etp=tp)
    mcore.apply(ElasticConfig(schedule=SCHEDULE, sampling=sampling))
    config = _config(dispatcher, tp=tp, ep=ep, sp=sp, moe_aux_loss_coeff=aux)
    layer = _moe_layer(config)
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    _load_weights(layer, *_full_weights(), etp_rank=etp_rank, etp=tp)
    x, upstream = _tokens(rank)
    state = budget_rng.state()
    out, x_grad, kappa = _run_layer(layer, x, upstream)
    edp_group = parallel_state.get_expert_data_parallel_group()
    return {
        "out": out, "x_grad": x_grad, "kappa": kappa, "rng_state": state, "etp_rank": etp_rank, "etp": tp,
        "router_grad": _all_reduced(layer.router.weight.grad),  # every rank holds other tokens
        "local_experts": list(layer.local_expert_indices),
        "expert_grads": [(_all_reduced(m.linear_fc1.weight.grad, edp_group), _all_reduced(m.linear_fc2.weight.grad, edp_group))
                         for m in layer.experts.local_experts],
    }


def _tp_without_sp_scenario(rank, world, init_method):
    """TP=2 without SP: both TP ranks hold the same tokens. Router level (κ equal on the peers, one
    shard of the stream), then the layer level if the installed Megatron allows MoE training so."""
    _init(rank, world, init_method, tp=2, etp=2)
    mcore.apply(ElasticConfig(schedule=SCHEDULE))
    config = _config("alltoall", tp=2, sp=False)
    x, upstream = _tokens(0)  # the same tokens on both TP ranks
    result = {}
    result["kappa"], result["rng_state"] = _router_kappa(config, x)
    result["token_shard"] = routing_module.token_shard(_router(config))
    layer = _moe_layer(config)
    from megatron.core import parallel_state

    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    _load_weights(layer, *_full_weights(), etp_rank=etp_rank, etp=2)
    try:
        out, x_grad, kappa = _run_layer(layer, x, upstream)
    except ValueError as error:  # Megatron: MoE + TP needs SP in training
        if "sequence parallelism" not in str(error):
            raise
        result["layer_refused"] = str(error)
        return result
    result.update(layer_out=out, layer_x_grad=x_grad, layer_kappa=kappa, etp_rank=etp_rank,
                  router_grad=layer.router.weight.grad.clone(),
                  expert_grads=[(m.linear_fc1.weight.grad, m.linear_fc2.weight.grad) for m in layer.experts.local_experts],
                  local_experts=list(layer.local_expert_indices))
    return result


def _dp_randomness_scenario(rank, world, init_method):
    """DP=2 at the router: κ differ across DP ranks, each drawn from the rank's own token shard of
    the stream, and are reproducible from Megatron's seed (model_parallel_cuda_manual_seed)."""
    from megatron.core import tensor_parallel

    _init(rank, world, init_method)
    result = {}
    config = _config("alltoall")
    x, _ = _tokens(rank)
    for sampling in ("iid", "balanced"):
        mcore.apply(ElasticConfig(schedule=SCHEDULE, sampling=sampling))
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        result[sampling] = _router_kappa(config, x)
    result["token_shard"] = routing_module.token_shard(_router(config))
    mcore.apply(ElasticConfig(schedule=SCHEDULE))
    seeded = {}
    for label, seed in (("a", SEED), ("again", SEED), ("other", SEED + 1)):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        seeded[label] = _router_kappa(config, x)[0]
    result["seeded"] = seeded
    return result


def _tp_dp_router_scenario(rank, world, init_method):
    """TP=2 x DP=2 without SP (4 ranks), router level: TP peers hold the same tokens, DP ranks not."""
    from megatron.core import parallel_state

    _init(rank, world, init_method, tp=2, etp=2)
    mcore.apply(ElasticConfig(schedule=SCHEDULE))
    config = _config("alltoall", tp=2, sp=False)
    dp_rank = parallel_state.get_data_parallel_rank()
    x, _ = _tokens(dp_rank)
    kappa, state = _router_kappa(config, x)
    return {"kappa": kappa, "rng_state": state, "dp_rank": dp_rank,
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "token_shard": routing_module.token_shard(_router(config))}


PP_LAYERS, PP_ELASTIC = 4, "1-2"


def _pp_scenario(rank, world, init_method):
    """PP=2, 4 layers, layers='1-2' (0-based): layer 1 on stage 0, layer 2 on stage 1."""
    return _pp_forward(rank, world, init_method, PP_ELASTIC)[0]


def _pp_forward(rank, world, init_method, layers):
    """PP=2, 4 layers, ``layers`` elastic (0-based): each stage builds its 2 layers and runs a
    forward on its own hidden states (random ones on the second stage, as if received); returns
    (what the stage saw, its block)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    _init(rank, world, init_method, pp=2)
    mcore.apply(ElasticConfig(schedule=SCHEDULE, layers=layers))
    config = _config("alltoall", pp=2, num_layers=PP_LAYERS)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    block = TransformerBlock(config, spec, pre_process=stage == 0, post_process=stage == 1)
    routers = [layer.mlp.router for layer in block.layers]
    per_token = {}
    for router in routers:
        router.register_forward_hook(
            lambda module, inputs, outputs: per_token.__setitem__(module.layer_number, outputs[1].sum(dim=1)))
    hidden, _ = _tokens(10 + stage)
    if stage == 1:
        block.set_input_tensor(hidden)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).view(1, 1, S, S)
    block(hidden_states=hidden, attention_mask=causal)
    records = mcore.routing_records(block)
    return {"stage": stage, "layer_numbers": [r.layer_number for r in routers],
            "records": {index: record.budgets for index, record in records.items()},
            "per_token": per_token}, block


def _pp_logging_scenario(rank, world, init_method):
    """PP=2, 4 layers, layers='0-1': both elastic layers on stage 0, none on stage 1; then every
    stage logs, as a training loop does."""
    from elastic_moe_plugin.mcore import tracking

    result, block = _pp_forward(rank, world, init_method, "0-1")
    written = {}

    class Writer:
        def add_scalar(self, tag, value, step):
            written[tag] = float(value)

    returned = tracking.log_routing_metrics(block, iteration=1, writer=Writer())
    return {"stage": result["stage"], "returned": returned, "written": written}


def _packed_report_scenario(rank, world, init_method):
    """PP=2 x DP=2, 4 layers (stage 0 records layers 1-2, stage 1 layers 3-4), 5 metrics of
    rank-dependent values: Megatron's own report on its global tracker, then the same records
    reported inside ``megatron_tracker.isolated()`` (packed); what each writes, and the
    all-reduces each issues."""
    from elastic_moe_plugin.compat import megatron_tracker

    _init(rank, world, init_method, pp=2)
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    # 0.16 averages over data parallelism only through the entry's avg_group (as tracking.py passes it)
    dp_group = None if megatron_tracker.has_metrics_tracker() else parallel_state.get_data_parallel_group()
    names = [f"elastic_moe/metric_{index}" for index in range(5)]
    layers = [1, 2] if stage == 0 else [3, 4]
    collectives = []
    stock_all_reduce = torch.distributed.all_reduce

    def counted_all_reduce(*args, **kwargs):
        collectives.append(kwargs.get("op", "sum"))
        return stock_all_reduce(*args, **kwargs)

    def report():
        for index, name in enumerate(names):
            values = torch.tensor([(rank + 1) * 0.37 * (index + 1) + layer / 7 for layer in layers])
            megatron_tracker.record_layers(name, values, layers, 4, dp_group)
        written = {}

        class Writer:
            def add_scalar(self, tag, value, step):
                written[tag] = float(value)

        collectives.clear()
        torch.distributed.all_reduce = counted_all_reduce
        try:
            megatron_tracker.report(names, 1, writer=Writer(), wandb_writer=None, per_layer_logging=True, num_layers=4)
        finally:
            torch.distributed.all_reduce = stock_all_reduce
        return written, len(collectives)

    megatron_tracker.reset()
    stock = report()
    with megatron_tracker.isolated():
        packed = report()
    return {"stage": stage, "stock": stock, "packed": packed}


def _ep2_alltoall(rank, world, init_method):
    return _layer_scenario(rank, world, init_method, dispatcher="alltoall", ep=2)


def _ep2_allgather(rank, world, init_method):
    return _layer_scenario(rank, world, init_method, dispatcher="allgather", ep=2)


def _ep2_alltoall_balanced(rank, world, init_method):
    return _layer_scenario(rank, world, init_method, dispatcher="alltoall", ep=2, sampling="balanced")


def _tp2_sp(rank, world, init_method):
    # aux loss on: with SP the counts are reduced over the TP group, so it equals the single process
    return _layer_scenario(rank, world, init_method, dispatcher="alltoall", tp=2, sp=True, aux=0.1)


def _dp2(rank, world, init_method):
    return _layer_scenario(rank, world, init_method, dispatcher="alltoall")


def _tp2_ep2_sp(rank, world, init_method):
    return _layer_scenario(rank, world, init_method, dispatcher="alltoall", tp=2, ep=2, sp=True)


def _dp2_ep2_allgather(rank, world, init_method):
    return _layer_scenario(rank, world, init_method, dispatcher="allgather", ep=2)


SCENARIOS = {
    2: {
        "ep2_alltoall": _ep2_alltoall,
        "ep2_allgather": _ep2_allgather,
        "ep2_alltoall_balanced": _ep2_alltoall_balanced,
        "tp2_sp": _tp2_sp,
        "tp2_without_sp": _tp_without_sp_scenario,
        "dp2": _dp2,
        "dp2_randomness": _dp_randomness_scenario,
        "pp2": _pp_scenario,
        "pp2_logging": _pp_logging_scenario,
    },
    4: {
        "tp2_ep2_sp": _tp2_ep2_sp,
        "dp4_ep2_allgather": _dp2_ep2_allgather,
        "tp2_dp2_router": _tp_dp_router_scenario,
        "pp2_dp2_packed_report": _packed_report_scenario,
    },
}


def _worker(rank, world, tmpdir):
    torch.set_num_threads(1)
    cpu_runtime.disable_torch_compile()
    cpu_runtime.enable(force=True)
    results = {}
    for name, scenario in SCENARIOS[world].items():
        try:
            results[name] = scenario(rank, world, f"file://{tmpdir}/store_{name}")
        except Exception:
            # The next scenario starts a new process group; a peer stuck in a collective of this one
            # fails at TIMEOUT at the latest.
            results[name] = {"error": traceback.format_exc()}
        finally:
            _teardown()
    torch.save(results, os.path.join(tmpdir, f"rank{rank}.pt"))


def _spawn(world, tmp_path_factory):
    import torch.multiprocessing as mp

    tmpdir = tmp_path_factory.mktemp(f"world{world}")
    mp.spawn(_worker, args=(world, str(tmpdir)), nprocs=world, join=True)
    return [torch.load(tmpdir / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(2, tmp_path_factory)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _spawn(4, tmp_path_factory)


def _scenario(results, name):
    """Per-rank results of one scenario; fails with the worker's traceback if it raised."""
    per_rank = []
    for rank, result in enumerate(results):
        if name not in result:
            pytest.fail(f"scenario {name} did not run on rank {rank} (an earlier scenario failed)")
        if "error" in result[name]:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{result[name]['error']}")
        per_rank.append(result[name])
    return per_rank


# ================================================================================ single-process reference
def _max_error(actual, expected):
    return float((actual - expected).abs().max())


def _assert_close(actual, expected, what, worst=None):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    error = _max_error(actual, expected)
    assert error <= ATOL, f"{what}: max abs error {error:.3g} > {ATOL}"
    if worst is not None:
        worst[0] = max(worst[0], error)


def _reference(monkeypatch, inputs, upstreams, kappa, dispatcher="alltoall", aux=0.0, sampling="iid"):
    """The same tokens through ONE process (TP=EP=1) with the given κ forced."""
    force_budgets(monkeypatch, lambda num_tokens: kappa.clone())
    mcore.apply(ElasticConfig(schedule=SCHEDULE, sampling=sampling))
    layer = _moe_layer(_config(dispatcher, moe_aux_loss_coeff=aux))
    _load_weights(layer, *_full_weights())
    x = torch.cat(inputs, dim=0)
    out, x_grad, forced = _run_layer(layer, x, torch.cat(upstreams, dim=0))
    assert torch.equal(forced, kappa)
    return {"out": out, "x_grad": x_grad, "router_grad": layer.router.weight.grad,
            "fc1": [m.linear_fc1.weight.grad for m in layer.experts.local_experts],
            "fc2": [m.linear_fc2.weight.grad for m in layer.experts.local_experts]}


def _check_equivalence(per_rank, monkeypatch, dispatcher="alltoall", aux=0.0, sampling="iid"):
    world = len(per_rank)
    shards = [_tokens(rank) for rank in range(world)]
    kappa = torch.cat([result["kappa"] for result in per_rank])
    assert len(set(kappa.tolist())) > 1, "κ should vary"
    ref = _reference(monkeypatch, [x for x, _ in shards], [g for _, g in shards], kappa, dispatcher, aux, sampling)
    outs, x_grads = ref["out"].split(S, dim=0), ref["x_grad"].split(S, dim=0)
    worst = [0.0]
    for rank, result in enumerate(per_rank):
        _assert_close(result["out"], outs[rank], f"rank {rank} output", worst)
        _assert_close(result["x_grad"], x_grads[rank], f"rank {rank} input gradient", worst)
        _assert_close(result["router_grad"], ref["router_grad"], f"rank {rank} router weight gradient", worst)
        etp, etp_rank = result["etp"], result["etp_rank"]
        cols = slice(etp_rank * FFN // etp, (etp_rank + 1) * FFN // etp)
        for e, (fc1, fc2) in zip(result["local_experts"], result["expert_grads"]):
            _assert_close(fc1, ref["fc1"][e][cols], f"rank {rank} expert {e} fc1 gradient", worst)
            _assert_close(fc2, ref["fc2"][e][:, cols], f"rank {rank} expert {e} fc2 gradient", worst)
    assert ref["router_grad"].abs().sum() > 0 and all(g.abs().sum() > 0 for g in ref["fc1"])
    print(f"max abs error over outputs and gradients, {world} ranks: {worst[0]:.3g}")
    return kappa


@pytest.fixture
def reference_env(mcore_env, monkeypatch):
    """The pytest process's single-process Megatron state (conftest), plus monkeypatch."""
    yield monkeypatch


# ================================================================================ world size 2
@pytest.mark.slow
@pytest.mark.parametrize("scenario, dispatcher, sampling", [
    ("ep2_alltoall", "alltoall", "iid"),
    ("ep2_allgather", "allgather", "iid"),
    ("ep2_alltoall_balanced", "alltoall", "balanced"),
    ("dp2", "alltoall", "iid"),
])
def test_world2_matches_a_single_process(world2, reference_env, scenario, dispatcher, sampling):
    per_rank = _scenario(world2, scenario)
    kappa = _check_equivalence(per_rank, reference_env, dispatcher, sampling=sampling)
    if sampling == "balanced":  # exactly T·k pairs per rank
        assert all(int(result["kappa"].sum()) == S * B * K for result in per_rank)
    assert not torch.equal(per_rank[0]["kappa"], per_rank[1]["kappa"])
    assert kappa.numel() == 2 * S * B


@pytest.mark.slow
def test_tp2_with_sequence_parallel_matches_a_single_process(world2, reference_env):
    """TP=2 + SP (+ ETP=2) with the realised aux loss on: the ranks hold different sequence halves."""
    per_rank = _scenario(world2, "tp2_sp")
    _check_equivalence(per_rank, reference_env, aux=0.1)
    # SP shards are token shards: one stream, in step on both ranks; each rank draws its own shard
    assert per_rank[0]["etp_rank"] != per_rank[1]["etp_rank"]
    assert torch.equal(per_rank[0]["rng_state"], per_rank[1]["rng_state"])
    for rank, result in enumerate(per_rank):
        assert torch.equal(result["kappa"], _shard_budgets(result["rng_state"], rank, S * B))
    assert _disjoint_uniforms(per_rank[0]["rng_state"], [0, 1], S * B)


@pytest.mark.slow
def test_tp2_without_sequence_parallel(world2, reference_env):
    """κ is identical on TP peers holding the same tokens (router level, always). The layer-level
    equivalence runs only where megatron-core allows MoE training with TP but without SP."""
    per_rank = _scenario(world2, "tp2_without_sp")
    assert [r["token_shard"] for r in per_rank] == [(1, 0), (1, 0)]
    assert torch.equal(per_rank[0]["kappa"], per_rank[1]["kappa"])
    assert len(set(per_rank[0]["kappa"].tolist())) > 1
    assert torch.equal(per_rank[0]["kappa"], _shard_budgets(per_rank[0]["rng_state"], 0, S * B))
    refused = [r.get("layer_refused") for r in per_rank]
    if all(refused):
        pytest.skip(f"megatron-core refuses MoE training with TP>1 and no SP: {refused[0]!r} "
                    "(κ equality on the TP peers was checked at the router)")
    assert not any(refused), refused
    assert torch.equal(per_rank[0]["layer_kappa"], per_rank[1]["layer_kappa"])
    x, upstream = _tokens(0)
    ref = _reference(reference_env, [x], [upstream], per_rank[0]["layer_kappa"])
    for rank, result in enumerate(per_rank):
        _assert_close(result["layer_out"], ref["out"], f"rank {rank} output")
        _assert_close(result["layer_x_grad"], ref["x_grad"], f"rank {rank} input gradient")


@pytest.mark.slow
def test_dp2_budgets_differ_and_come_from_each_ranks_own_shard(world2):
    per_rank = _scenario(world2, "dp2_randomness")
    assert [r["token_shard"] for r in per_rank] == [(2, 0), (2, 1)]
    for sampling in ("iid", "balanced"):
        (kappa0, state0), (kappa1, state1) = per_rank[0][sampling], per_rank[1][sampling]
        assert torch.equal(state0, state1), "the DP ranks' budget streams must be in step"
        assert not torch.equal(kappa0, kappa1), f"{sampling}: DP ranks must draw different κ"
        # each rank generates only its own T uniforms, from (seed, counter, its shard)
        for shard, kappa in enumerate((kappa0, kappa1)):
            assert torch.equal(kappa, _shard_budgets(state0, shard, S * B, sampling)), (sampling, shard)
            if sampling == "balanced":  # each shard maps its own uniforms, so each dispatches exactly T·k
                assert int(kappa.sum()) == S * B * K
        assert _disjoint_uniforms(state0, [0, 1], S * B)


@pytest.mark.slow
def test_budgets_are_reproducible_from_megatrons_seed(world2):
    for rank, result in enumerate(_scenario(world2, "dp2_randomness")):
        seeded = result["seeded"]
        assert torch.equal(seeded["a"], seeded["again"]), f"rank {rank}: same seed, different κ"
        assert not torch.equal(seeded["a"], seeded["other"]), f"rank {rank}: another seed, same κ"


@pytest.mark.slow
def test_pipeline_stages_route_exactly_their_elastic_layers(world2):
    """PP=2, 4 layers, layers='1-2' (0-based): layer 1 is on stage 0, layer 2 on stage 1."""
    per_rank = _scenario(world2, "pp2")
    by_stage = {r["stage"]: r for r in per_rank}
    assert sorted(by_stage) == [0, 1]
    assert by_stage[0]["layer_numbers"] == [1, 2] and by_stage[1]["layer_numbers"] == [3, 4]
    assert sorted(by_stage[0]["records"]) == [1] and sorted(by_stage[1]["records"]) == [2]
    for result in by_stage.values():
        for layer_number, per_token in result["per_token"].items():
            index = layer_number - 1
            if index in result["records"]:
                budgets = result["records"][index]
                assert torch.equal(per_token, budgets) and len(set(budgets.tolist())) > 1
            else:
                assert torch.equal(per_token, torch.full((S * B,), K)), f"layer {index} must stay static"


@pytest.mark.slow
def test_a_pipeline_stage_without_elastic_layers_joins_the_metrics_report(world2):
    """Megatron's report all-reduces every name over the pipeline group: the stage without elastic
    layers must report them too (zeros), or the other waits until TIMEOUT. Both then write the
    pipeline-summed values: stage 0's own layers, averaged over the 2 elastic layers."""
    by_stage = {r["stage"]: r for r in _scenario(world2, "pp2_logging")}
    assert by_stage[1]["returned"] == {}  # nothing of its own to compute
    local = by_stage[0]["returned"]
    assert {"elastic_moe/layer_0/mean_kappa", "elastic_moe/layer_1/mean_kappa"} <= set(local)
    for stage, result in by_stage.items():
        written = result["written"]
        for layer in (0, 1):
            tag = f"moe/elastic_moe/mean_kappa_layer_{layer}"
            assert written[tag] == pytest.approx(local[f"elastic_moe/layer_{layer}/mean_kappa"], rel=1e-6), (stage, tag)
        assert written["moe/elastic_moe/mean_kappa_layer_2"] == 0.0  # a static layer: no elastic record
        assert written["elastic_moe/mean_kappa"] == pytest.approx(local["elastic_moe/mean_kappa"], rel=1e-6), stage


@pytest.mark.slow
def test_isolated_reports_write_megatrons_values_in_two_collectives(world4):
    """The packed synchronisation of ``megatron_tracker.isolated()`` (compat/megatron_tracker.py)
    writes exactly what Megatron's per-entry report writes, on every rank, with one pipeline sum
    and one data-parallel average for all five metrics instead of two collectives per metric."""
    results = _scenario(world4, "pp2_dp2_packed_report")
    for rank, result in enumerate(results):
        (stock_written, stock_collectives), (packed_written, packed_collectives) = result["stock"], result["packed"]
        assert stock_collectives == 2 * 5, rank  # Megatron: PP sum and DP average per entry
        assert packed_collectives == 2, rank
        assert packed_written == stock_written, rank
    # hand-checked: metric_0 on layer 3 is stage 1's value averaged over its DP ranks 2 and 3,
    # (3·0.37 + 3/7 + 4·0.37 + 3/7) / 2, summed with stage 0's zero
    expected = ((3 * 0.37 + 3 / 7) + (4 * 0.37 + 3 / 7)) / 2
    assert results[0]["packed"][0]["moe/elastic_moe/metric_0_layer_2"] == pytest.approx(expected, rel=1e-6)
    assert {r["stage"] for r in results} == {0, 1}


# ================================================================================ world size 4
@pytest.mark.slow
def test_world4_tp2_ep2_with_sp_matches_a_single_process(world4, reference_env):
    per_rank = _scenario(world4, "tp2_ep2_sp")
    _check_equivalence(per_rank, reference_env)
    kappas = [r["kappa"] for r in per_rank]
    assert all(not torch.equal(kappas[0], other) for other in kappas[1:])


@pytest.mark.slow
def test_world4_dp_with_ep2_allgather_matches_a_single_process(world4, reference_env):
    """4 ranks: EP=2 x expert-DP=2 (attention DP=4), allgather dispatcher."""
    _check_equivalence(_scenario(world4, "dp4_ep2_allgather"), reference_env, "allgather")


@pytest.mark.slow
def test_world4_tp_peers_share_budgets_and_dp_ranks_draw_their_own_shards(world4):
    per_rank = _scenario(world4, "tp2_dp2_router")
    by_coords = {(r["dp_rank"], r["tp_rank"]): r for r in per_rank}
    assert sorted(by_coords) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for dp in (0, 1):
        assert by_coords[dp, 0]["token_shard"] == by_coords[dp, 1]["token_shard"] == (2, dp)
        assert torch.equal(by_coords[dp, 0]["kappa"], by_coords[dp, 1]["kappa"]), "TP peers differ"
    assert not torch.equal(by_coords[0, 0]["kappa"], by_coords[1, 0]["kappa"])
    state = by_coords[0, 0]["rng_state"]
    assert all(torch.equal(r["rng_state"], state) for r in per_rank)
    for dp in (0, 1):  # the TP peers' shard is their DP index
        assert torch.equal(by_coords[dp, 0]["kappa"], _shard_budgets(state, dp, S * B))
    assert _disjoint_uniforms(state, [0, 1], S * B)


# ================================================================================ recompute (one process)
GPT_LAYERS, VOCAB, SEQ = 2, 64, 16


def _gpt_grads(make_config, **overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    # Dropout off: under the CPU emulation dropout and the checkpoint share one generator, so even
    # stock recompute differs from no recompute with dropout on.
    config = make_config(num_layers=GPT_LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                         moe_ffn_hidden_size=64, num_moe_experts=E, moe_router_topk=K, moe_aux_loss_coeff=0.01,
                         hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    torch.manual_seed(5)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    torch.manual_seed(21)
    budget_rng.reset()  # every run draws κ from a stream seeded with 21
    loss = model(tokens[:, :-1], torch.arange(SEQ).expand(2, SEQ), attention_mask=causal, labels=tokens[:, 1:]).mean()
    loss.backward()
    budgets = {i: r.budgets for i, r in mcore.routing_records(model).items()}
    histograms = {i: h.clone() for i, h in mcore.budget_histograms(model).items()}
    return loss.detach(), [p.grad for p in model.parameters()], budgets, histograms


RECOMPUTE = {
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}


@pytest.mark.megatron
@pytest.mark.usefixtures("mcore_env")
@pytest.mark.parametrize("mode", list(RECOMPUTE))
def test_activation_recompute_gives_identical_gradients(mode, make_config):
    with mcore.patched(ElasticConfig(schedule=SCHEDULE)):
        loss, grads, budgets, histograms = _gpt_grads(make_config)
        loss_r, grads_r, budgets_r, histograms_r = _gpt_grads(make_config, **RECOMPUTE[mode])
    assert sorted(budgets) == sorted(budgets_r) == list(range(GPT_LAYERS))
    assert all(len(set(budgets[i].tolist())) > 1 for i in budgets)
    assert all(torch.equal(budgets[i], budgets_r[i]) for i in budgets)
    assert torch.equal(loss, loss_r)
    assert len(grads) == len(grads_r) and all(g is not None for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))
    # the recomputed forward does not count its tokens twice
    assert all(torch.equal(histograms[i], histograms_r[i]) and int(histograms_r[i].sum()) == 2 * SEQ
               for i in histograms)


# ================================================================================ refusals
def _mcore_minor() -> tuple[int, int]:
    version = mcore.megatron_core_version()
    return version.major, version.minor


def _cuda_graph_overrides(whole_layer: bool = False) -> dict:
    """The CUDA-graph ``moe_preprocess`` scope: ``cuda_graph_modules`` in 0.19 (``cuda_graph_scope``
    is deprecated there), ``cuda_graph_scope`` in 0.16. Set after construction: the config's own
    checks want Transformer Engine / a GPU for CUDA graphs."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    if "cuda_graph_modules" in fields:
        from megatron.core.transformer.enums import CudaGraphModule

        scope = [] if whole_layer else [CudaGraphModule.moe_router, CudaGraphModule.moe_preprocess]
        return {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": scope}
    from megatron.core.transformer.enums import CudaGraphScope

    scope = [] if whole_layer else [CudaGraphScope.moe_router, CudaGraphScope.moe_preprocess]
    return {"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": scope}


REFUSALS = {
    # name: (constructor overrides, attributes set after construction, message pattern)
    "routing_replay": (dict(moe_enable_routing_replay=True), {}, r"moe_enable_routing_replay=True.*disable routing replay"),
    "sinkhorn": (dict(moe_router_load_balancing_type="sinkhorn"), {},
                 r"moe_router_load_balancing_type='sinkhorn'.*use 'aux_loss'"),
    "quantile_balancing": (dict(moe_router_load_balancing_type="quantile_balancing"), {},
                           r"moe_router_load_balancing_type='quantile_balancing'.*use 'aux_loss'"),
    "cuda_graph_moe_preprocess": (dict(moe_token_dispatcher_type="alltoall"), "cuda_graph",
                                  r"CUDA graph that captures the router \('moe_router', 'moe_preprocess' in "
                                  r"cuda_graph_(modules|scope) capture the MoE router\): κ is drawn on the host.*"
                                  r"drop 'moe_router', 'moe_preprocess': cuda_graph_(modules|scope)=\['attn'\].*"
                                  r"schedule='static'"),
    "cuda_graph_whole_layer": (dict(moe_token_dispatcher_type="alltoall"), "cuda_graph_whole_layer",
                               r"CUDA graph that captures the router \(cuda_graph_impl='transformer_engine' with an empty "
                               r"cuda_graph_(modules|scope) \(Megatron's "
                               r"default 'full'\) captures the whole layer\)"),
    "inference_optimized": ({}, {"transformer_impl": "inference_optimized"},
                            r"transformer_impl='inference_optimized'.*'transformer_engine' or 'local'"),
    "group_limited_unreachable": (dict(num_moe_experts=8, moe_router_num_groups=4, moe_router_group_topk=1), {},
                                  (r"group-limited routing keeps 1 of 4 groups \(2 experts\).*upper budget 3.*"
                                   r"moe_router_group_topk")),
}


@pytest.mark.usefixtures("mcore_env")
@pytest.mark.parametrize("name", list(REFUSALS))
def test_refused_options_fail_at_router_construction_with_the_fix(name, make_config, make_router):
    overrides, after, pattern = REFUSALS[name]
    if name == "quantile_balancing" and _mcore_minor() < (0, 19):
        pytest.skip("quantile_balancing routing does not exist before megatron-core 0.19")
    if after in ("cuda_graph", "cuda_graph_whole_layer"):
        after = _cuda_graph_overrides(whole_layer=after == "cuda_graph_whole_layer")
    config = make_config(**overrides)
    for key, value in after.items():
        setattr(config, key, value)
    with mcore.patched(ElasticConfig(schedule=SCHEDULE)), pytest.raises(UnsupportedMegatronError, match=pattern):
        make_router(config)
    with mcore.patched(ElasticConfig(schedule="static")):
        make_router(config)  # the point mass is stock: stock options stay allowed


def _set_cuda_graph_scope(config, impl, names):
    """``cuda_graph_impl`` and the scope list (``cuda_graph_modules`` in 0.19, ``cuda_graph_scope``
    in 0.16) set after construction, as ``_cuda_graph_overrides``."""
    from megatron.core.transformer import enums

    config.cuda_graph_impl = impl
    if hasattr(config, "cuda_graph_modules"):
        config.cuda_graph_modules = [enums.CudaGraphModule[name] for name in names]
    else:
        config.cuda_graph_scope = [enums.CudaGraphScope[name] for name in names]


#: CUDA-graph (impl, scope) that capture TopKRouter.forward: κ, drawn on the host, would replay stale
ROUTER_CAPTURING_GRAPHS = {
    "te_moe_router": ("transformer_engine", ["moe_router"]),
    "te_moe_router_preprocess": ("transformer_engine", ["moe_router", "moe_preprocess"]),
    "te_moe_layer": ("transformer_engine", ["moe"]),
    "local_moe_router": ("local", ["moe_router"]),
    "whole_layer": ("transformer_engine", []),
    "attn_and_moe_router": ("transformer_engine", ["attn", "moe_router"]),
    "local_attn_in_gpt": ("local", ["attn"]),  # the local implementation graphs a GPT TransformerLayer whole
}


@pytest.mark.usefixtures("mcore_env")
@pytest.mark.parametrize("graph", list(ROUTER_CAPTURING_GRAPHS))
@pytest.mark.parametrize("variant", ["iid", "balanced", "drop_and_pad", "allgather"])
def test_a_cuda_graph_that_captures_the_router_is_refused_for_every_elastic_schedule(variant, graph, make_config,
                                                                                     make_router):
    """κ is drawn on the host and copied in at every forward, so a graph replay would reuse the κ of
    its capture: every scope that captures the router is refused, whatever the sampling and the
    dispatcher sizes (the point mass, stock, stays allowed)."""
    overrides = dict(moe_token_dispatcher_type="allgather" if variant == "allgather" else "alltoall")
    if variant == "drop_and_pad":
        overrides.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    config = make_config(**overrides)
    _set_cuda_graph_scope(config, *ROUTER_CAPTURING_GRAPHS[graph])
    sampling = "balanced" if variant == "balanced" else "iid"
    with mcore.patched(ElasticConfig(schedule=SCHEDULE, sampling=sampling)), pytest.raises(
            UnsupportedMegatronError, match=r"CUDA graph that captures the router.*replay would reuse the κ"):
        make_router(config)
    with mcore.patched(ElasticConfig(schedule="static")):
        make_router(config)


@pytest.mark.usefixtures("mcore_env")
@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
@pytest.mark.parametrize("sampling", ["iid", "balanced"])
def test_a_cuda_graph_of_the_attention_only_is_allowed(sampling, impl, make_config, make_router):
    """Transformer Engine's 'attn' graph runs TransformerLayer._forward_attention only; the local
    implementation graphs a GPT layer whole, so its 'attn' spares the router in a hybrid model only
    (whose MoE layers hold no attention)."""
    config = make_config(moe_token_dispatcher_type="alltoall", is_hybrid_model=impl == "local")
    _set_cuda_graph_scope(config, impl, ["attn"])
    with mcore.patched(ElasticConfig(schedule=SCHEDULE, sampling=sampling)):
        make_router(config)


@pytest.mark.usefixtures("mcore_env")
def test_inference_topk_router_is_refused(make_config, make_router):
    from megatron.core.transformer.moe import router as router_module

    cls = getattr(router_module, "InferenceTopKRouter", None)
    if cls is None:
        pytest.skip("this megatron-core has no InferenceTopKRouter")
    config = make_config(moe_router_dtype="fp32")
    with mcore.patched(ElasticConfig(schedule=SCHEDULE)), pytest.raises(UnsupportedMegatronError,
                                                                        match=r"InferenceTopKRouter.*TopKRouter"):
        make_router(config, cls=cls)


@pytest.mark.usefixtures("mcore_env")
def test_refusal_reaches_routers_built_before_apply(make_config, make_router):
    """A router built before ``apply`` is checked at its first elastic forward, not deep in a kernel."""
    config = make_config(moe_enable_routing_replay=True)
    router = make_router(config)
    mcore.apply(ElasticConfig(schedule=SCHEDULE))
    with pytest.raises(UnsupportedMegatronError, match="moe_enable_routing_replay"):
        router.train()(torch.randn(4, 2, H))
