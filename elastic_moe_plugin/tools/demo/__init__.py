"""``elastic-moe demo``: train a tiny Megatron-core MoE GPT twice on CPU, static top-k and elastic.

What it does (``make demo`` runs it with the defaults):

1. Builds a corpus that needs no download: a fixed mixture of six synthetic "languages"
   (copy, reverse, addition, two Markov chains with different transition tables, modular
   counting), each with its own tag token and sub-vocabulary, so experts have something to
   specialise on. ``--data PATH`` uses a text file instead, as *byte-level* tokens (vocabulary
   256, no tokenizer). Train and held-out splits are fixed (the corpus seed does not depend on
   ``--seed``).
2. Builds a tiny ``GPTModel`` from the real megatron-core code (local spec, ``SequentialMLP``
   experts, allgather dispatcher, MoE in every layer: 4 layers, hidden 64, 16 experts, top-4,
   aux loss 1e-2) with the CPU compatibility layer (:mod:`elastic_moe_plugin.compat.megatron_cpu`)
   switched on explicitly.
3. Trains it twice on the same data, seed and token budget, through the patch layer users use on
   GPUs: ``mcore.patched(ElasticConfig(schedule="static"))`` (stock Megatron) and
   ``mcore.patched(ElasticConfig(schedule="2-6", sigma=1.5))``. Model-parallel state, the patch
   and Megatron's MoE metrics tracker are torn down between the runs.
4. Measures, per run: final training loss, held-out loss with static top-k routing, held-out
   loss for inference top-k' in k-2..k+2, the realised mean budget κ per layer, the observed
   exposure P(κ ≥ r) against the schedule's survival curve, tokens-per-expert imbalance, and wall
   time. Prints a table (``--json``: JSON) and writes ``summary.json``, three PNGs, both trained
   state dicts and ``model_config.json`` (see :func:`load_trained`) into ``--out``.

At this size elastic routing is not expected to beat static top-k: the paper's gains were measured
on 1B-30B-parameter models. The demo reports what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import random
import sys
import time
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch

from elastic_moe_plugin.compat import inference_topk, megatron_tracker
from elastic_moe_plugin.core.config import ConfigError, ElasticConfig
from elastic_moe_plugin.core.schedule import BudgetSchedule

# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------

#: the corpus seed: fixed, so every run (any --seed) sees the same train and held-out splits
CORPUS_SEED = 20_260_001
FORMAT = "elastic-moe-demo/1"
PAPER_NOTE = (
    "The paper's gains (+0.84 / +2.02 Avg(9) points in SFT of OLMoE-1B-7B / Qwen3-30B-A3B, "
    "+1.6 points in from-scratch pretraining) were measured at 1B-30B scale; at this toy size "
    "elastic routing is not expected to beat static top-k, and a single seed decides little."
)


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """Everything that defines a demo run (the defaults are ``make demo``)."""

    schedule: str = "2-6"
    sigma: float = 1.5
    layers: str | None = None
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_experts: int = 16
    topk: int = 4
    expert_ffn_hidden_size: int = 64
    aux_loss_coeff: float = 1e-2
    seq_len: int = 64
    batch_size: int = 32
    steps: int = 500
    lr: float = 3e-3
    seed: int = 0
    eval_points: int = 10
    heldout_sequences: int = 256
    data: str | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step


QUICK = dict(batch_size=16, steps=60, eval_points=3, heldout_sequences=128)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

SEP = 0
TASKS = ("copy", "reverse", "addition", "markov-a", "markov-b", "counting")
_TAG = {name: 1 + i for i, name in enumerate(TASKS)}  # tags 1..6; 7 unused
_LETTERS = range(8, 40)  # copy / reverse share 32 "letters"
_DIGITS = 40  # 0-9 -> 40..49, '+' 50, '=' 51
_PLUS, _EQUALS = 50, 51
_MARKOV_A = range(52, 84)
_MARKOV_B = range(84, 116)
_COUNT = range(116, 148)
SYNTHETIC_VOCAB = 148


def _markov_table(states: range, rng: random.Random, successors: int, concentration: float):
    """Each state -> ``successors`` random next states with random (cumulative) weights."""
    table = {}
    for state in states:
        nexts = rng.sample(list(states), successors)
        weights = [rng.gammavariate(concentration, 1.0) for _ in nexts]
        total = sum(weights)
        table[state] = (nexts, [w / total for w in weights])
    return table


class SyntheticLanguages:
    """A generator of the six-task mixture; one task per sequence, the tag token first."""

    def __init__(self, seed: int = CORPUS_SEED) -> None:
        tables = random.Random(seed)
        self.markov_a = _markov_table(_MARKOV_A, tables, successors=4, concentration=1.0)
        self.markov_b = _markov_table(_MARKOV_B, tables, successors=2, concentration=4.0)

    def _digits(self, value: int) -> list[int]:
        return [_DIGITS + int(d) for d in str(value)]

    def sequence(self, rng: random.Random, length: int) -> list[int]:
        task = TASKS[rng.randrange(len(TASKS))]
        tokens = [_TAG[task]]
        while len(tokens) < length:
            if task in ("copy", "reverse"):
                word = [rng.choice(_LETTERS) for _ in range(rng.randint(3, 10))]
                tokens += word + [SEP] + (word if task == "copy" else word[::-1]) + [SEP]
            elif task == "addition":
                a, b = rng.randrange(1000), rng.randrange(1000)
                tokens += self._digits(a) + [_PLUS] + self._digits(b) + [_EQUALS] + self._digits(a + b) + [SEP]
            elif task in ("markov-a", "markov-b"):
                table = self.markov_a if task == "markov-a" else self.markov_b
                state = rng.choice(list(table))
                for _ in range(length):
                    tokens.append(state)
                    nexts, weights = table[state]
                    state = rng.choices(nexts, weights)[0]
            else:  # counting: x, x+s, x+2s, ... mod 32
                start, step = rng.randrange(32), rng.randint(1, 7)
                tokens += [_COUNT[(start + i * step) % 32] for i in range(rng.randint(6, 12))] + [SEP]
        return tokens[:length]

    def sequences(self, seed: int, count: int, length: int) -> torch.Tensor:
        rng = random.Random(seed)
        return torch.tensor([self.sequence(rng, length) for _ in range(count)], dtype=torch.long)


@dataclasses.dataclass
class Corpus:
    """Fixed train and held-out splits of sequences of ``seq_len + 1`` tokens."""

    description: str
    vocab_size: int
    seq_len: int
    heldout: torch.Tensor  # [M, seq_len + 1]
    train: torch.Tensor | None = None  # [N, seq_len + 1] (synthetic)
    stream: torch.Tensor | None = None  # [L] byte stream (file); windows drawn at random

    def batches(self, steps: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
        """``steps`` batches [batch_size, seq_len + 1]; the order depends only on ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        if self.train is not None:
            order = torch.empty(0, dtype=torch.long)
            for _ in range(steps):
                if order.numel() < batch_size:
                    order = torch.cat([order, torch.randperm(self.train.shape[0], generator=generator)])
                yield self.train[order[:batch_size]]
                order = order[batch_size:]
        else:
            span = self.seq_len + 1
            for _ in range(steps):
                starts = torch.randint(0, self.stream.numel() - span + 1, (batch_size,), generator=generator)
                yield torch.stack([self.stream[s : s + span] for s in starts.tolist()])

    def to_dict(self) -> dict[str, Any]:
        info = {"description": self.description, "vocab_size": self.vocab_size, "seq_len": self.seq_len,
                "heldout_sequences": int(self.heldout.shape[0])}
        if self.train is not None:
            info["train_sequences"] = int(self.train.shape[0])
        else:
            info["train_bytes"] = int(self.stream.numel())
        return info


