"""``elastic-moe bench --only mcore-cuda``: the Megatron-core adapter on a CUDA GPU: its dispatchers
checked against a dense reference, its host syncs per layer counted, a Qwen3-sized layer timed.

For a machine with one CUDA GPU and megatron-core (Transformer Engine optional; ``scripts/gpu_check.sh``
runs it). Without CUDA, or with ``--quick``, it runs the same checks at tiny shapes (on a CPU
through :mod:`elastic_moe_plugin.cpu_runtime`): what CI checks, so that the GPU run has run before.
Sections, each guarded (a section that raises is a failed check, and the others still run):

- ``dispatchers``: the checks of ``tests/mcore/test_mcore_layer.py``'s
  ``test_dispatchers_combine_exactly_what_the_router_routed`` on the bench's device: allgather /
  alltoall × dropless / capacity / drop-and-pad × iid / balanced (schedule 1-3 around top-2, E=8,
  fp32, TF32 off); the layer's output and the gradients of its input, router weight and expert
  weights equal a dense reference built from the router's own selection (max abs error ≤ 1e-4);
  plus the flex dispatcher's index conversion on device tensors;
- ``syncs``: one training forward + backward of an alltoall MoE layer (EP=1; E=128, top-8, H=2048,
  F=768, T=8192, bf16; tiny: E=16, H=64, F=32, T=256) for stock top-8, elastic 6-10 iid and elastic
  6-10 balanced, counting (a) ``torch.cuda.set_sync_debug_mode('warn')`` warnings (CUDA only), (b)
  ``aten._local_scalar_dense`` calls of device tensors, (c) ``torch.cuda.Event.synchronize`` calls
  (Megatron's device-to-host sync point), and the dispatcher's ``cuda_sync_point``;
- ``timing``: the same layer (SequentialMLP; TE grouped GEMM where Transformer Engine imports, at
  full shape), forward + backward, stock against elastic 6-10 iid and balanced, interleaved over
  ``--rounds`` rounds (default 10); medians.

torch.compile stays off (``TORCH_COMPILE_DISABLE=1`` unless set): no compile time in the budget.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

from elastic_moe_plugin.tools.bench.megatron import bench_device, megatron_setup, transformer_config
from elastic_moe_plugin.tools.bench.schema import BenchRow, Metric, Scalar, row

MODE = "mcore-cuda"
DEFAULT_ROUNDS = 10
SMALL = dict(S=8, B=3, H=16, E=8, K=2, FFN=24)
TOLERANCE = 1e-4
DISPATCH_CASES: dict[str, dict[str, Any]] = {
    "allgather_dropless": dict(moe_token_dispatcher_type="allgather"),
    "alltoall_dropless": dict(moe_token_dispatcher_type="alltoall"),
    "allgather_capacity": dict(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0),
    "alltoall_capacity": dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0),
    "allgather_drop_and_pad": dict(
        moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
    ),
    "alltoall_drop_and_pad": dict(
        moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
    ),
}
#: variant -> the elastic sampling (None: stock top-8)
VARIANTS: dict[str, str | None] = {"stock": None, "iid": "iid", "balanced": "balanced"}


def _on_cuda() -> bool:
    return bench_device().type == "cuda"


def _sync() -> None:
    if _on_cuda():
        torch.cuda.synchronize()


def have_te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken build
        return False
    return True


def _moe_layer(config, use_te: bool, grouped: bool) -> Any:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    spec = get_moe_module_spec(use_te=use_te, num_experts=config.num_moe_experts, moe_grouped_gemm=grouped)
    layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    layer.set_layer_number(1)
    return layer.to(bench_device())


# ---------------------------------------------------------------------------------- dispatchers
def _dispatch_case(case: str, sampling: str) -> float:
    """Max abs error of the output and the gradients against the dense reference (fp32)."""
    import torch.nn.functional as F

    from elastic_moe_plugin import ElasticConfig, mcore

    S, B, H, E = SMALL["S"], SMALL["B"], SMALL["H"], SMALL["E"]
    device = bench_device()
    mcore.apply(ElasticConfig(schedule="1-3", sampling=sampling))  # type: ignore[arg-type]
    try:
        config = transformer_config(
            num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=SMALL["FFN"],
            moe_ffn_hidden_size=SMALL["FFN"], num_moe_experts=E, moe_router_topk=SMALL["K"],
            moe_aux_loss_coeff=0.0, moe_router_dtype=None, use_cpu_initialization=not _on_cuda(),
            **DISPATCH_CASES[case],
        )  # fmt: skip
        torch.manual_seed(0)
        layer = _moe_layer(config, use_te=False, grouped=False).float()
        with torch.no_grad():
            layer.router.weight.normal_(0.0, 0.5)
        captured: dict[str, torch.Tensor] = {}
        layer.router.register_forward_hook(lambda m, i, o: captured.update(probs=o[0].detach(), map=o[1].detach()))
        generator = torch.Generator(device="cpu").manual_seed(4)
        x = torch.randn(S, B, H, generator=generator).to(device).requires_grad_()
        grad_out = torch.randn(S, B, H, generator=generator).to(device)
        experts = [(m.linear_fc1.weight, m.linear_fc2.weight) for m in layer.experts.local_experts]
        x_ref = x.detach().clone().requires_grad_()
        router_ref = layer.router.weight.detach().clone().requires_grad_()
        experts_ref = [(a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for a, b in experts]
        out, _ = layer(x)
        (out * grad_out).sum().backward()

        record = mcore.routing_records(layer)[0]
        routing_map, probs = captured["map"], captured["probs"]
        kept = routing_map & (probs != 0)
        selected = torch.zeros(S * B, E + 1, dtype=torch.bool, device=device)
        selected = selected.scatter(1, record.expert_ids % (E + 1), True)[:, :E]
        if config.moe_expert_capacity_factor is None and not torch.equal(routing_map.sum(dim=1), record.budgets):
            raise AssertionError(f"{case}/{sampling}: dropless map rows != κ")
        if sampling == "balanced" and int(record.budgets.sum()) != S * B * SMALL["K"]:
            raise AssertionError(f"{case}/balanced: Σκ != T·k")
        tokens = x_ref.reshape(-1, H)
        weights = torch.softmax((tokens @ router_ref.t()).masked_fill(~selected, float("-inf")), dim=-1) * kept
        expert_out = torch.stack(
            [F.linear(config.activation_func(F.linear(tokens, a)), b) for a, b in experts_ref], dim=1
        )
        reference = (weights.unsqueeze(-1) * expert_out).sum(dim=1).view_as(x_ref)
        (reference * grad_out).sum().backward()
        pairs = [(out.detach(), reference.detach()), (x.grad, x_ref.grad), (layer.router.weight.grad, router_ref.grad)]
        for (a, b), (a_ref, b_ref) in zip(experts, experts_ref, strict=True):
            pairs += [(a.grad, a_ref.grad), (b.grad, b_ref.grad)]
        return max(float((p - q).abs().max()) for p, q in pairs)
    finally:
        mcore.remove()


def check_dispatchers() -> list[BenchRow]:
    from elastic_moe_plugin.mcore import dispatch

    rows = []
    shape = "schedule 1-3 around top-2, E=8, H=16, T=24, fp32: output and gradients against a dense reference"
    for case in DISPATCH_CASES:
        for sampling in ("iid", "balanced"):
            error = _dispatch_case(case, sampling)
            metrics: dict[str, Metric] = {"max_abs_error": error, "passed": error <= TOLERANCE}
            rows.append(row(MODE, f"dispatch-{case}", shape, sampling, params={"case": case}, metrics=metrics))
    # flex index conversion on device tensors: κ < k gets -1 slots, κ > k is kept (width b)
    device = bench_device()
    budgets = torch.tensor([1, 2, 3, 1, 3, 2], device=device)
    logits = torch.randn(6, 8, device=device)
    ranks = logits.argsort(dim=1, descending=True).argsort(dim=1)
    routing_map = ranks < budgets.unsqueeze(1)
    probs = torch.softmax(logits.masked_fill(~routing_map, float("-inf")), dim=1)
    token_probs, indices = dispatch.indices_from_routing_map(routing_map, probs, 3)
    passed = bool(torch.equal((indices >= 0).sum(dim=1), budgets)) and bool((token_probs[indices < 0] == 0).all())
    rows.append(row(MODE, "flex-indices", "κ per token into the flex dispatcher's indices", "elastic",
                    metrics={"passed": passed}))  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------- the layer
def _big_layer(tiny: bool):
    import torch.nn.functional as F

    shape = dict(E=16, K=8, H=64, F=32, T=256) if tiny else dict(E=128, K=8, H=2048, F=768, T=8192)
    grouped = have_te() and not tiny and _on_cuda()
    config = transformer_config(
        hidden_size=shape["H"], num_attention_heads=16, ffn_hidden_size=shape["F"], moe_ffn_hidden_size=shape["F"],
        num_moe_experts=shape["E"], moe_router_topk=shape["K"], moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-3, bf16=True, params_dtype=torch.bfloat16, gated_linear_unit=True,
        activation_func=F.silu, moe_grouped_gemm=grouped, use_cpu_initialization=not _on_cuda(),
        moe_permute_fusion=False, moe_router_fusion=False,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = _moe_layer(config, use_te=grouped, grouped=grouped).train()
    generator = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(shape["T"], 1, shape["H"], generator=generator).to(bench_device(), torch.bfloat16)
    grad_out = torch.randn(shape["T"], 1, shape["H"], generator=generator).to(bench_device(), torch.bfloat16)
    description = (
        f"alltoall EP=1 E={shape['E']} k={shape['K']} T={shape['T']} H={shape['H']} F={shape['F']} bf16"
        f"{', TE grouped GEMM' if grouped else ''}, elastic 6-10"
    )
    params = {**{k.lower(): v for k, v in shape.items()}, "grouped_gemm": grouped, "dtype": "bf16"}
    return layer, x.requires_grad_(), grad_out, description, params


def _set_variant(variant: str, layer) -> None:
    from elastic_moe_plugin import ElasticConfig, mcore

    if hasattr(layer.token_dispatcher, "cuda_sync_point"):
        # Megatron only ever moves the alltoall sync point earlier (set once per layer in a static
        # config); reset it so each variant shows where its own step syncs
        layer.token_dispatcher.cuda_sync_point = "no_sync"
    sampling = VARIANTS[variant]
    if sampling is None:
        mcore.remove()
    else:
        mcore.apply(ElasticConfig(schedule="6-10", sampling=sampling))  # type: ignore[arg-type]


def _step(layer, x, grad_out) -> None:
    out, _ = layer(x)
    out.backward(grad_out)


def count_syncs(big) -> list[BenchRow]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from elastic_moe_plugin import cpu_runtime, mcore

    class DeviceReads(TorchDispatchMode):
        """``aten._local_scalar_dense`` of tensors a device computed (the RNG-state check of Megatron's
        tracker fork reads host tensors, which waits for no device; on a CPU every tensor counts)."""

        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                host = cpu_runtime.in_rng_tracker_fork() if cpu_runtime.is_enabled() else args[0].device.type == "cpu"
                self.count += not host
            return func(*args, **(kwargs or {}))

    layer, x, grad_out, description, params = big
    event_cls = torch.cuda.Event
    rows = []
    stock_reads = 0
    for variant, sampling in VARIANTS.items():
        _set_variant(variant, layer)
        for _ in range(2):  # warm-up (allocator, lazy initialisation)
            _step(layer, x, grad_out)
        _sync()
        event_syncs = [0]
        original = event_cls.synchronize

        def counting(self, *args, _original=original, _count=event_syncs, **kwargs):
            _count[0] += 1
            return _original(self, *args, **kwargs)

        event_cls.synchronize = counting  # type: ignore[method-assign]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if _on_cuda():
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    with DeviceReads() as reads:
                        _step(layer, x, grad_out)
                finally:
                    if _on_cuda():
                        torch.cuda.set_sync_debug_mode("default")
            _sync()
        finally:
            event_cls.synchronize = original  # type: ignore[method-assign]
        sync_warnings = [w for w in caught if "synchroniz" in str(w.message)]
        record = mcore.routing_records(layer).get(0) if sampling else None
        stock_reads = reads.count if variant == "stock" else stock_reads
        sites: list[Scalar] = [*sorted({f"{pathlib.Path(w.filename).name}:{w.lineno}" for w in sync_warnings})[:6]]
        metrics: dict[str, Metric] = {
            "sync_debug_warnings": len(sync_warnings),
            "local_scalar_dense": reads.count,
            "event_synchronize": event_syncs[0],
            "cuda_sync_point": str(getattr(layer.token_dispatcher, "cuda_sync_point", None)),
            "mean_kappa": float(record.budgets.float().mean()) if record is not None else float(params["k"]),
            "first_sync_sites": sites,
        }
        ratios = {"syncs_added": reads.count - stock_reads} if sampling else None
        rows.append(row(MODE, "syncs", description, variant, params=params, metrics=metrics,
                        baseline="stock" if sampling else None, ratios=ratios))  # fmt: skip
    _set_variant("stock", layer)
    return rows


def time_layer(big, rounds: int) -> list[BenchRow]:
    layer, x, grad_out, description, params = big
    timings: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for variant in VARIANTS:  # warm-up each path
        _set_variant(variant, layer)
        for _ in range(3):
            _step(layer, x, grad_out)
    _sync()
    for _ in range(rounds):
        for variant in VARIANTS:  # interleaved
            _set_variant(variant, layer)
            layer.zero_grad(set_to_none=True)
            x.grad = None
            _sync()
            start = time.perf_counter()
            _step(layer, x, grad_out)
            _sync()
            timings[variant].append((time.perf_counter() - start) * 1e3)
    _set_variant("stock", layer)
    stock = statistics.median(timings["stock"])
    rows = []
    for variant, values in timings.items():
        median = statistics.median(values)
        metrics: dict[str, Metric] = {"median_ms": median, "min_ms": min(values), "max_ms": max(values)}
        compared = variant != "stock"
        rows.append(row(MODE, "timing", description, variant, params={**params, "rounds": rounds}, metrics=metrics,
                        baseline="stock" if compared else None,
                        ratios={"time_ratio": median / stock} if compared else None))  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------- running
def _failed(section: str) -> BenchRow:
    """A section that raised: a failed check carrying the end of its traceback."""
    return row(MODE, section, "the section raised", "error",
               metrics={"passed": False, "error": traceback.format_exc()[-2000:]})  # fmt: skip


def run_suite(quick: bool, threads: int, rounds: int | None = None) -> list[BenchRow]:
    """Every section (tiny shapes with ``quick`` or without CUDA); a section that raises gives a
    failed row and the next runs."""
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # read when torch._dynamo is first imported
    megatron_setup(threads)
    if _on_cuda():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tiny = quick or not _on_cuda()
    big: list[Any] = []

    def layer_once():
        if not big:  # one layer for the sync count and the timing: built once
            big.append(_big_layer(tiny))
        return big[0]

    sections: dict[str, Callable[[], list[BenchRow]]] = {
        "dispatchers": check_dispatchers,
        "syncs": lambda: count_syncs(layer_once()),
        "timing": lambda: time_layer(layer_once(), rounds or (2 if tiny else DEFAULT_ROUNDS)),
    }
    rows: list[BenchRow] = []
    from elastic_moe_plugin import mcore

    for name, section in sections.items():
        try:
            rows += section()
        except Exception:
            rows.append(_failed(name))
        finally:
            mcore.remove()
    return rows


def format_table(rows: list[BenchRow]) -> str:
    lines = [f"Megatron-core adapter on {bench_device()} ({MODE}); checks pass at max abs error <= {TOLERANCE:g}"]
    for item in rows:
        metrics = item["metrics"]
        cells = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        ratios = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v:+d}" for k, v in item["ratios"].items())
        lines.append(f"{item['scenario']:30s} {item['variant']:9s} {cells} {ratios}".rstrip())
    return "\n".join(lines)


__all__ = ["DISPATCH_CASES", "MODE", "VARIANTS", "check_dispatchers", "count_syncs", "format_table", "run_suite",
           "time_layer"]  # fmt: skip
