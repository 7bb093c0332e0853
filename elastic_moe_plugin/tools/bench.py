"""``elastic-moe bench``: elastic against stock Megatron, in one process, interleaved.

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
- ``gpt-step``: a training step (forward, backward) of a tiny GPTModel with MoE in every layer.

Timing: warm-up, then rounds in which every variant runs once, in a rotating order (interleaved,
so drift and other load hit all variants alike); medians and min-max per variant. torch runs
single-threaded by default: on a shared 2-core machine, two intra-op threads make the same GEMM
vary 2-3x between rounds. Memory: peak bytes of tensors alive during one step, counted by a
``TorchDispatchMode`` over storages (allocator-independent; kernel scratch space is not seen).
Syncs: device-to-host synchronisations during one forward, counted as ``aten._local_scalar_dense``
and ``aten.nonzero`` calls (what ``.item()``, ``int(t)``, ``.tolist()`` and data-dependent shapes
become) on device tensors, elastic minus stock. Not counted: reads of host tensors (the RNG-state
check of Megatron's tracker fork, which κ's draw enters; under the CPU layer it is recognised by
its caller). Pairs: (token, expert) pairs dispatched per forward, expected T·k
against realised Σκ.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from elastic_moe_plugin.compat import megatron_tracker

VARIANTS = ("stock", "iid", "balanced")
SYNC_OPS = ("_local_scalar_dense", "nonzero")


# ------------------------------------------------------------------------------------ counters
class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created by aten ops while active (each storage counted once)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, live tensors]

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key == 0:
                continue
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [storage.nbytes(), 0]
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(tensor, self._release, key)
        return out


class SyncCounter(TorchDispatchMode):
    """Counts the aten ops that force a device-to-host synchronisation (see :data:`SYNC_OPS`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNC_OPS and not _host_only_read(args):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _host_only_read(args) -> bool:
    """A read of host tensors only, which waits for no device: on a GPU, a CPU tensor; under the
    CPU layer (every tensor a host tensor), the RNG-state comparison of Megatron's tracker fork."""
    from elastic_moe_plugin.compat import megatron_cpu

    if megatron_cpu.is_enabled():
        return megatron_cpu.in_rng_tracker_fork()
    tensors = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


# ------------------------------------------------------------------------------------ results
@dataclass
class VariantResult:
    median_ms: float
    min_ms: float
    max_ms: float
    peak_bytes: int
    syncs_per_forward: int
    expected_pairs: int
    realised_pairs: int


@dataclass
class ScenarioResult:
    scenario: str
    shape: str
    variants: dict[str, VariantResult] = field(default_factory=dict)

    def ratios(self) -> dict[str, dict[str, float | int]]:
        stock = self.variants["stock"]
        return {
            name: {
                "time_ratio": result.median_ms / stock.median_ms,
                "memory_ratio": result.peak_bytes / stock.peak_bytes,
                "syncs_added": result.syncs_per_forward - stock.syncs_per_forward,
            }
            for name, result in self.variants.items()
            if name != "stock"
        }


@dataclass
class Step:
    """One variant of a scenario: ``run()`` is forward + backward; ``forward()`` forward only;
    ``pairs()`` the (token, expert) pairs dispatched by the latest forward."""

    run: Callable[[], None]
    forward: Callable[[], None]
    pairs: Callable[[], int]


# ------------------------------------------------------------------------------------ set-up
def _megatron_setup(threads: int) -> None:
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    if threads:
        torch.set_num_threads(threads)
    if not torch.cuda.is_available():
        from elastic_moe_plugin.compat import megatron_cpu

        megatron_cpu.enable()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        if torch.cuda.is_available():
            if not torch.distributed.is_initialized():
                torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
            parallel_state.initialize_model_parallel()
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        else:
            from elastic_moe_plugin.compat import megatron_cpu

            megatron_cpu.initialize_model_parallel()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _config(**overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(
        num_layers=1, num_attention_heads=4, moe_router_dtype="fp32", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        activation_func=F.gelu, gated_linear_unit=False,
    )
    values.update(overrides)
    return TransformerConfig(**values)


def _elastic_config(schedule: str, sampling: str):
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

    config = _config(hidden_size=hidden, ffn_hidden_size=4 * hidden, num_moe_experts=num_experts, moe_router_topk=topk)
    pg_collection = get_default_pg_collection()
    torch.manual_seed(0)
    device = _device()
    routers = {"stock": TopKRouter(config=config, pg_collection=pg_collection)}
    for sampling in ("iid", "balanced"):
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

    return Step(run=run, forward=lambda: forward(), pairs=lambda: int(state["pairs"].sum()) if "pairs" in state else expected_pairs)


def _moe_submodules():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mlp = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False).submodules.mlp
    return mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]