def synthetic_corpus(settings: DemoSettings) -> Corpus:
    """The six-task mixture. The train split holds what the budget reads (at most 32768
    sequences, then epochs); a shorter run's split is a prefix of a longer one's."""
    languages = SyntheticLanguages(CORPUS_SEED)
    span = settings.seq_len + 1
    train_count = min(settings.steps * settings.batch_size, 32768)
    return Corpus(
        description=f"synthetic mixture of {len(TASKS)} tasks ({', '.join(TASKS)}), one per sequence, "
        f"tag token first; corpus seed {CORPUS_SEED}",
        vocab_size=SYNTHETIC_VOCAB,
        seq_len=settings.seq_len,
        heldout=languages.sequences(CORPUS_SEED + 1, settings.heldout_sequences, span),
        train=languages.sequences(CORPUS_SEED + 2, train_count, span),
    )


def file_corpus(path: str, settings: DemoSettings) -> Corpus:
    """A user's file as byte-level tokens (vocabulary 256). The last 10% of the bytes is held out
    as non-overlapping windows; training windows start at random offsets in the first 90%."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--data {path!r}: no such file.")
    data = torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8).long()
    span = settings.seq_len + 1
    split = int(data.numel() * 0.9)
    if split < 4 * span or data.numel() - split < span:
        raise ConfigError(
            f"--data {path!r} has {data.numel()} bytes: expected at least {10 * span} "
            f"(the held-out last 10% must hold one window of {span} bytes)."
        )
    heldout = data[split:]
    count = min(settings.heldout_sequences, heldout.numel() // span)
    return Corpus(
        description=f"{file.name}: {data.numel()} bytes as byte-level tokens (vocab 256); first 90% train "
        f"(random windows), last 10% held out ({count} windows)",
        vocab_size=256,
        seq_len=settings.seq_len,
        heldout=heldout[: count * span].view(count, span).clone(),
        stream=data[:split].clone(),
    )


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def model_config(settings: DemoSettings, vocab_size: int) -> dict[str, Any]:
    """The JSON-able description ``model_config.json`` stores and :func:`build_model` reads."""
    return {
        "transformer_config": dict(
            num_layers=settings.num_layers,
            hidden_size=settings.hidden_size,
            num_attention_heads=settings.num_attention_heads,
            ffn_hidden_size=settings.expert_ffn_hidden_size,
            moe_ffn_hidden_size=settings.expert_ffn_hidden_size,
            num_moe_experts=settings.num_experts,
            moe_router_topk=settings.topk,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=settings.aux_loss_coeff,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            add_bias_linear=False,
            use_cpu_initialization=True,
        ),
        "gpt_model": dict(vocab_size=vocab_size, max_sequence_length=settings.seq_len),
        "layer_spec": {"function": "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec",
                       "kwargs": {"num_experts": settings.num_experts, "moe_grouped_gemm": False}},
    }


def build_model(config: dict[str, Any]):
    """A fresh ``GPTModel`` from :func:`model_config`'s dict. Needs Megatron's model-parallel
    state (on CPU: ``megatron_cpu.enable(); megatron_cpu.initialize_model_parallel()``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = get_gpt_layer_local_spec(**config["layer_spec"]["kwargs"])
    return GPTModel(config=TransformerConfig(**config["transformer_config"]), transformer_layer_spec=spec,
                    **config["gpt_model"])


def load_trained(out_dir: str | os.PathLike[str], run: str = "elastic"):
    """Rebuild the demo's ``run`` model ("static" or "elastic") from ``out_dir`` and load its weights.

    Returns ``(model, model_config_dict)``; the model is in eval mode (static top-k routing, as
    deployed). Needs Megatron's model-parallel state (see :func:`build_model`).
    """
    out = Path(out_dir)
    config = json.loads((out / "model_config.json").read_text())
    model = build_model(config)
    state = torch.load(out / config["runs"][run]["checkpoint"], map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model.eval(), config


def causal_mask(seq_len: int) -> torch.Tensor:
    """[1, 1, S, S] bool, True = masked (GPTModel's default mask is built on device="cuda")."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def _routers(model) -> dict[int, Any]:
    """{0-based layer index: TopKRouter}."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {int(m.layer_number) - 1: m for m in model.modules() if isinstance(m, TopKRouter)}


# --------------------------------------------------------------------------------------------
# Routing statistics from the routers' outputs (both runs, every layer)
# --------------------------------------------------------------------------------------------


class RoutingStats:
    """Forward hooks on every router: κ (row sums of the routing map) and tokens per expert.

    Training forwards fill ``kappa`` (whole run) and ``expert_counts`` (from ``window_start``
    on); eval forwards fill ``eval_expert_counts`` while ``eval_on`` is set.
    """

    def __init__(self, model, num_experts: int) -> None:
        self.num_experts = num_experts
        self.kappa: dict[int, torch.Tensor] = {}
        self.expert_counts: dict[int, torch.Tensor] = {}
        self.eval_expert_counts: dict[int, torch.Tensor] = {}
        self.count_experts = False
        self.eval_on = False
        self.handles = [router.register_forward_hook(self._hook(layer)) for layer, router in _routers(model).items()]

    def _hook(self, layer: int):
        def hook(module, inputs, output) -> None:
            routing_map = output[1].detach()
            if module.training:
                kappa = routing_map.sum(dim=-1).long()
                counts = torch.bincount(kappa, minlength=self.num_experts + 1)
                self.kappa[layer] = self.kappa.get(layer, 0) + counts
                if self.count_experts:
                    self.expert_counts[layer] = self.expert_counts.get(layer, 0) + routing_map.sum(dim=0).long()
            elif self.eval_on:
                self.eval_expert_counts[layer] = self.eval_expert_counts.get(layer, 0) + routing_map.sum(dim=0).long()

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _imbalance(counts: torch.Tensor) -> float:
    counts = counts.double()
    return float(counts.max() / counts.mean()) if counts.sum() > 0 else float("nan")


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr: live on a TTY, only the final line otherwise."""

    def __init__(self, label: str, total: int, stream=None, width: int = 24) -> None:
        self.label, self.total, self.width = label, total, width
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.last_draw = 0.0

    def _line(self, step: int, tokens: int, loss: float) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        filled = int(self.width * step / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        return (f"{self.label:>8} [{bar}] {step}/{self.total} steps  {tokens / elapsed:,.0f} tok/s  "
                f"loss {loss:.3f}  {elapsed:.0f}s")

    def update(self, step: int, tokens: int, loss: float) -> None:
        now = time.perf_counter()
        if self.live and (now - self.last_draw > 0.1 or step == self.total):
            self.last_draw = now
            self.stream.write("\r" + self._line(step, tokens, loss) + "\033[K")
            self.stream.flush()

    def close(self, step: int, tokens: int, loss: float) -> None:
        line = self._line(step, tokens, loss)
        self.stream.write(("\r" + line + "\033[K\n") if self.live else line + "\n")
        self.stream.flush()


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


def _lr_at(step: int, settings: DemoSettings) -> float:
    warmup = max(1, settings.steps // 20)
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, heldout: torch.Tensor, batch_size: int = 64) -> float:
    """Mean per-token held-out loss in eval mode (static routing at the routers' current top-k)."""
    was_training = model.training
    model.eval()
    seq_len = heldout.shape[1] - 1
    mask = causal_mask(seq_len)
    total, count = 0.0, 0
    try:
        for start in range(0, heldout.shape[0], batch_size):
            batch = heldout[start : start + batch_size]
            positions = torch.arange(seq_len).expand(batch.shape[0], seq_len)
            loss = model(batch[:, :-1], positions, mask, labels=batch[:, 1:])
            total += float(loss.double().sum())
            count += loss.numel()
    finally:
        model.train(was_training)
    return total / count


def _exposure(histogram: torch.Tensor, ranks: int) -> list[float]:
    """Observed P(κ >= r) for r = 1..ranks from a κ histogram indexed by budget."""
    hist = histogram.double()
    total = float(hist.sum())
    return [float(hist[r:].sum()) / total if total else float("nan") for r in range(1, ranks + 1)]


def train_run(name: str, elastic: ElasticConfig, settings: DemoSettings, corpus: Corpus,
              config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train one model from scratch; returns (measurements, state dict)."""
    from elastic_moe_plugin import mcore
    from elastic_moe_plugin.compat import megatron_cpu

    run_start = time.perf_counter()
    megatron_cpu.initialize_model_parallel(seed=settings.seed)
    megatron_tracker.reset()
    try:
        with mcore.patched(elastic):
            torch.manual_seed(settings.seed)
            model = build_model(config)
            model.train()
            schedule = elastic.budget_schedule(settings.topk)
            elastic_layers = sorted(layer for layer in range(settings.num_layers)
                                    if not schedule.is_static and elastic.layer_is_elastic(layer))
            stats = RoutingStats(model, settings.num_experts)
            optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01)
            mask = causal_mask(settings.seq_len)
            positions = torch.arange(settings.seq_len).expand(settings.batch_size, settings.seq_len)
            eval_every = max(1, settings.steps // max(1, settings.eval_points))
            window_start = settings.steps - max(1, settings.steps // 4)
            history = {"step": [], "loss": [], "eval_step": [], "eval_loss": []}
            progress = Progress(name, settings.steps)
            train_start = time.perf_counter()
            eval_time = 0.0
            loss_value = float("nan")
            for step, batch in enumerate(corpus.batches(settings.steps, settings.batch_size, settings.seed)):
                stats.count_experts = step >= window_start
                for group in optimizer.param_groups:
                    group["lr"] = _lr_at(step, settings)
                optimizer.zero_grad(set_to_none=True)
                loss = model(batch[:, :-1], positions, mask, labels=batch[:, 1:]).mean()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                loss_value = float(loss.detach())
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

            # Realised κ: Megatron-side budget histograms for elastic layers, routing maps otherwise.
            histograms = {layer: h.detach().clone() for layer, h in mcore.budget_histograms(model).items()}
            high = max(schedule.high, settings.topk)
            ranks = high + 1
            kappa, exposure = {}, {}
            for layer in range(settings.num_layers):
                from_maps = stats.kappa[layer]
                agrees = None
                if layer in histograms:
                    hist, source = histograms[layer], "budget_histograms"
                    # cross-check: no capacity factor, so the routing map's rows hold exactly κ
                    padded = torch.zeros_like(from_maps)
                    padded[: hist.numel()] = hist
                    agrees = torch.equal(padded, from_maps)
                    if not agrees:
                        print(f"elastic-moe demo: warning: {name} run, layer {layer}: mcore.budget_histograms "
                              f"disagrees with the routing maps' row sums", file=sys.stderr)
                else:
                    hist, source = from_maps, "routing_maps"
                support = hist.nonzero().flatten()
                total = float(hist.sum())
                mean = float((hist.double() * torch.arange(hist.numel(), dtype=torch.double)).sum()) / total
                layer_schedule = schedule if layer in elastic_layers else BudgetSchedule.static(settings.topk)
                kappa[str(layer)] = {
                    "mean": mean, "min": int(support.min()), "max": int(support.max()), "elastic": layer in elastic_layers,
                    "source": source, "tokens": int(total), "histogram_matches_routing_maps": agrees,
                    "histogram": {str(r): int(hist[r]) for r in range(hist.numel()) if hist[r] > 0},
                }
                exposure[str(layer)] = {"observed": _exposure(hist, ranks), "schedule": list(layer_schedule.exposure(ranks))}
            aux = megatron_tracker.values("load_balancing_loss")
            aux_per_layer = {str(i): float(v) / settings.steps for i, v in enumerate(aux.tolist())} if aux is not None else {}

            # Held-out, static routing: the deployed top-k and the sweep k-2..k+2.
            tick = time.perf_counter()
            sweep = {}
            for k in range(max(1, settings.topk - 2), min(settings.num_experts, settings.topk + 2) + 1):
                with inference_topk.megatron(model, k):
                    stats.eval_on = k == settings.topk
                    sweep[str(k)] = evaluate(model, corpus.heldout)
                    stats.eval_on = False
            eval_time += time.perf_counter() - tick
            stats.remove()
            tail = history["loss"][-max(1, settings.steps // 10):]
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
                "kappa": kappa,
                "exposure": exposure,
                "imbalance": {
                    "train": {str(layer): _imbalance(c) for layer, c in sorted(stats.expert_counts.items())},
                    "train_window_steps": settings.steps - window_start,
                    "heldout": {str(layer): _imbalance(c) for layer, c in sorted(stats.eval_expert_counts.items())},
                },
                "aux_loss": aux_per_layer,
                "train_time_s": train_time,
                "eval_time_s": eval_time,
                "tokens_per_s": settings.tokens / train_time,
                "history": history,
            }
            state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
            del model, optimizer
    finally:
        megatron_tracker.reset()
        megatron_cpu.destroy()
    result["wall_time_s"] = time.perf_counter() - run_start
    return result, state


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def format_table(summary: dict[str, Any]) -> str:
    s, runs = summary["settings"], summary["runs"]
    static, elastic = runs["static"], runs["elastic"]
    k = s["topk"]
    col = 17
    head = f"elastic {elastic['schedule']}" if elastic["schedule"] != "static" else "elastic (static)"

    def row(label: str, a: str, b: str) -> str:
        return f"  {label:<40}{a:>{col}}{b:>{col}}"

    def num(x: float, fmt: str = ".4f") -> str:
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    layers = range(s["num_layers"])
    elastic_layers = elastic["elastic_layers"]
    lines = [
        f"elastic-moe demo: tiny Megatron-core MoE GPT on CPU (megatron-core {summary['versions']['megatron_core']}, "
        f"torch {summary['versions']['torch']})",
        f"  model   {s['num_layers']} layers, hidden {s['hidden_size']}, {s['num_experts']} experts "
        f"(ffn {s['expert_ffn_hidden_size']}), top-{k}, MoE in every layer, allgather dispatcher, "
        f"aux loss {s['aux_loss_coeff']:g}, {summary['parameters']:,} parameters",
        f"  data    {summary['data']['description']}",
        f"  budget  {s['tokens']:,} tokens per run ({s['steps']} steps x {s['batch_size']} x {s['seq_len']}), "
        f"seed {s['seed']}, AdamW lr {s['lr']:g}, {summary['torch_threads']} torch thread(s)",
        f"  elastic schedule {elastic['schedule']} around k={k} (sigma={s['sigma']:g}), elastic layers "
        f"{', '.join(map(str, elastic_layers)) if elastic_layers else 'none'}; inference is static top-{k} in both runs",
        "",
        row("", "static", head),
        row(f"final train loss (last {static['final_train_loss_steps']} steps)",
            num(static["final_train_loss"]), num(elastic["final_train_loss"])),
        row(f"held-out loss (static top-{k})", num(static["heldout_loss"]), num(elastic["heldout_loss"])),
        "  held-out loss, inference top-k' sweep:",
    ]
    for kk in static["topk_sweep"]:
        mark = "  <- trained k" if int(kk) == k else ""
        lines.append(row(f"    top-{kk}", num(static["topk_sweep"][kk]), num(elastic["topk_sweep"][kk])) + mark)
    lines.append("  realised mean κ per layer (training):")
    for layer in layers:
        st, el = static["kappa"][str(layer)], elastic["kappa"][str(layer)]
        tag = "elastic" if el["elastic"] else "static"
        lines.append(row(f"    layer {layer} ({tag})", num(st["mean"]), num(el["mean"])))
    ranks = len(elastic["exposure"]["0"]["observed"])
    if elastic_layers:
        lines.append("  exposure P(κ ≥ r), elastic run, mean over elastic layers vs the schedule's survival:")
        lines.append(f"  {'    rank r':<40}{'observed':>{col}}{'schedule':>{col}}{'static step':>{col}}")
        for r in range(1, ranks + 1):
            observed = _mean(elastic["exposure"][str(layer)]["observed"][r - 1] for layer in elastic_layers)
            expected = elastic["exposure"][str(elastic_layers[0])]["schedule"][r - 1]
            lines.append(f"  {'    ' + str(r):<40}{observed:>{col}.4f}{expected:>{col}.4f}{float(r <= k):>{col}.0f}")
    lines.append(f"  tokens-per-expert imbalance max/mean (training, last {static['imbalance']['train_window_steps']} steps):")
    for layer in layers:
        lines.append(row(f"    layer {layer}", num(static["imbalance"]["train"][str(layer)], ".2f"),
                         num(elastic["imbalance"]["train"][str(layer)], ".2f")))
    lines.append(row(f"    held-out, top-{k}, mean over layers", num(_mean(static["imbalance"]["heldout"].values()), ".2f"),
                     num(_mean(elastic["imbalance"]["heldout"].values()), ".2f")))
    lines.append(row("load-balancing loss (mean/layer)", num(_mean(static["aux_loss"].values())),
                     num(_mean(elastic["aux_loss"].values()))))
    lines.append(row("train throughput (tokens/s)", num(static["tokens_per_s"], ",.0f"), num(elastic["tokens_per_s"], ",.0f")))
    lines.append(row("wall time (s)", num(static["wall_time_s"], ".1f"), num(elastic["wall_time_s"], ".1f")))
    delta = elastic["heldout_loss"] - static["heldout_loss"]
    lines += [
        "",
        f"  measured: held-out loss at top-{k}, elastic - static = {delta:+.4f} "
        f"({'elastic lower' if delta < 0 else 'static lower' if delta > 0 else 'equal'}), seed {s['seed']}, "
        f"total wall time {summary['wall_time_s']:.1f} s.",
        "  Training losses are under each run's own training routing (elastic: sampled κ); every held-out "
        "loss uses static routing.",
        "  " + PAPER_NOTE,
        f"  files: {summary['out_dir']}/ ({', '.join(summary['files'])})",
    ]
    return "\n".join(lines)


def _plots(summary: dict[str, Any], out: Path, schedule: BudgetSchedule) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, s = summary["runs"], summary["settings"]
    colors = {"static": "#4C72B0", "elastic": "#DD8452"}
    labels = {"static": f"static top-{s['topk']}", "elastic": f"elastic {runs['elastic']['schedule']}"}
    written = []

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4))
    smoothed = {}
    for name, run in runs.items():
        steps, losses = run["history"]["step"], run["history"]["loss"]
        window = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
                  for i in range(len(losses))]
        smoothed[name] = smooth
        tokens = [step * s["batch_size"] * s["seq_len"] for step in steps]
        eval_tokens = [step * s["batch_size"] * s["seq_len"] for step in run["history"]["eval_step"]]
        for axis in (ax, zoom):
            axis.plot(tokens, smooth, color=colors[name], alpha=0.6, label=f"{labels[name]} train (moving avg {window})")
            axis.plot(eval_tokens, run["history"]["eval_loss"], "o--", color=colors[name], label=f"{labels[name]} held-out")
    for axis in (ax, zoom):
        axis.set_xlabel("training tokens")
        axis.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss curves (seed {s['seed']})")
    ax.legend(frameon=False, fontsize=8)
    # right: the second half of training, where the two runs separate (if at all)
    half = s["steps"] * s["batch_size"] * s["seq_len"] / 2
    tail = [v for run in runs.values() for step, v in zip(run["history"]["eval_step"], run["history"]["eval_loss"])
            if step * s["batch_size"] * s["seq_len"] >= half]
    tail += [v for name, run in runs.items() for step, v in zip(run["history"]["step"], smoothed[name])
             if step * s["batch_size"] * s["seq_len"] >= half]
    if tail:
        spread = max(tail) - min(tail)
        zoom.set_xlim(half, s["steps"] * s["batch_size"] * s["seq_len"] * 1.02)
        zoom.set_ylim(min(tail) - 0.05 * spread, max(tail) + 0.05 * spread)
    zoom.set_title("second half, zoomed")
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)
    plt.close(fig)
    written.append("loss_curves.png")

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, run in runs.items():
        ks = [int(k) for k in run["topk_sweep"]]
        ax.plot(ks, list(run["topk_sweep"].values()), "o-", color=colors[name], label=labels[name])
    ax.axvline(s["topk"], color="gray", linestyle=":", label=f"trained k={s['topk']}")
    ax.set_xticks([int(k) for k in runs["static"]["topk_sweep"]])
    ax.set_xlabel("inference top-k'")
    ax.set_ylabel("held-out loss")
    ax.set_title("inference top-k sweep (static routing)")
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(out / "topk_sweep.png", dpi=110)
    plt.close(fig)
    written.append("topk_sweep.png")

    elastic = runs["elastic"]
    layers = elastic["elastic_layers"] or list(range(s["num_layers"]))
    budgets = list(range(max(1, schedule.low - 1), schedule.high + 2))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / len(layers)
    for i, layer in enumerate(layers):
        entry = elastic["kappa"][str(layer)]
        total = entry["tokens"]
        freq = [entry["histogram"].get(str(r), 0) / total for r in budgets]
        ax.bar([r - 0.4 + width * (i + 0.5) for r in budgets], freq, width=width, alpha=0.8, label=f"layer {layer}")
    ax.plot(budgets, [schedule.probability(r) for r in budgets], "k_", markersize=22, mew=2,
            label=f"pmf {schedule.describe()}")
    ax.set_xticks(budgets)
    ax.set_xlabel("budget κ")
    ax.set_ylabel("share of training tokens")
    ax.set_title("realised κ (elastic run) vs the schedule")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "kappa_histogram.png", dpi=110)
    plt.close(fig)
    written.append("kappa_histogram.png")
    return written


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser) -> None:
    defaults = DemoSettings()
    parser.add_argument("--schedule", default=defaults.schedule,
                        help=f"elastic run's schedule around top-{defaults.topk} (default: {defaults.schedule})")
    parser.add_argument("--sigma", type=float, default=defaults.sigma, help="schedule width (default: 1.5)")
    parser.add_argument("--layers", default=None,
                        help="0-based layers that route elastically, e.g. '1-2' (default: all)")
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers,
                        help=f"decoder layers, each an MoE layer (default: {defaults.num_layers})")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None,
                        help=f"training steps per run (default: {defaults.steps}; --quick: {QUICK['steps']})")
    budget.add_argument("--tokens", type=int, default=None, help="training tokens per run (rounded to whole steps)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="init, batch order and κ draws (default: 0)")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="train on a text file as byte-level tokens (vocab 256) instead of the synthetic mixture")
    parser.add_argument("--out", default="demo_out", help="output folder (default: demo_out/)")
    parser.add_argument("--quick", action="store_true", help="a run of under a minute (smaller batch, fewer steps)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1; the model is so small that 2 threads gain ~25%% on an "
                        "idle machine but run several times slower when other processes share the cores)")
    parser.add_argument("--verbose", action="store_true", help="keep Megatron's warnings and log messages")


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    values: dict[str, Any] = dict(schedule=args.schedule, sigma=args.sigma, layers=args.layers,
                                  num_layers=args.num_layers, seed=args.seed, data=args.data)
    if args.quick:
        values.update(QUICK)
    settings = DemoSettings(**values)
    if args.steps is not None:
        if args.steps < 1:
            raise ConfigError(f"--steps={args.steps} is invalid: expected at least 1.")
        settings = dataclasses.replace(settings, steps=args.steps)
    elif args.tokens is not None:
        if args.tokens < 1:
            raise ConfigError(f"--tokens={args.tokens} is invalid: expected a positive number of tokens.")
        settings = dataclasses.replace(settings, steps=max(1, round(args.tokens / settings.tokens_per_step)))
    if settings.num_layers < 1:
        raise ConfigError(f"--num-layers={settings.num_layers} is invalid: expected at least 1.")
    return settings


@contextlib.contextmanager
def _quiet_megatron(verbose: bool) -> Iterator[None]:
    """Hide Megatron's import-time "TE/Apex not installed" warnings and deprecation log lines."""
    if verbose:
        yield
        return
    logger = logging.getLogger("megatron")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|absl).*")
        try:
            yield
        finally:
            logger.setLevel(level)


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    # Validate the schedule against the demo model before building anything.
    elastic = ElasticConfig(schedule=settings.schedule, sigma=settings.sigma, layers=settings.layers)
    schedule = elastic.resolve(num_experts=settings.num_experts, topk=settings.topk, num_layers=settings.num_layers)
    static = ElasticConfig(schedule="static")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    start = time.perf_counter()
    corpus = file_corpus(settings.data, settings) if settings.data else synthetic_corpus(settings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads={args.threads} is invalid: expected at least 1.")
    torch.set_num_threads(args.threads if args.threads is not None else 1)
    try:
        return _run(args, settings, corpus, elastic, schedule, static, out, start)
    finally:
        torch.set_num_threads(threads)


def _run(args, settings: DemoSettings, corpus: Corpus, elastic: ElasticConfig, schedule: BudgetSchedule, static: ElasticConfig,
         out: Path, start: float) -> int:
    with _quiet_megatron(args.verbose):
        from elastic_moe_plugin.compat import megatron_cpu

        megatron_cpu.disable_torch_compile()
        cuda = torch.cuda.is_available()
        if cuda:
            print("elastic-moe demo: CUDA is available, but this demo runs on the CPU by design.", file=sys.stderr)
        with megatron_cpu.enabled(force=cuda):
            # megatron.core imports only with the layer on (0.19 imports a triton-only module)
            from megatron.core import parallel_state

            from elastic_moe_plugin.mcore import megatron_core_version

            if parallel_state.model_parallel_is_initialized():
                raise ConfigError("Megatron's model-parallel state is already initialised in this process; "
                                  "run the demo in a fresh process.")
            mcore_version = str(megatron_core_version())
            config = model_config(settings, corpus.vocab_size)
            results, states = {}, {}
            for name, elastic_config in (("static", static), ("elastic", elastic)):
                results[name], states[name] = train_run(name, elastic_config, settings, corpus, config)

    files = ["summary.json", "model_config.json", "static.pt", "elastic.pt"]
    for name, state in states.items():
        torch.save(state, out / f"{name}.pt")
    config_file = dict(config)
    config_file.update(
        format=FORMAT,
        seq_len=settings.seq_len,
        data=corpus.to_dict(),
        seed=settings.seed,
        megatron_core=mcore_version,
        runs={name: {"checkpoint": f"{name}.pt", "elastic_config": results[name]["elastic_config"]} for name in results},
        how_to_load="elastic_moe_plugin.tools.demo.load_trained(out_dir, 'static' | 'elastic') after "
        "megatron_cpu.enable(); megatron_cpu.initialize_model_parallel()",
    )
    (out / "model_config.json").write_text(json.dumps(config_file, indent=2))
    parameters = sum(v.numel() for v in states["static"].values())
    summary = {
        "format": FORMAT,
        "settings": dataclasses.asdict(settings) | {"tokens": settings.tokens},
        "versions": {"megatron_core": mcore_version, "torch": torch.__version__,
                     "python": platform.python_version()},
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "parameters": parameters,
        "data": corpus.to_dict(),
        "schedule": {"spec": schedule.spec(), "center": schedule.center, "sigma": schedule.sigma,
                     "budgets": list(schedule.budgets), "pmf": list(schedule.pmf),
                     "survival": list(schedule.exposure(max(schedule.high, settings.topk) + 1))},
        "runs": results,
        "heldout_delta_elastic_minus_static": results["elastic"]["heldout_loss"] - results["static"]["heldout_loss"],
        "note": PAPER_NOTE,
        "out_dir": str(out),
    }
    try:
        files += _plots(summary, out, schedule)
    except ImportError:
        print("elastic-moe demo: matplotlib is not installed, skipping the PNGs "
              "(pip install 'elastic-moe-plugin[plot]').", file=sys.stderr)
    summary["files"] = files
    summary["wall_time_s"] = time.perf_counter() - start
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    return 0
