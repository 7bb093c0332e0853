"""Megatron scenarios of ``elastic-moe bench``: elastic against stock Megatron, in one process, interleaved.

Variants, built from the same weights and fed the same inputs:

- ``stock``: unpatched ``TopKRouter`` (static top-k);
- ``iid``: the elastic router, ``sampling="iid"`` (the paper);
- ``balanced``: the elastic router, ``sampling="balanced"`` (Σκ = T·k exactly per micro-batch).

The elastic variants use :class:`ElasticTopKRouter` (the explicit-spec route, the same
``elastic_routing`` the monkey-patch runs), so all three live side by side in one process.

Scenarios (forward + backward):

- ``router``: the router alone (gating GEMM, selection, weights, aux loss);
- ``layer-allgather`` / ``layer-alltoall``: a MoE layer with SequentialMLP experts (single
  process, so the all-to-all is local; what it measures is the permute/unpermute bookkeeping);
- ``layer-droppad``: the same layer with drop-and-pad (``moe_expert_capacity_factor=1``,
  ``moe_pad_expert_input_to_capacity``): every expert buffer holds get_capacity(T·k, E, 1) rows,
  stock's, whatever κ;
- ``gpt-step``: a training step (forward, backward) of a tiny GPTModel with MoE in every layer.

Timing, memory and sync counting are :mod:`.measure`'s. Pairs: (token, expert) rows per forward,
expected against realised. Router and GPT step: T·k against Σκ (the routing records); the MoE
layers: the rows the experts multiply, read at the experts' input (Σκ dropless; E·capacity with
drop-and-pad, where stock's own figure is the expected one).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

import torch

from elastic_moe_plugin.compat import megatron_tracker
from elastic_moe_plugin.tools.bench.measure import SAMPLINGS, ScenarioResult, Step, measure

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


def router_scenario(num_experts: int, topk: int, schedule: str, tokens: int, hidden: int) -> dict[str, Step]:
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from elastic_moe_plugin import mcore

    config = transformer_config(
        hidden_size=hidden, ffn_hidden_size=4 * hidden, num_moe_experts=num_experts, moe_router_topk=topk
    )
    pg_collection = get_default_pg_collection()
    torch.manual_seed(0)
    device = bench_device()
    routers = {"stock": TopKRouter(config=config, pg_collection=pg_collection)}
    for sampling in SAMPLINGS:
        router_class = mcore.ElasticTopKRouter.with_config(_elastic_config(schedule, sampling))
        routers[sampling] = router_class(config=config, pg_collection=pg_collection)
        routers[sampling].load_state_dict(routers["stock"].state_dict())
    x = torch.randn(tokens, 1, hidden, device=device)
    grad_probs = torch.randn(tokens, num_experts, device=device)
    steps = {}
    for name, router in routers.items():
        router.to(device).set_layer_number(1)
        router.train()
        steps[name] = _router_step(router, x, grad_probs, tokens * topk)
    return steps


def _router_step(router, x, grad_probs, expected_pairs) -> Step:
    state = {}

    def forward():
        probs, routing_map = router(x.detach().requires_grad_())
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


def gpt_scenario(num_experts: int, topk: int, schedule: str, tokens: int, hidden: int, layers: int) -> dict[str, Step]:
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
class _LayerShape(TypedDict):
    num_experts: int
    topk: int
    schedule: str
    tokens: int
    hidden: int
    ffn: int


class _GptShape(TypedDict):
    num_experts: int
    topk: int
    schedule: str
    tokens: int
    hidden: int
    layers: int


def _measure(scenario: str, shape: str, steps: dict[str, Step], warmup: int, repeats: int) -> ScenarioResult:
    return measure(
        scenario, shape, steps, warmup, repeats, reset=megatron_tracker.reset, between_runs=megatron_tracker.zero
    )


def run_suite(quick: bool, threads: int, only: list[str] | None = None) -> list[ScenarioResult]:
    """The Megatron scenarios named in ``only`` (``router``, ``layer``, ``gpt``; all when None)."""
    megatron_setup(threads)
    if quick:
        router_shapes = [(64, 8, "6-10", 1024, 256)]
        layer_shape = _LayerShape(num_experts=16, topk=4, schedule="2-6", tokens=512, hidden=128, ffn=256)
        gpt_shape = _GptShape(num_experts=16, topk=4, schedule="2-6", tokens=256, hidden=64, layers=2)
        warmup, repeats = 1, 5
    else:
        router_shapes = [(64, 8, "6-10", 8192, 2048), (128, 8, "6-10", 8192, 2048)]
        layer_shape = _LayerShape(num_experts=64, topk=8, schedule="6-10", tokens=4096, hidden=512, ffn=256)
        gpt_shape = _GptShape(num_experts=16, topk=4, schedule="2-6", tokens=1024, hidden=128, layers=4)
        warmup, repeats = 2, 11
    wanted = set(only or ("router", "layer", "gpt"))
    results = []
    if "router" in wanted:
        for experts, topk, schedule, tokens, hidden in router_shapes:
            shape = f"E={experts} k={topk} {schedule} T={tokens} H={hidden}"
            results.append(
                _measure("router", shape, router_scenario(experts, topk, schedule, tokens, hidden), warmup, repeats)
            )
    if "layer" in wanted:
        shape = "E={num_experts} k={topk} {schedule} T={tokens} H={hidden} F={ffn}".format(**layer_shape)
        for dispatcher in ("allgather", "alltoall"):
            results.append(
                _measure(f"layer-{dispatcher}", shape, layer_scenario(dispatcher, **layer_shape), warmup, repeats)
            )
        results.append(
            _measure(
                "layer-droppad",
                "alltoall " + shape + " cf=1 pad",
                layer_scenario("alltoall", **layer_shape, drop_and_pad=True),
                warmup,
                repeats,
            )
        )
    if "gpt" in wanted:
        shape = "L={layers} E={num_experts} k={topk} {schedule} T={tokens} H={hidden}".format(**gpt_shape)
        results.append(_measure("gpt-step", shape, gpt_scenario(**gpt_shape), warmup, repeats))
    return results
