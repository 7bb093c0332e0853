"""Megatron scenarios of ``elastic-moe bench``: elastic against stock Megatron, in one process, interleaved.

Variants, built from the same weights and fed the same inputs:

- ``stock``: unpatched ``TopKRouter`` (static top-k);
- ``iid``: the elastic router, ``sampling="iid"`` (the paper);
- ``balanced``: the elastic router, ``sampling="balanced"`` (Σκ = T·k exactly per micro-batch).

The elastic variants use :class:`ElasticTopKRouter` (the explicit-spec route, the same
``elastic_routing`` the monkey-patch runs), so all three live side by side in one process.

Scenarios (forward + backward), by mode (``--only``):

- ``router``: the router alone (gating GEMM, selection, weights, aux loss);
- ``routing``: ``router.routing(logits)`` alone, from leaf logits (no gating GEMM): the part
  elastic routing changes;
- ``layer-allgather`` / ``layer-alltoall`` (``layer``): a MoE layer with SequentialMLP experts (single
  process, so the all-to-all is local; what it measures is the permute/unpermute bookkeeping);
- ``layer-droppad``: the same layer with drop-and-pad (``moe_expert_capacity_factor=1``,
  ``moe_pad_expert_input_to_capacity``): every expert buffer holds get_capacity(T·k, E, 1) rows,
  stock's, whatever κ;
- ``gpt-step`` (``gpt``): a training step (forward, backward) of a tiny GPTModel with MoE in every
  layer.

Every router has an aux loss of :data:`AUX_COEFF` (``aux_loss``, as OLMoE), or none with
``--no-aux``: stock's aux loss builds a second top-k map, which elastic routing does not.

Timing, memory and sync counting are :mod:`.measure`'s. Pairs: (token, expert) rows per forward,
expected against realised. Router and GPT step: T·k against Σκ (the routing records); the MoE
layers: the rows the experts multiply, read at the experts' input (Σκ dropless; E·capacity with
drop-and-pad, where stock's own figure is the expected one).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elastic_moe_plugin.compat import megatron_tracker
from elastic_moe_plugin.tools.bench.measure import SAMPLINGS, ScenarioResult, Step, measure
from elastic_moe_plugin.tools.bench.schema import Scalar

#: the aux loss of every scenario (``moe_router_load_balancing_type="aux_loss"``), as OLMoE's;
#: ``--no-aux``: 0
AUX_COEFF = 0.01

if TYPE_CHECKING:
    from elastic_moe_plugin.core.schedule import SamplingMode


# ------------------------------------------------------------------------------------ set-up
def megatron_setup(threads: int) -> None:
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    if threads:
        torch.set_num_threads(threads)
    if not torch.cuda.is_available():
        from elastic_moe_plugin import cpu_runtime

        cpu_runtime.enable()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        if torch.cuda.is_available():
            if not torch.distributed.is_initialized():
                torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
            parallel_state.initialize_model_parallel()
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        else:
            from elastic_moe_plugin import cpu_runtime

            cpu_runtime.initialize_model_parallel()


def bench_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def transformer_config(**overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(
        num_layers=1,
        num_attention_heads=4,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_func=F.gelu,
        gated_linear_unit=False,
    )
    values.update(overrides)
    return TransformerConfig(**values)


def _elastic_config(schedule: str, sampling: SamplingMode):
    from elastic_moe_plugin.core.config import ElasticConfig

    return ElasticConfig(schedule=schedule, sampling=sampling)


def _records_pairs(module: torch.nn.Module, fallback: int) -> int:
    from elastic_moe_plugin import mcore

    records = mcore.routing_records(module)
    if not records:
        return fallback
    return int(sum(int(record.budgets.sum()) for record in records.values()))


def _routers(num_experts: int, topk: int, schedule: str, hidden: int, aux_coeff: float) -> dict[str, Any]:
    """Stock ``TopKRouter`` and the two elastic ones, the same weights, in training mode on the bench's device."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from elastic_moe_plugin import mcore

    config = transformer_config(
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_aux_loss_coeff=aux_coeff,
    )
    pg_collection = get_default_pg_collection()
    torch.manual_seed(0)
    routers = {"stock": TopKRouter(config=config, pg_collection=pg_collection)}
    for sampling in SAMPLINGS:
        router_class = mcore.ElasticTopKRouter.with_config(_elastic_config(schedule, sampling))
        routers[sampling] = router_class(config=config, pg_collection=pg_collection)
        routers[sampling].load_state_dict(routers["stock"].state_dict())
    for router in routers.values():
        router.to(bench_device()).set_layer_number(1)
        router.train()
    return routers


def router_scenario(
    num_experts: int, topk: int, schedule: str, tokens: int, hidden: int, aux_coeff: float = AUX_COEFF
) -> dict[str, Step]:
    """``router``: ``router(x)`` and the backward of ``(probs * g).sum()``, the gating GEMM included:
    what a training step pays per MoE layer."""
    routers = _routers(num_experts, topk, schedule, hidden, aux_coeff)
    device = bench_device()
    x = torch.randn(tokens, 1, hidden, device=device)
    grad_probs = torch.randn(tokens, num_experts, device=device)
    return {name: _router_step(router, x, grad_probs, tokens * topk) for name, router in routers.items()}


