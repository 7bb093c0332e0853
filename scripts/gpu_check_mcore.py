#!/usr/bin/env python
"""GPU check of the Megatron-core adapter: dispatchers on CUDA, host syncs per layer, and timing.

For a machine with ONE CUDA GPU and megatron-core installed (Transformer Engine optional). Runs in
one process (world size 1, NCCL), finishes in well under 8 minutes, and prints ONE JSON line on
stdout (everything else goes to stderr)::

    python scripts/gpu_check_mcore.py                 # on the GPU machine
    python scripts/gpu_check_mcore.py --smoke         # tiny shapes on CPU (elastic_moe_plugin.cpu_runtime), no GPU needed

Sections (each guarded; a failure is reported in ``errors`` and the others still run):

``dispatchers``  the checks of tests/mcore/test_mcore_layer.py::test_dispatchers_combine_exactly_what_the_router_routed
                 rerun on CUDA: allgather / alltoall x dropless / capacity / drop-and-pad x iid / balanced
                 (schedule 1-3 around top-2, E=8, fp32, TF32 off); the layer's output and the gradients of
                 its input, router weight and expert weights equal a dense reference built from the
                 router's own selection. Plus the flex-dispatcher index conversion on CUDA tensors.
``syncs``        one training forward+backward of an alltoall MoE layer (EP=1; E=128, top-8, H=2048 bf16,
                 T=8192) for stock top-8, elastic 6-10 iid and elastic 6-10 balanced, counting
                 (a) ``torch.cuda.set_sync_debug_mode('warn')`` warnings, (b) ``aten::_local_scalar_dense``
                 calls (TorchDispatchMode), (c) ``torch.cuda.Event.synchronize`` calls (Megatron's DtoH
                 sync point), and the dispatcher's ``cuda_sync_point``.
``timing``       the same layer (SequentialMLP; TE grouped GEMM when Transformer Engine imports), forward +
                 backward, stock vs elastic 6-10 (iid and balanced) interleaved; medians in ms.
``cpu_pytest``   the CPU test files tests/mcore/test_mcore_dispatch.py and test_mcore_layer.py (they force
                 the CPU path even on a GPU machine), as a sanity check of the installed stack.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEADLINE_S = 420.0  # stop starting new sections after this (the whole run must stay < 8 min)


# ================================================================================ setup
def setup(smoke: bool) -> dict:
    import torch
    import torch.distributed as dist

    info = {"torch": torch.__version__, "smoke": smoke}
    if smoke:
        from elastic_moe_plugin import cpu_runtime

        cpu_runtime.disable_torch_compile()
        cpu_runtime.enable(force=True)
        cpu_runtime.initialize_model_parallel(seed=1234)
        info["device"] = "cpu"
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: run on the GPU machine, or pass --smoke for the CPU path")
        torch.cuda.set_device(0)
        store_dir = tempfile.mkdtemp(prefix="gpu_check_mcore_")
        store = dist.FileStore(os.path.join(store_dir, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        info["device"] = torch.cuda.get_device_name(0)
    from elastic_moe_plugin import mcore

    info["megatron_core"] = str(mcore.megatron_core_version())
    info["transformer_engine"] = _have_te()
    return info


def _have_te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken build
        return False
    return True


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not _SMOKE else torch.device("cpu")


def _sync():
    import torch

    if torch.cuda.is_available() and not _SMOKE:
        torch.cuda.synchronize()


def _moe_layer(config, use_te: bool, grouped: bool):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    spec = get_moe_module_spec(use_te=use_te, num_experts=config.num_moe_experts, moe_grouped_gemm=grouped)
    layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    layer.set_layer_number(1)
    return layer.to(_device())


# ================================================================================ dispatchers on CUDA
SMALL = dict(S=8, B=3, H=16, E=8, K=2, FFN=24)


def _small_config(**overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=2, hidden_size=SMALL["H"], num_attention_heads=2, ffn_hidden_size=SMALL["FFN"],
                  moe_ffn_hidden_size=SMALL["FFN"], num_moe_experts=SMALL["E"], moe_router_topk=SMALL["K"],
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, add_bias_linear=False,
                  activation_func=F.gelu, gated_linear_unit=False, use_cpu_initialization=_SMOKE)
    values.update(overrides)
    return TransformerConfig(**values)


DISPATCH_CASES = {
    "allgather_dropless": dict(moe_token_dispatcher_type="allgather"),
    "alltoall_dropless": dict(moe_token_dispatcher_type="alltoall"),
    "allgather_capacity": dict(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0),
    "alltoall_capacity": dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0),
    "allgather_drop_and_pad": dict(moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0,
                                   moe_pad_expert_input_to_capacity=True),
    "alltoall_drop_and_pad": dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0,
                                  moe_pad_expert_input_to_capacity=True),
}


def _dispatch_case(case: str, sampling: str) -> float:
    """Max abs error of output and gradients against the dense reference (fp32)."""
    import torch

    from elastic_moe_plugin import ElasticConfig, mcore

    S, B, H, E = SMALL["S"], SMALL["B"], SMALL["H"], SMALL["E"]
    device = _device()
    mcore.apply(ElasticConfig(schedule="1-3", sampling=sampling))
    try:
        config = _small_config(**DISPATCH_CASES[case])
        torch.manual_seed(0)
        layer = _moe_layer(config, use_te=False, grouped=False).float()
        with torch.no_grad():
            layer.router.weight.normal_(0.0, 0.5)
        captured = {}
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
        selected = torch.zeros(S * B, E + 1, dtype=torch.bool, device=device).scatter(
            1, record.expert_ids % (E + 1), True)[:, :E]
        if config.moe_expert_capacity_factor is None and not bool(torch.equal(routing_map.sum(dim=1), record.budgets)):
            raise AssertionError(f"{case}/{sampling}: dropless map rows != κ")
        if sampling == "balanced" and int(record.budgets.sum()) != S * B * SMALL["K"]:
            raise AssertionError(f"{case}/balanced: Σκ != T·k")
        tokens = x_ref.reshape(-1, H)
        logits = tokens @ router_ref.t()
        weights = torch.softmax(logits.masked_fill(~selected, float("-inf")), dim=-1) * kept
        expert_out = torch.stack([torch.nn.functional.linear(config.activation_func(torch.nn.functional.linear(tokens, a)), b)
                                  for a, b in experts_ref], dim=1)
        reference = (weights.unsqueeze(-1) * expert_out).sum(dim=1).view_as(x_ref)
        (reference * grad_out).sum().backward()
        pairs = [(out.detach(), reference.detach()), (x.grad, x_ref.grad), (layer.router.weight.grad, router_ref.grad)]
        for (a, b), (a_ref, b_ref) in zip(experts, experts_ref):
            pairs += [(a.grad, a_ref.grad), (b.grad, b_ref.grad)]
        return max(float((p - q).abs().max()) for p, q in pairs)
    finally:
        mcore.remove()


def check_dispatchers() -> dict:
    import torch

    from elastic_moe_plugin.mcore import dispatch

    errors = {}
    for case in DISPATCH_CASES:
        for sampling in ("iid", "balanced"):
            errors[f"{case}/{sampling}"] = _dispatch_case(case, sampling)
    # flex index conversion on device tensors: κ < k gets -1 slots, κ > k is kept (width b)
    device = _device()
    budgets = torch.tensor([1, 2, 3, 1, 3, 2], device=device)
    logits = torch.randn(6, 8, device=device)
    ranks = logits.argsort(dim=1, descending=True).argsort(dim=1)
    routing_map = ranks < budgets.unsqueeze(1)
    probs = torch.softmax(logits.masked_fill(~routing_map, float("-inf")), dim=1)
    token_probs, indices = dispatch.indices_from_routing_map(routing_map, probs, 3)
    flex_ok = bool(torch.equal((indices >= 0).sum(dim=1), budgets)) and bool((token_probs[indices < 0] == 0).all())
    worst = max(errors.values())
    return {"max_abs_error": worst, "passed": worst <= 1e-4 and flex_ok, "flex_indices_ok": flex_ok, "cases": errors}


# ================================================================================ big layer
def _big_config(smoke: bool, dispatcher="alltoall"):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = dict(E=16, K=8, H=64, F=32, T=256) if smoke else dict(E=128, K=8, H=2048, F=768, T=8192)
    grouped = _have_te() and not smoke
    config = TransformerConfig(
        num_layers=1, hidden_size=shape["H"], num_attention_heads=16, ffn_hidden_size=shape["F"],
        moe_ffn_hidden_size=shape["F"], num_moe_experts=shape["E"], moe_router_topk=shape["K"],
        moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
        moe_router_dtype="fp32", bf16=True, params_dtype=torch.bfloat16, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, moe_grouped_gemm=grouped, use_cpu_initialization=smoke,
        moe_permute_fusion=False, moe_router_fusion=False,
    )
    return config, shape, grouped


MODES = {"stock_top8": None, "elastic_6_10_iid": "iid", "elastic_6_10_balanced": "balanced"}


def _set_mode(mode: str, layer=None) -> None:
    from elastic_moe_plugin import ElasticConfig, mcore

    if layer is not None and hasattr(layer.token_dispatcher, "cuda_sync_point"):
        # Megatron only ever moves the alltoall sync point earlier (it is set once per layer in a
        # static config); reset it so each mode shows where its own step syncs.
        layer.token_dispatcher.cuda_sync_point = "no_sync"
    sampling = MODES[mode]
    if sampling is None:
        mcore.remove()
    else:
        mcore.apply(ElasticConfig(schedule="6-10", sampling=sampling))


def _step(layer, x, grad_out):
    out, _ = layer(x)
    out.backward(grad_out)
    return out


def _big_layer(smoke: bool):
    import torch

    config, shape, grouped = _big_config(smoke)
    torch.manual_seed(0)
    layer = _moe_layer(config, use_te=grouped, grouped=grouped).train()
    generator = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(shape["T"], 1, shape["H"], generator=generator).to(_device(), torch.bfloat16).requires_grad_()
    grad_out = torch.randn(shape["T"], 1, shape["H"], generator=generator).to(_device(), torch.bfloat16)
    return layer, x, grad_out, shape, grouped


def _cached_big_layer(smoke: bool, state: dict):
    if "big" not in state:  # one layer for the sync count and the timing: build it once
        state["big"] = _big_layer(smoke)
    return state["big"]


def _host_only_read(tensor) -> bool:
    from elastic_moe_plugin import cpu_runtime

    if cpu_runtime.is_enabled():
        return cpu_runtime.in_rng_tracker_fork()
    return tensor.device.type == "cpu"


def count_syncs(smoke: bool, state: dict) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # Reads of host tensors wait for no device (the RNG-state check of Megatron's tracker
            # fork, which κ's draw enters); under --smoke every tensor is a host tensor.
            if func is torch.ops.aten._local_scalar_dense.default and not _host_only_read(args[0]):
                self.count += 1
            return func(*args, **(kwargs or {}))

    layer, x, grad_out, shape, grouped = _cached_big_layer(smoke, state)
    event_cls = torch.cuda.Event
    results = {}
    for mode in MODES:
        _set_mode(mode, layer)
        for _ in range(2):  # warm-up (allocator, lazy init)
            _step(layer, x, grad_out)
        _sync()
        event_syncs = [0]
        original = event_cls.synchronize

        def counting(self, *args, _original=original, _count=event_syncs, **kwargs):
            _count[0] += 1
            return _original(self, *args, **kwargs)

        event_cls.synchronize = counting
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if not smoke:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    with Reads() as reads:
                        _step(layer, x, grad_out)
                finally:
                    if not smoke:
                        torch.cuda.set_sync_debug_mode("default")
            _sync()
        finally:
            event_cls.synchronize = original
        sync_warnings = [w for w in caught if "synchroniz" in str(w.message)]
        from elastic_moe_plugin import mcore

        records = mcore.routing_records(layer)
        results[mode] = {
            "sync_debug_warnings": len(sync_warnings),
            "local_scalar_dense": reads.count,
            "event_synchronize": event_syncs[0],
            "cuda_sync_point": getattr(layer.token_dispatcher, "cuda_sync_point", None),
            "sum_kappa_over_T": (float(records[0].budgets.float().mean()) if MODES[mode] else float(shape["K"])),
            "first_sync_sites": sorted({f"{pathlib.Path(w.filename).name}:{w.lineno}" for w in sync_warnings})[:6],
        }
    _set_mode("stock_top8")
    return {"layer": {**shape, "grouped_gemm": grouped, "dtype": "bf16", "dispatcher": "alltoall", "ep": 1},
            "per_layer_fwd_bwd": results}


def time_layer(smoke: bool, state: dict, rounds: int) -> dict:
    layer, x, grad_out, shape, grouped = _cached_big_layer(smoke, state)
    timings = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up each path
        _set_mode(mode, layer)
        for _ in range(3):
            _step(layer, x, grad_out)
    _sync()
    for _ in range(rounds):
        for mode in MODES:  # interleaved
            _set_mode(mode, layer)
            layer.zero_grad(set_to_none=True)
            x.grad = None
            _sync()
            start = time.perf_counter()
            _step(layer, x, grad_out)
            _sync()
            timings[mode].append((time.perf_counter() - start) * 1e3)
    _set_mode("stock_top8")
    medians = {mode: statistics.median(values) for mode, values in timings.items()}
    stock = medians["stock_top8"]
    return {"rounds": rounds, "median_ms": {m: round(v, 3) for m, v in medians.items()},
            "overhead_vs_stock_pct": {m: round(100.0 * (v / stock - 1.0), 2) for m, v in medians.items() if m != "stock_top8"},
            "layer": {**shape, "grouped_gemm": grouped, "dtype": "bf16"}}


def cpu_pytest(timeout_s: int) -> dict:
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return {"passed": True, "summary": "skipped: pytest is not installed"}
    env = dict(os.environ, TORCH_COMPILE_DISABLE="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
               "tests/mcore/test_mcore_dispatch.py", "tests/mcore/test_mcore_layer.py"]
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
                                check=False)
    except subprocess.TimeoutExpired:
        return {"passed": False, "summary": f"timed out after {timeout_s}s"}
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return {"passed": result.returncode == 0, "summary": lines[-1] if lines else result.stderr[-300:]}


# ================================================================================ main
_SMOKE = False


def main(argv=None) -> int:
    global _SMOKE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through elastic_moe_plugin.cpu_runtime (no GPU)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds (default 10)")
    parser.add_argument("--skip-pytest", action="store_true", help="skip the CPU pytest sanity check")
    parser.add_argument("--compile", action="store_true",
                        help="leave torch.compile on (Megatron's jit_fuser); off by default: no compile time in the budget")
    args = parser.parse_args(argv)
    _SMOKE = args.smoke
    if not args.compile:
        os.environ["TORCH_COMPILE_DISABLE"] = "1"  # read when torch._dynamo is first imported
    started = time.monotonic()
    report: dict = {"errors": {}}
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        try:
            report["setup"] = setup(args.smoke)
        except Exception:
            report["errors"]["setup"] = traceback.format_exc()[-2000:]
        state: dict = {}
        sections = [("dispatchers", check_dispatchers), ("syncs", lambda: count_syncs(args.smoke, state)),
                    ("timing", lambda: time_layer(args.smoke, state, args.rounds))]
        if not args.skip_pytest and not args.smoke:
            sections.append(("cpu_pytest", lambda: cpu_pytest(timeout_s=max(30, int(DEADLINE_S - (time.monotonic() - started))))))
        for name, section in sections if "setup" not in report["errors"] else []:
            if time.monotonic() - started > DEADLINE_S:
                report["errors"][name] = "skipped: time budget spent"
                continue
            section_start = time.monotonic()
            try:
                report[name] = section()
            except Exception:
                report["errors"][name] = traceback.format_exc()[-2000:]
            finally:
                with contextlib.suppress(Exception):
                    from elastic_moe_plugin import mcore

                    mcore.remove()
            report.setdefault("section_s", {})[name] = round(time.monotonic() - section_start, 2)
    report["elapsed_s"] = round(time.monotonic() - started, 2)
    report["ok"] = not report["errors"] and report.get("dispatchers", {}).get("passed", False) and (
        report.get("cpu_pytest", {"passed": True})["passed"])
    stdout.write(json.dumps(report, sort_keys=True, default=str) + "\n")
    stdout.flush()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
