"""Training and measuring the demo's runs, on the CPU (Megatron's CPU path) or one CUDA GPU.

:func:`train_runs` trains one model per named :class:`ElasticConfig` (the demo: ``static``, then
``elastic``) on ``settings.device`` (:mod:`.device`: the CPU compatibility layer on, or Megatron's
own CUDA path); :func:`train_run` is one of them, from scratch, in its own model-parallel state and
under ``mcore.patched(config)``, as users patch on GPUs. The steps of a run, in order (the order
fixes what the seeded RNG draws):

1. seed torch with ``settings.seed``, build the model (on the CPU, then moved to the device), hook
   its routers (:class:`RoutingStats`);
2. :func:`train_loop`: AdamW (betas 0.9/0.95, weight decay 0.01, gradient clip 1.0), the lr of
   :func:`learning_rate`, held-out evaluations every ``steps // eval_points`` steps; tokens per
   expert are counted over the last quarter of the steps;
3. the realised κ and exposure per layer (:func:`realised_budgets`) and Megatron's tracked
   load-balancing loss per layer, averaged over the steps;
4. :func:`topk_sweep`: held-out loss with static routing at inference top-k' = k-2..k+2.

Every loss is Megatron's mean per-token cross-entropy (nats). Batches are drawn on the CPU and moved
to the model's device; measurements and state dicts come back on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any, TypedDict

import torch

from elastic_moe_plugin.compat import megatron_tracker
from elastic_moe_plugin.core.config import ElasticConfig
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.core.schedule import BudgetSchedule
from elastic_moe_plugin.tools import inference_topk
from elastic_moe_plugin.tools.demo import device
from elastic_moe_plugin.tools.demo.corpus import TASKS, Corpus
from elastic_moe_plugin.tools.demo.model import build_model, causal_mask
from elastic_moe_plugin.tools.demo.progress import Progress
from elastic_moe_plugin.tools.demo.settings import DemoSettings
from elastic_moe_plugin.tools.demo.stats import RoutingStats, realised_budgets


def learning_rate(step: int, settings: DemoSettings) -> float:
    """Linear warm-up over ``max(1, steps // 20)`` steps to ``lr``, then a cosine decay to ``0.1 lr``."""
    warmup = max(1, settings.steps // 20)
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def evaluate(model, heldout: torch.Tensor, batch_size: int = 64) -> float:
    """Mean per-token held-out loss in eval mode (static routing at the routers' current top-k), on
    the model's device (``heldout`` may be on the CPU)."""
    was_training = model.training
    model.eval()
    on = _device_of(model)
    seq_len = heldout.shape[1] - 1
    mask = causal_mask(seq_len).to(on)
    total, count = 0.0, 0
    try:
        for start in range(0, heldout.shape[0], batch_size):
            batch = heldout[start : start + batch_size].to(on)
            positions = torch.arange(seq_len, device=on).expand(batch.shape[0], seq_len)
            loss = model(batch[:, :-1], positions, mask, labels=batch[:, 1:])
            total += float(loss.double().sum())
            count += loss.numel()
    finally:
        model.train(was_training)
    return total / count


class History(TypedDict):
    """``step`` / ``loss`` every step (1-based), ``eval_step`` / ``eval_loss`` at every evaluation."""

    step: list[int]
    loss: list[float]
    eval_step: list[int]
    eval_loss: list[float]


@dataclasses.dataclass
class TrainingLog:
    """What :func:`train_loop` recorded."""

    history: History
    train_time: float  # seconds of training steps, evaluations excluded
    eval_time: float  # seconds of the held-out evaluations during training
    window_start: int  # first (0-based) step whose tokens per expert are counted


def _train_step(
    model, optimizer: torch.optim.Optimizer, batch: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, lr: float
) -> float:
    """One optimizer step on ``batch`` [B, S + 1]; returns its training loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss = model(batch[:, :-1], positions, mask, labels=batch[:, 1:]).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def train_loop(name: str, model, stats: RoutingStats, settings: DemoSettings, corpus: Corpus) -> TrainingLog:
    """``settings.steps`` AdamW steps on the corpus' batches (moved to the model's device), with
    periodic held-out evaluations."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01)
    on = _device_of(model)
    mask = causal_mask(settings.seq_len).to(on)
    positions = torch.arange(settings.seq_len, device=on).expand(settings.batch_size, settings.seq_len)
    eval_every = max(1, settings.steps // max(1, settings.eval_points))
    window_start = settings.steps - max(1, settings.steps // 4)
    history: History = {"step": [], "loss": [], "eval_step": [], "eval_loss": []}
    progress = Progress(name, settings.steps)
    train_start = time.perf_counter()
    eval_time = 0.0
    loss_value = float("nan")
    for step, batch in enumerate(corpus.batches(settings.steps, settings.batch_size, settings.seed)):
        stats.count_experts = step >= window_start
        loss_value = _train_step(model, optimizer, batch.to(on), positions, mask, learning_rate(step, settings))
        if not math.isfinite(loss_value):
            raise RuntimeError(f"{name} run: training loss became {loss_value} at step {step}.")
        history["step"].append(step + 1)
        history["loss"].append(loss_value)
        if (step + 1) % eval_every == 0 or step + 1 == settings.steps:
            tick = time.perf_counter()
            history["eval_step"].append(step + 1)
            history["eval_loss"].append(evaluate(model, corpus.heldout))
            eval_time += time.perf_counter() - tick
        progress.update(step + 1, (step + 1) * settings.tokens_per_step, loss_value)
    train_time = time.perf_counter() - train_start - eval_time
    progress.close(settings.steps, settings.tokens, loss_value)
    return TrainingLog(history, train_time, eval_time, window_start)


def topk_sweep(model, stats: RoutingStats, settings: DemoSettings, heldout: torch.Tensor) -> dict[str, float]:
    """{"k'": held-out loss} with static routing at top-k' for k' in k-2..k+2 (within 1..E); the
    tokens per expert of the held-out set are counted at the trained k."""
    sweep = {}
    for k in range(max(1, settings.topk - 2), min(settings.num_experts, settings.topk + 2) + 1):
        with inference_topk.megatron(model, k):
            stats.eval_on = k == settings.topk
            sweep[str(k)] = evaluate(model, heldout)
            stats.eval_on = False
    return sweep


def task_losses(model, corpus: Corpus) -> dict[str, float]:
    """{task: held-out loss at the trained top-k over that task's sequences} of the synthetic mixture
    (a sequence's task is its first token, the tag); {} for a file corpus."""
    if corpus.train is None:
        return {}
    tags = corpus.heldout[:, 0]
    return {
        name: evaluate(model, corpus.heldout[tags == 1 + i]) for i, name in enumerate(TASKS) if (tags == 1 + i).any()
    }


def aux_loss_per_layer(steps: int) -> dict[str, float]:
    """Megatron's tracked load-balancing loss per layer, averaged over ``steps`` ({} if never tracked)."""
    aux = megatron_tracker.values("load_balancing_loss")
    return {str(i): float(v) / steps for i, v in enumerate(aux.tolist())} if aux is not None else {}


def _elastic_layers(elastic: ElasticConfig, schedule: BudgetSchedule, num_layers: int) -> list[int]:
    return sorted(layer for layer in range(num_layers) if not schedule.is_static and elastic.layer_is_elastic(layer))


def _train_and_measure(
    name: str, elastic: ElasticConfig, settings: DemoSettings, corpus: Corpus, config: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Steps 1-4 of the module docstring, under the patch; returns (measurements, state dict)."""
    from elastic_moe_plugin import mcore

    torch.manual_seed(settings.seed)
    model = build_model(config).to(device.torch_device(settings.device))
    model.train()
    schedule = elastic.budget_schedule(settings.topk)
    elastic_layers = _elastic_layers(elastic, schedule, settings.num_layers)
    stats = RoutingStats(model, settings.num_experts)
    log = train_loop(name, model, stats, settings, corpus)
    # Realised κ: Megatron-side budget histograms for elastic layers, routing maps otherwise.
    budget_histograms = {layer: h.detach().to("cpu", copy=True) for layer, h in mcore.budget_histograms(model).items()}
    kappa, exposure = realised_budgets(
        name, budget_histograms, stats, schedule, elastic_layers, settings.topk, settings.num_layers
    )
    aux_loss = aux_loss_per_layer(settings.steps)
    tick = time.perf_counter()
    sweep = topk_sweep(model, stats, settings, corpus.heldout)
    tasks = task_losses(model, corpus)
    eval_time = log.eval_time + time.perf_counter() - tick
    stats.remove()
    tail = log.history["loss"][-max(1, settings.steps // 10) :]
    result = {
        "schedule": schedule.spec(),
        "elastic_config": elastic.to_dict(),
        "elastic_layers": elastic_layers,
        "steps": settings.steps,
        "tokens": settings.tokens,
        "final_train_loss": sum(tail) / len(tail),
        "final_train_loss_steps": len(tail),
        "heldout_loss": sweep[str(settings.topk)],
        "topk_sweep": sweep,
        "task_losses": tasks,
        "kappa": kappa,
        "exposure": exposure,
        "imbalance": stats.imbalance(settings.steps - log.window_start),
        "aux_loss": aux_loss,
        "train_time_s": log.train_time,
        "eval_time_s": eval_time,
        "tokens_per_s": settings.tokens / log.train_time,
        "history": log.history,
    }
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return result, state


def train_run(
    name: str, elastic: ElasticConfig, settings: DemoSettings, corpus: Corpus, config: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train one model from scratch in fresh model-parallel state under ``mcore.patched(elastic)``, on
    ``settings.device`` inside :func:`train_runs`' runtime; returns (measurements, state dict on the
    CPU). Megatron's MoE tracker is reset before and after."""
    from elastic_moe_plugin import mcore

    run_start = time.perf_counter()
    with device.model_parallel(settings.device, settings.seed):
        megatron_tracker.reset()
        try:
            with mcore.patched(elastic):
                result, state = _train_and_measure(name, elastic, settings, corpus, config)
        finally:
            megatron_tracker.reset()
    result["wall_time_s"] = time.perf_counter() - run_start
    return result, state


def train_runs(
    runs: Mapping[str, ElasticConfig], settings: DemoSettings, corpus: Corpus, config: dict[str, Any]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, torch.Tensor]], str]:
    """:func:`train_run` for each named config, in order, on ``settings.device``: "cpu" with the CPU
    compatibility layer on (forced on a CUDA machine: the demo runs on the CPU by design), "cuda" on
    one GPU without it (:mod:`.device`). Returns (measurements per run, state dict per run on the
    CPU, megatron-core version).

    Raises:
        ConfigError: ``settings.device`` is "cuda" and there is no CUDA device (before anything is
            loaded), or Megatron's model-parallel state is already initialised.
    """
    device.check_available(settings.device)
    with device.megatron_runtime(settings.device):
        # on the CPU, megatron.core imports only with the layer on (0.19 imports a triton-only module)
        from megatron.core import parallel_state

        from elastic_moe_plugin.mcore import megatron_core_version

        if parallel_state.model_parallel_is_initialized():
            raise ConfigError(
                "Megatron's model-parallel state is already initialised in this process; "
                "run the demo in a fresh process."
            )
        # the release only: megatron/core/package_info.py appends "+<short hash>" of whatever git
        # work tree holds it, so a venv inside a project checkout would show that project's commit
        version = megatron_core_version()
        mcore_version = version.public if version is not None else "unknown"
        results, states = {}, {}
        for name, elastic_config in runs.items():
            results[name], states[name] = train_run(name, elastic_config, settings, corpus, config)
    return results, states, mcore_version