def routing_scenario(
    num_experts: int, topk: int, schedule: str, tokens: int, hidden: int, aux_coeff: float = AUX_COEFF
) -> dict[str, Step]:
    """``routing``: ``router.routing(logits)`` and its backward from leaf logits (the gating GEMM left
    out): the part elastic routing changes."""
    routers = _routers(num_experts, topk, schedule, hidden, aux_coeff)
    device = bench_device()
    x = torch.randn(tokens, 1, hidden, device=device)
    with torch.no_grad():
        logits = routers["stock"].gating(x)  # [T, 1, E], as the router's forward passes it
    grad_probs = torch.randn(tokens, num_experts, device=device)
    return {
        name: _router_step(router, logits, grad_probs, tokens * topk, routing=True) for name, router in routers.items()
    }


def _router_step(router, inputs: torch.Tensor, grad_probs, expected_pairs: int, routing: bool = False) -> Step:
    """``router(inputs)``, or with ``routing`` ``router.routing(inputs)`` (inputs: logits), from a leaf."""
    state = {}

    def forward():
        leaf = inputs.detach().requires_grad_()
        probs, routing_map = router.routing(leaf) if routing else router(leaf)
        state["pairs"] = routing_map
        return probs

    def run():
        router.zero_grad(set_to_none=True)
        (forward() * grad_probs).sum().backward()

    return Step(
        run=run,
        forward=lambda: forward(),
        pairs=lambda: int(state["pairs"].sum()) if "pairs" in state else expected_pairs,
    )


def _moe_submodules():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mlp = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False).submodules.mlp
    return mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]


