"""``elastic-moe bench --only log-metrics``: what a logging step of the transformers door's routing
metrics costs the training thread, ``log_metrics: layers`` against ``means`` (``docs/diagnostics.md``,
"What is logged, and what it costs").

A tiny OLMoE (hidden 32, 16 experts, top-8, schedule 6-10) with ``LAYERS`` MoE layers (48, the
size of the models the paper fine-tunes; ``--quick``: 8) on CUDA when there is one, else on the CPU.
Before each logging step, one training forward of 256 tokens makes the records a logging step reads.
One logging step is what ``swift sft --report_to tensorboard`` runs on the training thread for the
routing metrics: ``hf.logged_metrics`` (one device read), ``hf.reset_budget_histograms``, then
transformers' ``TensorBoardCallback.on_log`` with the real ``SummaryWriter`` (``add_scalar`` per
value, then ``flush()``, which waits for the writer thread). Rounds alternate the order of the two
layouts so that load on the machine hits both alike; medians over ``--rounds`` (default 60,
``--quick`` 5) each, after 3 rounds of warm-up.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

from elastic_moe_plugin.tools.bench.schema import BenchRow, Scalar, row

DEFAULT_ROUNDS, QUICK_ROUNDS = 60, 5
LAYERS, QUICK_LAYERS = 48, 8
TOKENS = 256
Layout = Literal["layers", "means"]
LAYOUTS: tuple[Layout, Layout] = ("layers", "means")


@dataclass
class LogMetricsResult:
    """Seconds per logging step of each layout (one value per round) and the scalars it wrote."""

    layers: int
    device: str
    tokens: int
    seconds: dict[str, list[float]]
    scalars: dict[str, int]


def run(quick: bool, threads: int, rounds: int | None = None) -> LogMetricsResult:
    import torch
    import transformers
    from transformers.integrations import TensorBoardCallback
    from transformers.trainer_callback import TrainerControl, TrainerState

    from elastic_moe_plugin import ElasticConfig, hf

    if threads:
        torch.set_num_threads(threads)
    layers = QUICK_LAYERS if quick else LAYERS
    rounds = rounds or (QUICK_ROUNDS if quick else DEFAULT_ROUNDS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = {layout: ElasticConfig(schedule="6-10", log_metrics=layout) for layout in LAYOUTS}
    hf.apply(configs["layers"])
    try:
        config = transformers.OlmoeConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=128, num_experts=16, num_experts_per_tok=8,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        # as an nn.Module: transformers types the PreTrainedModel.to of its stubs for another signature
        model: torch.nn.Module = transformers.OlmoeForCausalLM(config)
        model = model.to(device).train()
        with tempfile.TemporaryDirectory() as folder:
            args = transformers.TrainingArguments(output_dir=folder, report_to="none", use_cpu=device == "cpu")
            callback = TensorBoardCallback()
            callback.logging_dir = folder
            state, control = TrainerState(is_world_process_zero=True), TrainerControl()

            def logging_step(layout: Layout, step: int) -> tuple[float, int]:
                hf.apply(configs[layout])  # the two configs differ in log_metrics alone
                model(input_ids=torch.randint(3, 128, (4, TOKENS // 4), device=device))
                if device == "cuda":
                    torch.cuda.synchronize()
                state.global_step = step
                start = time.perf_counter()
                values = hf.logged_metrics(model)
                hf.reset_budget_histograms(model)
                logs = {"loss": 1.0, "grad_norm": 1.0, "learning_rate": 1e-5, **values}
                callback.on_log(args, state, control, logs=logs)
                return time.perf_counter() - start, len(values)

            seconds: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
            scalars: dict[str, int] = {}
            for warm_up in range(3):
                for layout in LAYOUTS:
                    logging_step(layout, warm_up)
            for index in range(rounds):
                for layout in LAYOUTS if index % 2 == 0 else LAYOUTS[::-1]:
                    elapsed, scalars[layout] = logging_step(layout, 10 + index)
                    seconds[layout].append(elapsed)
            callback.on_train_end(args, state, control)
    finally:
        hf.remove()
    return LogMetricsResult(layers, device, TOKENS, seconds, scalars)


def rows(result: LogMetricsResult) -> list[BenchRow]:
    """One row per layout; ``means`` against ``layers``."""
    shape = f"OLMoE {result.layers} MoE layers, 16 experts top-8, 6-10, {result.tokens} tokens, {result.device}"
    params: dict[str, Scalar] = {"layers": result.layers, "device": result.device, "tokens": result.tokens}
    medians = {layout: statistics.median(values) * 1e3 for layout, values in result.seconds.items()}
    out = []
    for layout, values in result.seconds.items():
        ms = sorted(value * 1e3 for value in values)
        compared = layout == "means"
        out.append(
            row(
                "log-metrics",
                "logging step",
                shape,
                layout,
                params={**params, "rounds": len(ms)},
                metrics={
                    "scalars": result.scalars[layout],
                    "median_ms": medians[layout],
                    "p10_ms": ms[len(ms) // 10],
                    "p90_ms": ms[9 * len(ms) // 10],
                    "us_per_scalar": medians[layout] * 1e3 / max(result.scalars[layout], 1),
                },
                baseline="layers" if compared else None,
                ratios={"time_ratio": medians["means"] / medians["layers"]} if compared else None,
            )
        )
    return out


def format_table(result: LogMetricsResult) -> str:
    lines = [
        f"log_metrics: a logging step of {result.layers} MoE layers on {result.device} "
        f"(median of {len(result.seconds['layers'])} alternating rounds)",
        f"{'layout':8s} {'scalars':>8s} {'median ms':>10s} {'p10-p90 ms':>17s} {'µs/scalar':>10s}",
    ]
    for item in rows(result):
        metrics = item["metrics"]
        lines.append(
            f"{item['variant']:8s} {metrics['scalars']:8d} {metrics['median_ms']:10.2f} "
            f"{metrics['p10_ms']:8.2f}-{metrics['p90_ms']:8.2f} {metrics['us_per_scalar']:10.1f}"
        )
    return "\n".join(lines)


__all__ = [
    "DEFAULT_ROUNDS",
    "LAYERS",
    "QUICK_LAYERS",
    "QUICK_ROUNDS",
    "LogMetricsResult",
    "format_table",
    "rows",
    "run",
]