def layer_scenario(dispatcher: str, num_experts: int, topk: int, schedule: str, tokens: int, hidden: int,
                   ffn: int) -> dict[str, Step]:
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from elastic_moe_plugin import mcore

    config = _config(hidden_size=hidden, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, num_moe_experts=num_experts,
                     moe_router_topk=topk, moe_token_dispatcher_type=dispatcher)
    device = _device()
    torch.manual_seed(0)
    layers = {"stock": MoELayer(config=config, submodules=_moe_submodules())}
    for sampling in ("iid", "balanced"):
        submodules = dataclasses.replace(
            _moe_submodules(), router=mcore.ElasticTopKRouter.with_config(_elastic_config(schedule, sampling))
        )
        layers[sampling] = MoELayer(config=config, submodules=submodules)
        layers[sampling].load_state_dict(layers["stock"].state_dict())
    sequence = max(1, tokens // 4)
    x = torch.randn(sequence, 4, hidden, device=device)
    grad_out = torch.randn(sequence, 4, hidden, device=device)
    steps = {}
    for name, layer in layers.items():
        layer.to(device).set_layer_number(1)
        layer.train()
        steps[name] = _module_step(layer, lambda module: module(x.detach().requires_grad_())[0], grad_out,
                                   sequence * 4 * topk)
    return steps


def _module_step(module, call, grad_out, expected_pairs) -> Step:
    def forward():
        return call(module)

    def run():
        module.zero_grad(set_to_none=True)
        (forward() * grad_out).sum().backward()

    return Step(run=run, forward=lambda: forward(), pairs=lambda: _records_pairs(module, expected_pairs))


def gpt_scenario(num_experts: int, topk: int, schedule: str, tokens: int, hidden: int, layers: int) -> dict[str, Step]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from elastic_moe_plugin import mcore

    vocab, batch = 256, 4
    sequence = max(8, tokens // batch)
    config = _config(num_layers=layers, hidden_size=hidden, ffn_hidden_size=2 * hidden, moe_ffn_hidden_size=2 * hidden,
                     num_moe_experts=num_experts, moe_router_topk=topk)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    device = _device()
    torch.manual_seed(0)
    models = {"stock": GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=sequence)}
    for sampling in ("iid", "balanced"):
        elastic_spec = mcore.elastic_router_spec(spec, _elastic_config(schedule, sampling))
        models[sampling] = GPTModel(config=config, transformer_layer_spec=elastic_spec, vocab_size=vocab,
                                    max_sequence_length=sequence)
        models[sampling].load_state_dict(models["stock"].state_dict())
    generator = torch.Generator().manual_seed(1)
    tokens_in = torch.randint(0, vocab, (batch, sequence), generator=generator).to(device)
    labels = torch.randint(0, vocab, (batch, sequence), generator=generator).to(device)
    position_ids = torch.arange(sequence, device=device).unsqueeze(0).expand(batch, -1)
    # an explicit causal mask: Megatron's default one is allocated on "cuda"
    attention_mask = torch.triu(torch.ones(sequence, sequence, dtype=torch.bool, device=device), 1)[None, None]
    steps = {}
    for name, model in models.items():
        model.to(device).train()

        def call(module):
            return module(tokens_in, position_ids, attention_mask, labels=labels).float().mean()

        def run(module=model, call=call):
            module.zero_grad(set_to_none=True)
            call(module).backward()
            megatron_tracker.zero()

        steps[name] = Step(run=run, forward=lambda module=model, call=call: call(module),
                           pairs=lambda module=model: _records_pairs(module, batch * sequence * topk * layers))
    return steps


# ------------------------------------------------------------------------------------ running
def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(scenario: str, shape: str, steps: dict[str, Step], warmup: int, repeats: int) -> ScenarioResult:
    """Interleaved timing, then memory, syncs and pairs of each variant."""
    megatron_tracker.reset()
    for _ in range(warmup):
        for step in steps.values():
            step.run()
    megatron_tracker.zero()
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            _synchronize()
            start = time.perf_counter()
            steps[name].run()
            _synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
        megatron_tracker.zero()
    result = ScenarioResult(scenario=scenario, shape=shape)
    for name in names:
        gc.collect()
        with LiveBytes() as live:
            steps[name].run()
        with SyncCounter() as syncs, torch.no_grad():
            steps[name].forward()
        megatron_tracker.zero()
        expected = steps["stock"].pairs()
        result.variants[name] = VariantResult(
            median_ms=statistics.median(times[name]), min_ms=min(times[name]), max_ms=max(times[name]),
            peak_bytes=live.peak, syncs_per_forward=syncs.count, expected_pairs=expected,
            realised_pairs=steps[name].pairs(),
        )
    return result


def run_suite(quick: bool, threads: int, only: list[str] | None = None) -> list[ScenarioResult]:
    _megatron_setup(threads)
    if quick:
        router_shapes = [(64, 8, "6-10", 1024, 256)]
        layer_shape = dict(num_experts=16, topk=4, schedule="2-6", tokens=512, hidden=128, ffn=256)
        gpt_shape = dict(num_experts=16, topk=4, schedule="2-6", tokens=256, hidden=64, layers=2)
        warmup, repeats = 1, 5
    else:
        router_shapes = [(64, 8, "6-10", 8192, 2048), (128, 8, "6-10", 8192, 2048)]
        layer_shape = dict(num_experts=64, topk=8, schedule="6-10", tokens=4096, hidden=512, ffn=256)
        gpt_shape = dict(num_experts=16, topk=4, schedule="2-6", tokens=1024, hidden=128, layers=4)
        warmup, repeats = 2, 11
    wanted = set(only or ("router", "layer", "gpt"))
    results = []
    if "router" in wanted:
        for experts, topk, schedule, tokens, hidden in router_shapes:
            shape = f"E={experts} k={topk} {schedule} T={tokens} H={hidden}"
            results.append(measure("router", shape, router_scenario(experts, topk, schedule, tokens, hidden), warmup, repeats))
    if "layer" in wanted:
        for dispatcher in ("allgather", "alltoall"):
            shape = "E={num_experts} k={topk} {schedule} T={tokens} H={hidden} F={ffn}".format(**layer_shape)
            results.append(measure(f"layer-{dispatcher}", shape, layer_scenario(dispatcher, **layer_shape), warmup, repeats))
    if "gpt" in wanted:
        shape = "L={layers} E={num_experts} k={topk} {schedule} T={tokens} H={hidden}".format(**gpt_shape)
        results.append(measure("gpt-step", shape, gpt_scenario(**gpt_shape), warmup, repeats))
    return results


def format_results(results: list[ScenarioResult]) -> str:
    lines = [
        f"{'scenario':16s} {'variant':9s} {'median ms':>10s} {'min-max ms':>17s} {'time x':>7s} "
        f"{'peak MiB':>9s} {'mem x':>6s} {'syncs':>5s} {'+syncs':>6s} {'pairs exp/real':>16s}"
    ]
    for result in results:
        lines.append(f"-- {result.scenario}: {result.shape}")
        ratios = result.ratios()
        for name, variant in result.variants.items():
            ratio = ratios.get(name, {"time_ratio": 1.0, "memory_ratio": 1.0, "syncs_added": 0})
            lines.append(
                f"{result.scenario:16s} {name:9s} {variant.median_ms:10.2f} "
                f"{variant.min_ms:8.2f}-{variant.max_ms:8.2f} {ratio['time_ratio']:7.3f} "
                f"{variant.peak_bytes / 2**20:9.1f} {ratio['memory_ratio']:6.3f} {variant.syncs_per_forward:5d} "
                f"{ratio['syncs_added']:+6d} {variant.expected_pairs:>7d}/{variant.realised_pairs:<8d}"
            )
    return "\n".join(lines)


def to_json(results: list[ScenarioResult]) -> dict:
    import importlib.metadata

    return {
        "torch": torch.__version__,
        "megatron_core": importlib.metadata.version("megatron-core"),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "scenarios": [
            {"scenario": r.scenario, "shape": r.shape, "variants": {n: asdict(v) for n, v in r.variants.items()},
             "ratios": r.ratios()}
            for r in results
        ],
    }


# ------------------------------------------------------------------------------------ CLI