def layer_scenario(
    dispatcher: str,
    num_experts: int,
    topk: int,
    schedule: str,
    tokens: int,
    hidden: int,
    ffn: int,
    drop_and_pad: bool = False,
    aux_coeff: float = AUX_COEFF,
) -> dict[str, Step]:
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import get_capacity

    from elastic_moe_plugin import mcore

    capacity = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True) if drop_and_pad else {}
    config = transformer_config(
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=aux_coeff,
        **capacity,
    )
    device = bench_device()
    torch.manual_seed(0)
    layers = {"stock": MoELayer(config=config, submodules=_moe_submodules())}
    for sampling in SAMPLINGS:
        submodules = dataclasses.replace(
            _moe_submodules(), router=mcore.ElasticTopKRouter.with_config(_elastic_config(schedule, sampling))
        )
        layers[sampling] = MoELayer(config=config, submodules=submodules)
        layers[sampling].load_state_dict(layers["stock"].state_dict())
    sequence = max(1, tokens // 4)
    x = torch.randn(sequence, 4, hidden, device=device)
    grad_out = torch.randn(sequence, 4, hidden, device=device)
    expected_rows = sequence * 4 * topk
    if drop_and_pad:  # stock's buffers: every expert padded to the capacity of T·k assignments
        expected_rows = num_experts * get_capacity(
            num_tokens=expected_rows, num_experts=num_experts, capacity_factor=1.0
        )
    steps = {}
    for name, layer in layers.items():
        layer.to(device).set_layer_number(1)
        layer.train()
        steps[name] = _layer_step(layer, x, grad_out, expected_rows)
    return steps


def _layer_step(layer, x, grad_out, expected_rows) -> Step:
    rows: dict[str, int] = {}
    # the experts' input [rows, H]: what they multiply, padding included
    layer.experts.register_forward_pre_hook(lambda module, args: rows.__setitem__("rows", int(args[0].shape[0])))

    def forward():
        return layer(x.detach().requires_grad_())[0]

    def run():
        layer.zero_grad(set_to_none=True)
        (forward() * grad_out).sum().backward()

    return Step(run=run, forward=forward, pairs=lambda: rows.get("rows", expected_rows))


def gpt_scenario(
    num_experts: int, topk: int, schedule: str, tokens: int, hidden: int, layers: int, aux_coeff: float = AUX_COEFF
) -> dict[str, Step]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from elastic_moe_plugin import mcore

    vocab, batch = 256, 4
    sequence = max(8, tokens // batch)
    config = transformer_config(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=2 * hidden,
        moe_ffn_hidden_size=2 * hidden,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_aux_loss_coeff=aux_coeff,
    )
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    device = bench_device()
    torch.manual_seed(0)
    models = {
        "stock": GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=sequence)
    }
    for sampling in SAMPLINGS:
        elastic_spec = mcore.elastic_router_spec(spec, _elastic_config(schedule, sampling))
        models[sampling] = GPTModel(
            config=config, transformer_layer_spec=elastic_spec, vocab_size=vocab, max_sequence_length=sequence
        )
        models[sampling].load_state_dict(models["stock"].state_dict())
    generator = torch.Generator().manual_seed(1)
    tokens_in = torch.randint(0, vocab, (batch, sequence), generator=generator).to(device)
    labels = torch.randint(0, vocab, (batch, sequence), generator=generator).to(device)
    position_ids = torch.arange(sequence, device=device).unsqueeze(0).expand(batch, -1)
    # an explicit causal mask: Megatron's default one is allocated on "cuda"
    attention_mask = torch.triu(torch.ones(sequence, sequence, dtype=torch.bool, device=device), 1)[None, None]

    def call(module: torch.nn.Module) -> torch.Tensor:
        return module(tokens_in, position_ids, attention_mask, labels=labels).float().mean()

    steps = {}
    for name, model in models.items():
        model.to(device).train()
        steps[name] = _gpt_step(model, call, batch * sequence * topk * layers)
    return steps


def _gpt_step(model: torch.nn.Module, call: Callable[[torch.nn.Module], torch.Tensor], expected_pairs: int) -> Step:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        call(model).backward()
        megatron_tracker.zero()

    return Step(run=run, forward=lambda: call(model), pairs=lambda: _records_pairs(model, expected_pairs))


# ------------------------------------------------------------------------------------ running
#: the modes this module runs, each a ``--only`` choice
MODES = ("router", "routing", "layer", "gpt")
#: (E, k, schedule, T, H) of the ``router`` and ``routing`` scenarios: quick, full
ROUTER_SHAPES = {True: [(64, 8, "6-10", 1024, 256)], False: [(64, 8, "6-10", 8192, 2048), (128, 8, "6-10", 8192, 2048)]}
LAYER_SHAPES = {
    True: dict(num_experts=16, topk=4, schedule="2-6", tokens=512, hidden=128, ffn=256),
    False: dict(num_experts=64, topk=8, schedule="6-10", tokens=4096, hidden=512, ffn=256),
}
GPT_SHAPES = {
    True: dict(num_experts=16, topk=4, schedule="2-6", tokens=256, hidden=64, layers=2),
    False: dict(num_experts=16, topk=4, schedule="2-6", tokens=1024, hidden=128, layers=4),
}


def run_suite(
    quick: bool, threads: int, only: list[str] | None = None, aux_coeff: float = AUX_COEFF
) -> list[ScenarioResult]:
    """The Megatron scenarios of the modes named in ``only`` (:data:`MODES`; all when None), every
    router with the aux loss ``aux_coeff`` (0: none)."""
    megatron_setup(threads)
    warmup, repeats = (1, 5) if quick else (2, 11)
    wanted = [mode for mode in MODES if mode in (only or MODES)]
    aux: dict[str, Scalar] = {"aux_coeff": aux_coeff}
    suffix = "" if aux_coeff == AUX_COEFF else f" aux {aux_coeff:g}"

    def run(mode: str, scenario: str, shape: str, steps: dict[str, Step], params: dict[str, Scalar]) -> ScenarioResult:
        return measure(
            scenario,
            shape + suffix,
            steps,
            warmup,
            repeats,
            reset=megatron_tracker.reset,
            between_runs=megatron_tracker.zero,
            params={**params, **aux},
            mode=mode,
        )

    results = []
    for mode in ("router", "routing"):
        if mode not in wanted:
            continue
        build = router_scenario if mode == "router" else routing_scenario
        for experts, topk, schedule, tokens, hidden in ROUTER_SHAPES[quick]:
            params: dict[str, Scalar] = dict(
                experts=experts, topk=topk, schedule=schedule, tokens=tokens, hidden=hidden
            )
            shape = f"E={experts} k={topk} {schedule} T={tokens} H={hidden}"
            results.append(run(mode, mode, shape, build(experts, topk, schedule, tokens, hidden, aux_coeff), params))
    if "layer" in wanted:
        layer: dict[str, Any] = LAYER_SHAPES[quick]
        shape = "E={num_experts} k={topk} {schedule} T={tokens} H={hidden} F={ffn}".format(**layer)
        for dispatcher in ("allgather", "alltoall"):
            steps = layer_scenario(dispatcher, **layer, aux_coeff=aux_coeff)
            results.append(run("layer", f"layer-{dispatcher}", shape, steps, {**layer, "dispatcher": dispatcher}))
        steps = layer_scenario("alltoall", **layer, drop_and_pad=True, aux_coeff=aux_coeff)
        params = {**layer, "dispatcher": "alltoall", "capacity_factor": 1.0, "pad_to_capacity": True}
        results.append(run("layer", "layer-droppad", "alltoall " + shape + " cf=1 pad", steps, params))
    if "gpt" in wanted:
        gpt: dict[str, Any] = GPT_SHAPES[quick]
        shape = "L={layers} E={num_experts} k={topk} {schedule} T={tokens} H={hidden}".format(**gpt)
        results.append(run("gpt", "gpt-step", shape, gpt_scenario(**gpt, aux_coeff=aux_coeff), dict(gpt)))
    return results
