"""Benchmark: Megatron's stock ``TopKRouter`` vs the elastic router, forward + backward, on CPU.

    TORCH_COMPILE_DISABLE=1 python scripts/bench_router.py            # T=8192, H=2048, E=64 and 128
    TORCH_COMPILE_DISABLE=1 python scripts/bench_router.py --quick    # small shapes, a few seconds

What is compared (one process, same weights, same inputs):

- stock: ``TopKRouter`` (no elastic patch), top-k = 8.
- elastic: ``ElasticTopKRouter.with_config(ElasticConfig(schedule="6-10"))``, i.e. the same
  ``elastic_routing`` the monkey-patch runs, with budgets 6..10 around k = 8.

Both run fp32 (params, input and ``moe_router_dtype='fp32'``), post-softmax (renormalized gate),
aux loss on (``aux_loss``, coeff 0.01, as OLMoE; ``--no-aux`` turns it off), in training mode.
Two scopes are timed:

- ``router``: ``router(x)`` + backward of ``(probs * g).sum()``: gating GEMM included, what a
  training step pays per MoE layer;
- ``routing``: ``router.routing(logits)`` + backward from leaf logits: the part elastic changes.

Timing: warm-up, then ``--repeats`` rounds; each round runs stock and elastic back to back in an
alternating order (interleaved, so drift and other jobs on the machine hit both), and the figure
is the median of the per-round times (the ratio of the per-scope minima is printed too).
torch runs single-threaded unless ``--threads`` says otherwise: on a shared 2-core machine two
intra-op threads oversubscribe the cores and the same GEMM then varies 2-3x between rounds,
which swamps the difference being measured. Memory: peak bytes of tensors alive during one forward +
backward, above what existed before it. It is counted by a ``TorchDispatchMode`` that adds the
storage size of every tensor an aten op returns (each storage once, views and in-place results
included) and subtracts it when the last tensor of that storage is freed (a weakref finalizer;
torch keeps a tensor's Python object alive while autograd still holds it). This is allocator-
independent and deterministic; kernel-internal scratch buffers are not seen. The peak RSS growth
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``) is printed as a cross-check where
Linux allows it; it includes allocator caching and page granularity.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import torch

from elastic_moe_plugin.compat import megatron_tracker
from elastic_moe_plugin.tools.bench import LiveBytes  # one implementation of the memory counter


# ------------------------------------------------------------------------------------ memory
def _read_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def measure_memory(step) -> tuple[int, int | None]:
    """(peak live tensor bytes, peak RSS growth or None) of one ``step()``."""
    gc.collect()
    with LiveBytes() as live:
        step()
    gc.collect()
    rss = None
    if _reset_peak_rss():
        before = _read_status("VmRSS")
        step()
        peak = _read_status("VmHWM")
        rss = None if before is None or peak is None else max(0, peak - before)
    gc.collect()
    return live.peak, rss


# ------------------------------------------------------------------------------------ set-up
def build(num_experts: int, topk: int, hidden: int, schedule: str, aux_coeff: float):
    from elastic_moe_plugin import cpu_runtime

    cpu_runtime.enable(force=True)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        cpu_runtime.initialize_model_parallel()
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from elastic_moe_plugin import ElasticConfig, mcore

    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=8, ffn_hidden_size=4 * hidden,
        num_moe_experts=num_experts, moe_router_topk=topk, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=aux_coeff,
        moe_token_dispatcher_type="allgather", use_cpu_initialization=True, add_bias_linear=False,
    )
    pg_collection = get_default_pg_collection()
    torch.manual_seed(0)
    stock = TopKRouter(config=config, pg_collection=pg_collection)
    elastic_class = mcore.ElasticTopKRouter.with_config(ElasticConfig(schedule=schedule))
    elastic = elastic_class(config=config, pg_collection=pg_collection)
    elastic.load_state_dict(stock.state_dict())
    for router in (stock, elastic):
        router.set_layer_number(1)
        router.train()
    return stock, elastic


def make_steps(router, x, logits0, grad_probs):
    def router_step():
        router.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_()
        probs, _ = router(xx)
        (probs * grad_probs).sum().backward()

    def routing_step():
        logits = logits0.detach().requires_grad_()
        probs, _ = router.routing(logits)
        (probs * grad_probs).sum().backward()

    return {"router": router_step, "routing": routing_step}


def bench(num_experts, topk, schedule, tokens, hidden, warmup, repeats, aux_coeff):
    stock, elastic = build(num_experts, topk, hidden, schedule, aux_coeff)
    torch.manual_seed(1)
    x = torch.randn(tokens, 1, hidden)
    with torch.no_grad():
        logits0 = stock.gating(x)
    grad_probs = torch.randn(tokens, num_experts)
    steps = {"stock": make_steps(stock, x, logits0, grad_probs), "elastic": make_steps(elastic, x, logits0, grad_probs)}
    results = {}
    for scope in ("router", "routing"):
        for _ in range(warmup):
            for name in ("stock", "elastic"):
                steps[name][scope]()
        times = {"stock": [], "elastic": []}
        for round_index in range(repeats):
            order = ("stock", "elastic") if round_index % 2 == 0 else ("elastic", "stock")
            for name in order:
                start = time.perf_counter()
                steps[name][scope]()
                times[name].append(time.perf_counter() - start)
            megatron_tracker.zero()
        memory = {name: measure_memory(steps[name][scope]) for name in ("stock", "elastic")}
        megatron_tracker.zero()
        results[scope] = (times, memory)
    return results


def _fmt_bytes(value):
    return "n/a" if value is None else f"{value / 2**20:8.1f} MiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (T=1024, H=256)")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--experts", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--schedule", default="6-10")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    parser.add_argument("--no-aux", action="store_true", help="moe_aux_loss_coeff=0 (default: aux_loss, 0.01)")
    args = parser.parse_args(argv)
    tokens = args.tokens or (1024 if args.quick else 8192)
    hidden = args.hidden or (256 if args.quick else 2048)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    repeats = args.repeats if args.repeats is not None else (7 if args.quick else 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    aux_coeff = 0.0 if args.no_aux else 0.01

    import importlib.metadata

    print(f"torch {torch.__version__}, megatron-core {importlib.metadata.version('megatron-core')}, "
          f"{torch.get_num_threads()} threads, T={tokens}, H={hidden}, k={args.topk}, schedule {args.schedule}, "
          f"fp32, aux_loss {'off' if args.no_aux else 'on (0.01)'}, warm-up {warmup}, {repeats} interleaved rounds")
    ok = True
    for num_experts in args.experts:
        results = bench(num_experts, args.topk, args.schedule, tokens, hidden, warmup, repeats, aux_coeff)
        for scope, (times, memory) in results.items():
            stock_t, elastic_t = statistics.median(times["stock"]), statistics.median(times["elastic"])
            (stock_live, stock_rss), (elastic_live, elastic_rss) = memory["stock"], memory["elastic"]
            time_ratio, mem_ratio = elastic_t / stock_t, elastic_live / stock_live
            min_ratio = min(times["elastic"]) / min(times["stock"])
            print(f"E={num_experts:4d} {scope:8s} median fwd+bwd: stock {stock_t * 1e3:8.2f} ms, "
                  f"elastic {elastic_t * 1e3:8.2f} ms, ratio {time_ratio:5.3f} (of minima {min_ratio:5.3f}) | "
                  f"peak live tensors: stock "
                  f"{_fmt_bytes(stock_live)}, elastic {_fmt_bytes(elastic_live)}, ratio {mem_ratio:5.3f} | "
                  f"peak RSS growth: stock {_fmt_bytes(stock_rss)}, elastic {_fmt_bytes(elastic_rss)}")
            if scope == "router":
                ok &= time_ratio <= 1.15 and mem_ratio <= 1.10
    print("goal (router scope: time ratio <= 1.15, memory ratio <= 1.10):", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
