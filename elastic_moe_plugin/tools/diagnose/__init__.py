"""``elastic-moe diagnose``: offline routing diagnostics of trained MoE checkpoints (paper §4.5-4.6).

Three subcommands::

    elastic-moe diagnose compare STATIC ELASTIC --probe probe.pt [--probe more.txt ...] --out diag/
    elastic-moe diagnose swap --router-from ELASTIC --into STATIC --out swapped/ [--layers 3-7]
    elastic-moe diagnose kappa routing_metrics.json --out diag/

``compare`` streams a probe set (token ids, teacher-forced, identical inputs for every model)
through one or more checkpoints and measures, per MoE layer and model pair:

- **router divergence** (paper §6.1, Figure 2): the Jensen-Shannon divergence between the two
  routers' per-token expert distributions p = softmax(z) over all E experts,
  JS(p‖q) = ½ KL(p‖m) + ½ KL(q‖m), m = ½(p + q), averaged over tokens, then over probe files
  ("tasks"), split into *boundary* layers (the first and last ``--boundary`` MoE layers; the
  paper excludes L0 and L15 of 16) and *non-boundary* layers, with the contiguous non-boundary
  block of ``--block-width`` layers of largest mean divergence (the paper's L3-L7);
- **D1 and Dk** (Eq. 11-12, Figure 3): D1 = (1/(L·T)) Σ_ℓ Σ_t 1[e^A_{ℓ,t} ≠ e^B_{ℓ,t}] (top-1
  experts) and Dk = (1/(L·T)) Σ_ℓ Σ_t (1 − |S^A_{ℓ,t} ∩ S^B_{ℓ,t}| / k) (top-k sets, k the
  deployment top-k); k·Dk is the mean number of experts that differ between the two top-k sets;
- **expert prioritisation near the cutoff** (§6.2's reading "D1 > Dk: elastic training reorders
  experts inside a largely shared top-k set"), made numeric: the ratio D1/Dk; the share of
  top-1 changes that are reorders inside the shared set (each model's top-1 lies in the other's
  top-k); rank retention ρ(j) = P(π^A(j) ∈ S^B), symmetrised over A↔B, for ranks j = 1..k+2;
  and the near-cutoff share Σ_{j=k−w+1..k}(1 − ρ(j)) / Σ_{j≤k}(1 − ρ(j)) of the set changes that
  involve the last w deployed ranks (the denominator is k·Dk);
- **an inference top-k sweep** (§6.3, Figure 4): next-token loss and perplexity of every model
  on the probe set with static top-k' routing for each k' in ``--topk-sweep`` (inference only).

It writes ``diagnostics.json``, CSVs (``divergence_by_layer.csv``, ``pairs.csv``,
``topk_sweep.csv``, ``kappa.csv``) and PNGs (``divergence_by_layer.png``, ``disagreement.png``,
``topk_sweep.png``, ``kappa_histogram.png``) into ``--out``.

Checkpoints (``[LABEL=]PATH``):

- a transformers folder (``config.json``), loaded with ``AutoModelForCausalLM``; the routers are
  those of the families :mod:`elastic_moe_plugin.hf` covers (``mlp.gate`` returning
  ``(router_logits, weights, indices)``); the sweep uses
  :func:`elastic_moe_plugin.compat.inference_topk.transformers`;
- a CPU-demo output folder (``model_config.json`` of ``elastic-moe demo``): every run in it, or
  one run with ``DIR:RUN`` or ``DIR/RUN.pt``. Megatron checkpoints are *loaded with Megatron on
  the CPU* (:func:`elastic_moe_plugin.tools.demo.load_trained` under
  :mod:`elastic_moe_plugin.compat.megatron_cpu`), not converted; the sweep sets
  ``router.topk``, the dispatcher's ``router_topk`` and ``config.moe_router_topk`` for the
  duration of the pass.

Memory: the probe set streams in batches; per batch every model holds its router distributions
[B·S, E] for each MoE layer plus its logits [B, S, V]; across batches only per-layer sums and
counts are kept (O(pairs · layers · (k + 2)) numbers), never per-token router outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from elastic_moe_plugin.compat import inference_topk
from elastic_moe_plugin.core.config import ConfigError, parse_layers

FORMAT = "elastic-moe-diagnostics/1"
DEMO_FORMAT_PREFIX = "elastic-moe-demo/"
#: default inference top-k sweep: k-2 .. k+2 of the models' deployment top-k (clipped to 1..E)
SWEEP_HALF_WIDTH = 2
#: ranks past the cutoff kept in the rank-retention curve
RETENTION_EXTRA_RANKS = 2
PROBE_SUFFIXES = (".pt", ".pth", ".npy", ".json", ".jsonl", ".txt")


class DiagnosticsError(ValueError):
    """A bad input to ``elastic-moe diagnose`` (the CLI prints it and exits with status 2)."""


# ================================================================================== probe sets
@dataclasses.dataclass
class ProbeTask:
    """One probe file: ``sequences`` are 1-D LongTensors of token ids (any lengths ≥ 2)."""

    name: str
    path: str
    sequences: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.sequences)


def _as_sequences(data: Any, where: str) -> list[torch.Tensor]:
    """Ints, a list of int lists, a 1-D/2-D int tensor/array, or a dict holding one of these."""
    if isinstance(data, dict):
        for key in ("input_ids", "tokens", "ids"):
            if key in data:
                return _as_sequences(data[key], where)
        raise DiagnosticsError(f"probe file {where}: a dict needs an 'input_ids' (or 'tokens') entry.")
    try:
        import numpy as np

        if isinstance(data, np.ndarray):
            data = torch.from_numpy(data)
    except ImportError:  # pragma: no cover - numpy ships with torch
        pass
    if isinstance(data, torch.Tensor):
        if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
            raise DiagnosticsError(f"probe file {where}: expected integer token ids, found dtype {data.dtype}.")
        if data.dim() == 1:
            return [data.long()]
        if data.dim() == 2:
            return [row.long() for row in data]
        raise DiagnosticsError(f"probe file {where}: expected a 1-D or 2-D array of token ids, got shape "
                               f"{tuple(data.shape)}.")
    if isinstance(data, (list, tuple)):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in data):
            return [torch.tensor(data, dtype=torch.long)]
        sequences = []
        for i, row in enumerate(data):
            if isinstance(row, dict):
                sequences += _as_sequences(row, f"{where}[{i}]")
            elif isinstance(row, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in row):
                sequences.append(torch.tensor(row, dtype=torch.long))
            else:
                raise DiagnosticsError(f"probe file {where}: item {i} is not a list of integer token ids.")
        return sequences
    raise DiagnosticsError(f"probe file {where}: cannot read token ids from a {type(data).__name__}.")


def load_probe(path: str | os.PathLike[str], *, tokenizer: Any = None, name: str | None = None) -> ProbeTask:
    """Read one probe file.

    Formats: ``.pt``/``.pth`` (a tensor, a list of lists, or a dict with ``input_ids``), ``.npy``,
    ``.json`` (the same as lists), ``.jsonl`` (one list or ``{"input_ids": [...]}`` per line),
    ``.txt`` of whitespace-separated integers (one sequence per line). With ``tokenizer`` (a
    transformers tokenizer) a ``.txt``/``.jsonl`` file is text instead: one instance per non-empty
    line (``.jsonl``: its ``"text"`` field), tokenised without special tokens added.

    Raises:
        DiagnosticsError: missing file, unknown suffix, non-integer content, fewer than 2 tokens.
    """
    file = Path(path)
    if not file.is_file():
        raise DiagnosticsError(f"probe file {str(path)!r} does not exist.")
    suffix = file.suffix.lower()
    if suffix not in PROBE_SUFFIXES:
        raise DiagnosticsError(f"probe file {str(path)!r}: unknown format {suffix!r}; expected one of "
                               f"{', '.join(PROBE_SUFFIXES)}.")
    where = str(path)
    if tokenizer is not None and suffix in (".txt", ".jsonl"):
        lines = file.read_text(encoding="utf-8").splitlines()
        texts = [json.loads(line)["text"] if suffix == ".jsonl" else line for line in lines if line.strip()]
        sequences = [torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
                     for text in texts]
    elif suffix in (".pt", ".pth"):
        try:
            data = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unpickling failure is a bad input here
            raise DiagnosticsError(f"probe file {where}: cannot be read by torch.load ({error}).") from None
        sequences = _as_sequences(data, where)
    elif suffix == ".npy":
        import numpy as np

        try:
            data = np.load(file, allow_pickle=False)
        except ValueError as error:
            raise DiagnosticsError(f"probe file {where}: {error}") from None
        sequences = _as_sequences(data, where)
    elif suffix == ".json":
        sequences = _as_sequences(json.loads(file.read_text(encoding="utf-8")), where)
    elif suffix == ".jsonl":
        rows = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        sequences = _as_sequences(rows, where)
    else:  # .txt of integers
        sequences = []
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                sequences.append(torch.tensor([int(x) for x in line.split()], dtype=torch.long))
            except ValueError:
                raise DiagnosticsError(
                    f"probe file {where}, line {number}: not whitespace-separated integer token ids; for a text "
                    f"file pass --tokenizer NAME_OR_PATH."
                ) from None
    sequences = [s for s in sequences if s.numel() >= 2]
    if not sequences:
        raise DiagnosticsError(f"probe file {where} holds no sequence of at least 2 tokens.")
    return ProbeTask(name=name or file.stem, path=where, sequences=sequences)


def chunk_sequences(sequences: Sequence[torch.Tensor], seq_len: int) -> list[torch.Tensor]:
    """Split every sequence into consecutive windows of at most ``seq_len`` tokens (≥ 2 kept)."""
    windows = []
    for sequence in sequences:
        for start in range(0, sequence.numel(), seq_len):
            window = sequence[start:start + seq_len]
            if window.numel() >= 2:
                windows.append(window)
    return windows


def probe_batches(sequences: Sequence[torch.Tensor], batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded batches: ids [B, S] (pad 0) and valid [B, S] (True = a real token).

    Right padding leaves every real token's causal context unchanged, and padded positions are
    dropped from every statistic.
    """
    for start in range(0, len(sequences), batch_size):
        group = sequences[start:start + batch_size]
        length = max(int(s.numel()) for s in group)
        ids = torch.zeros(len(group), length, dtype=torch.long)
        valid = torch.zeros(len(group), length, dtype=torch.bool)
        for row, sequence in enumerate(group):
            ids[row, :sequence.numel()] = sequence
            valid[row, :sequence.numel()] = True
        yield ids, valid


# ================================================================================== metrics
def js_divergence(p: torch.Tensor, q: torch.Tensor, log_base: float = 2.0) -> torch.Tensor:
    """Per-row Jensen-Shannon divergence [T] of distributions p, q [T, E] (paper §6.1).

    JS(p‖q) = ½ Σ_e p_e log(p_e/m_e) + ½ Σ_e q_e log(q_e/m_e), m = ½(p+q), with 0·log 0 = 0, in
    units of log ``log_base`` (base 2: bits, 0 ≤ JS ≤ 1). Computed in float64; exactly 0 for p = q.
    """
    p, q = p.double(), q.double()
    m = 0.5 * (p + q)
    kl_pm = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(-1)
    kl_qm = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum(-1)
    return (0.5 * (kl_pm + kl_qm) / math.log(log_base)).clamp_min(0.0)


def pair_token_sums(p: torch.Tensor, q: torch.Tensor, k: int, log_base: float = 2.0) -> dict[str, torch.Tensor]:
    """Sums over the T tokens of one layer for one model pair (float64 scalars / vectors).

    Args:
        p, q: [T, E] router distributions of models A and B on the same tokens.
        k: the deployment top-k that defines the sets S (Eq. 12).

    Returns ``tokens``; ``js`` = Σ_t JS_t; ``d1`` = Σ_t 1[argmax p_t ≠ argmax q_t] (Eq. 11);
    ``dk`` = Σ_t (1 − |S^A_t ∩ S^B_t| / k) (Eq. 12); ``reorder`` = Σ_t 1[top-1 differs and each
    top-1 lies in the other's top-k]; ``retention`` [J] = Σ_t ½(1[π^A_t(j) ∈ S^B_t] + 1[π^B_t(j) ∈
    S^A_t]) for ranks j = 1..J, J = min(E, k + 2). Rankings are ``torch.topk`` of the
    distributions, so identical inputs give identical rankings, ties included.
    """
    num_tokens, num_experts = p.shape
    ranks = min(num_experts, k + RETENTION_EXTRA_RANKS)
    ids_p = torch.topk(p, ranks, dim=-1).indices
    ids_q = torch.topk(q, ranks, dim=-1).indices
    in_p = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, ids_p[:, :k], True)
    in_q = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, ids_q[:, :k], True)
    overlap = (in_p & in_q).sum(-1).double()
    top1_differs = ids_p[:, 0] != ids_q[:, 0]
    reorder = top1_differs & in_q.gather(1, ids_p[:, :1]).squeeze(1) & in_p.gather(1, ids_q[:, :1]).squeeze(1)
    retention = 0.5 * (in_q.gather(1, ids_p).double() + in_p.gather(1, ids_q).double())
    return {
        "tokens": torch.tensor(float(num_tokens), dtype=torch.float64),
        "js": js_divergence(p, q, log_base).sum(),
        "d1": top1_differs.double().sum(),
        "dk": (1.0 - overlap / k).sum(),
        "reorder": reorder.double().sum(),
        "retention": retention.sum(0),
    }


class PairAccumulator:
    """Per-layer running sums of :func:`pair_token_sums` for one model pair and one task."""

    def __init__(self) -> None:
        self.sums: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, layer: int, sums: dict[str, torch.Tensor]) -> None:
        current = self.sums.get(layer)
        if current is None:
            self.sums[layer] = {name: value.clone() for name, value in sums.items()}
        else:
            for name, value in sums.items():
                current[name] += value

    def layer_means(self) -> dict[int, dict[str, Any]]:
        """{layer: js, d1, dk, reorder_share (of top-1 changes), retention [J], tokens}."""
        out = {}
        for layer, sums in sorted(self.sums.items()):
            tokens = float(sums["tokens"])
            d1 = float(sums["d1"])
            out[layer] = {
                "tokens": int(tokens),
                "js": float(sums["js"]) / tokens,
                "d1": d1 / tokens,
                "dk": float(sums["dk"]) / tokens,
                "reorder_count": float(sums["reorder"]),
                "d1_count": d1,
                "retention": (sums["retention"] / tokens).tolist(),
            }
        return out


# ================================================================================== models
@dataclasses.dataclass
class ModelInfo:
    """What ``compare`` needs to know about a checkpoint."""

    label: str
    kind: str  # "hf" | "megatron-demo"
    path: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    topk: int
    vocab_size: int
    max_positions: int | None
    run: str | None = None

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"moe_layers": list(self.moe_layers)}


class RoutedModel:
    """A loaded checkpoint: a forward that also returns each MoE layer's router logits."""

    info: ModelInfo

    def forward(self, ids: torch.Tensor, valid: torch.Tensor, capture: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [B, S, V] and, if ``capture``, {layer: router logits [B·S, E]} (batch-major rows)."""
        raise NotImplementedError

    def topk(self, k: int) -> contextlib.AbstractContextManager:
        """Static top-``k`` routing in every MoE layer inside the block (inference only)."""
        raise NotImplementedError

    def router_distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The router's per-token distribution over all experts: softmax(z) in fp32."""
        return torch.softmax(logits.float(), dim=-1)


class HFRoutedModel(RoutedModel):
    """A transformers MoE checkpoint; routers of the families :mod:`elastic_moe_plugin.hf` covers."""

    def __init__(self, path: str, label: str, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        from elastic_moe_plugin import hf

        try:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        except (OSError, ValueError) as error:
            raise DiagnosticsError(f"cannot load the transformers checkpoint {path!r}: {error}") from None
        covered = hf.covered_router_classes()
        self.routers: dict[int, torch.nn.Module] = {}
        for name, module in self.model.named_modules():
            if type(module) in covered:
                match = re.search(r"(?:^|\.)(\d+)\.mlp\.gate$", name)
                if match is None:
                    raise DiagnosticsError(f"{path}: cannot tell the layer index of router {name!r}.")
                self.routers[int(match.group(1))] = module
        if not self.routers:
            raise DiagnosticsError(
                f"{path} ({type(self.model).__name__}) has no router of a family elastic-moe covers "
                f"({', '.join(f.router for f in hf.FAMILIES)})."
            )
        config = self.model.config
        text = getattr(config, "text_config", None) or config
        first = next(iter(self.routers.values()))
        self.info = ModelInfo(
            label=label, kind="hf", path=path, num_layers=int(text.num_hidden_layers),
            moe_layers=tuple(sorted(self.routers)), num_experts=int(first.num_experts), topk=int(first.top_k),
            vocab_size=int(text.vocab_size), max_positions=getattr(text, "max_position_embeddings", None),
        )
        self._captured: dict[int, torch.Tensor] | None = None
        for layer, router in self.routers.items():
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if self._captured is not None:
                logits = output[0] if isinstance(output, tuple) else output
                self._captured[layer] = logits.detach().reshape(-1, logits.shape[-1])

        return hook

    @torch.no_grad()
    def forward(self, ids, valid, capture):
        self._captured = {} if capture else None
        try:
            logits = self.model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits
            return logits, self._captured or {}
        finally:
            self._captured = None

    def topk(self, k):
        return inference_topk.transformers(self.model, k)


class MegatronDemoModel(RoutedModel):
    """A CPU-demo Megatron ``GPTModel`` (``elastic-moe demo`` output), run by Megatron on the CPU."""

    def __init__(self, out_dir: str, run: str, label: str) -> None:
        from elastic_moe_plugin.tools import demo

        model, config = demo.load_trained(out_dir, run)
        self.model = model.eval()
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = {int(m.layer_number) - 1: m for m in self.model.modules() if isinstance(m, TopKRouter)}
        transformer = config["transformer_config"]
        self.score_function = next(iter(self.routers.values())).score_function if self.routers else "softmax"
        self.info = ModelInfo(
            label=label, kind="megatron-demo", path=out_dir, run=run, num_layers=int(transformer["num_layers"]),
            moe_layers=tuple(sorted(self.routers)), num_experts=int(transformer["num_moe_experts"]),
            topk=int(transformer["moe_router_topk"]), vocab_size=int(config["gpt_model"]["vocab_size"]),
            max_positions=int(config["gpt_model"]["max_sequence_length"]),
        )
        self._captured: dict[int, torch.Tensor] | None = None
        for layer, router in self.routers.items():
            self._wrap_routing(layer, router)

    def _wrap_routing(self, layer: int, router) -> None:
        # An instance attribute shadows TopKRouter.routing (stock or elastic-patched alike), so the
        # logits are seen exactly as the router's own routing step receives them.
        routing = router.routing

        def capture_routing(logits, *args, **kwargs):
            if self._captured is not None:
                # [S, B, E] (Megatron is sequence-major) -> [B·S, E], batch-major like transformers
                rows = logits.detach().transpose(0, 1) if logits.dim() == 3 else logits.detach()
                self._captured[layer] = rows.reshape(-1, logits.shape[-1])
            return routing(logits, *args, **kwargs)

        router.routing = capture_routing

    @torch.no_grad()
    def forward(self, ids, valid, capture):
        batch, seq = ids.shape
        # explicit causal mask (True = masked): GPTModel's default mask is allocated on "cuda"
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        positions = torch.arange(seq).expand(batch, seq)
        self._captured = {} if capture else None
        try:
            logits = self.model(ids, positions, attention_mask=mask)
            return logits, self._captured or {}
        finally:
            self._captured = None

    def router_distribution(self, logits):
        if self.score_function == "softmax":
            return torch.softmax(logits.float(), dim=-1)
        # sigmoid / sqrtsoftplus routers: their scores, normalised to a distribution
        scores = torch.sigmoid(logits.float()) if self.score_function == "sigmoid" else \
            torch.nn.functional.softplus(logits.float()).sqrt()
        return scores / scores.sum(-1, keepdim=True)

    def topk(self, k):
        if not 1 <= k <= self.info.num_experts:
            raise DiagnosticsError(f"top-k {k} is invalid for {self.info.label}: it has {self.info.num_experts} experts.")
        return inference_topk.megatron(self.model, k)


# ---------------------------------------------------------------------------------- checkpoint specs
@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    label: str
    kind: str  # "hf" | "megatron-demo"
    path: str
    run: str | None = None


def _demo_config(folder: Path) -> dict[str, Any] | None:
    file = folder / "model_config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise DiagnosticsError(f"{file}: not valid JSON ({error}).") from None
    if not str(config.get("format", "")).startswith(DEMO_FORMAT_PREFIX) or "runs" not in config:
        return None
    return config


def parse_checkpoint(spec: str) -> list[CheckpointSpec]:
    """``[LABEL=]PATH`` -> checkpoint specs; a demo folder without a run expands to all its runs.

    PATH is a transformers folder (``config.json``), a demo folder (``model_config.json`` with
    ``format: elastic-moe-demo/*``), ``DEMO_DIR:RUN`` or ``DEMO_DIR/<checkpoint>.pt``.
    """
    label, path = (spec.split("=", 1) if "=" in spec and not Path(spec).exists() else (None, spec))
    candidate = Path(path)
    run = None
    if not candidate.exists() and ":" in path:
        head, _, tail = path.rpartition(":")
        if Path(head).is_dir():
            candidate, run = Path(head), tail
    if candidate.is_file() and candidate.suffix in (".pt", ".pth"):
        config = _demo_config(candidate.parent)
        if config is None:
            raise DiagnosticsError(f"{path}: a .pt checkpoint needs the demo's model_config.json next to it.")
        runs = [name for name, entry in config["runs"].items() if entry.get("checkpoint") == candidate.name]
        if not runs:
            raise DiagnosticsError(f"{path}: model_config.json lists no run with checkpoint {candidate.name!r}.")
        candidate, run = candidate.parent, runs[0]
    if not candidate.exists():
        raise DiagnosticsError(f"checkpoint {path!r} does not exist.")
    if not candidate.is_dir():
        raise DiagnosticsError(f"checkpoint {path!r} is not a folder (a transformers checkpoint or a demo output).")
    demo = _demo_config(candidate)
    if demo is not None:
        runs = list(demo["runs"]) if run is None else [run]
        for name in runs:
            if name not in demo["runs"]:
                raise DiagnosticsError(f"{candidate}: no run {name!r} in model_config.json (runs: {', '.join(demo['runs'])}).")
            if not (candidate / demo["runs"][name]["checkpoint"]).is_file():
                raise DiagnosticsError(f"{candidate}: checkpoint file {demo['runs'][name]['checkpoint']!r} is missing.")
        if label is not None and len(runs) > 1:
            return [CheckpointSpec(f"{label}-{name}", "megatron-demo", str(candidate), name) for name in runs]
        return [CheckpointSpec(label or name, "megatron-demo", str(candidate), name) for name in runs]
    if (candidate / "config.json").is_file():
        return [CheckpointSpec(label or candidate.name, "hf", str(candidate))]
    raise DiagnosticsError(f"{path}: neither a transformers checkpoint (config.json) nor an elastic-moe demo "
                           f"output (model_config.json).")


@contextlib.contextmanager
def megatron_session() -> Iterator[None]:
    """Megatron on the CPU for demo checkpoints: the compatibility layer and model-parallel state
    (TP=PP=EP=1), reusing what the process already has and undoing only what it set up."""
    from elastic_moe_plugin.compat import megatron_cpu

    megatron_cpu.disable_torch_compile()
    # force: a GPU machine still runs the demo's CPU models on the CPU (as ``elastic-moe demo`` does)
    with megatron_cpu.enabled(force=torch.cuda.is_available()):
        from megatron.core import parallel_state

        created = False
        if not parallel_state.model_parallel_is_initialized():
            megatron_cpu.initialize_model_parallel()
            created = True
        try:
            yield
        finally:
            if created:
                megatron_cpu.destroy()


def load_models(specs: Sequence[CheckpointSpec], stack: contextlib.ExitStack, dtype: str = "float32") -> list[RoutedModel]:
    models: list[RoutedModel] = []
    session = False
    for spec in specs:
        if spec.kind == "hf":
            models.append(HFRoutedModel(spec.path, spec.label, dtype))
        else:
            if not session:
                stack.enter_context(_quiet_megatron())
                stack.enter_context(megatron_session())
                session = True
            models.append(MegatronDemoModel(spec.path, spec.run, spec.label))
    labels = [m.info.label for m in models]
    if len(set(labels)) != len(labels):
        raise DiagnosticsError(f"checkpoint labels must differ, got {labels}; name them with LABEL=PATH.")
    return models


@contextlib.contextmanager
def _quiet_megatron() -> Iterator[None]:
    import logging
    import warnings

    logger = logging.getLogger("megatron")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            yield
        finally:
            logger.setLevel(level)


# ================================================================================== compare
@dataclasses.dataclass
class CompareSettings:
    """Choices of ``compare`` (see the module docstring and docs/diagnostics.md)."""

    k: int | None = None                       # deployment top-k of the sets in Dk (default: the models')
    sweep: tuple[int, ...] | None = None       # inference top-k values; None: k-2..k+2; () : no sweep
    boundary: int = 1                          # first/last MoE layers that count as boundary layers
    boundary_layers: tuple[int, ...] | None = None  # explicit boundary layers (overrides ``boundary``)
    block_width: int = 5                       # width of the peak non-boundary block (paper: L3-L7)
    cutoff_window: int = 2                     # w: the last deployed ranks counted as "near the cutoff"
    log_base: float = 2.0                      # JS in bits by default (0 ≤ JS ≤ 1)
    batch_size: int = 8
    seq_len: int | None = None                 # default: the models' smallest max positions (≤ 1024)
    max_sequences: int | None = None           # per probe file, after chunking
    all_pairs: bool = False                    # every pair instead of (first model, each other)


def check_compatible(models: Sequence[RoutedModel], settings: CompareSettings) -> tuple[tuple[int, ...], int]:
    """The MoE layers and the top-k every model shares. Raises DiagnosticsError on a mismatch."""
    first = models[0].info
    for model in models[1:]:
        info = model.info
        if info.num_experts != first.num_experts:
            raise DiagnosticsError(f"{first.label} has {first.num_experts} experts per layer but {info.label} has "
                                   f"{info.num_experts}: router distributions over different experts cannot be compared.")
        if info.num_layers != first.num_layers or info.moe_layers != first.moe_layers:
            raise DiagnosticsError(f"{first.label} has {first.num_layers} layers (MoE layers {list(first.moe_layers)}) but "
                                   f"{info.label} has {info.num_layers} (MoE layers {list(info.moe_layers)}): the "
                                   f"layer-by-layer comparison needs the same architecture.")
    if settings.k is not None:
        k = settings.k
    else:
        topks = {m.info.topk for m in models}
        if len(topks) > 1:
            raise DiagnosticsError(f"the models route to different top-k ({sorted(topks)}); pass --k to choose the "
                                   f"set size of Dk.")
        k = first.topk
    if not 1 <= k <= first.num_experts:
        raise DiagnosticsError(f"--k {k} is invalid: the models have {first.num_experts} experts.")
    for value in settings.sweep or ():
        if not 1 <= value <= first.num_experts:
            raise DiagnosticsError(f"--topk-sweep value {value} is outside 1..{first.num_experts} (the experts per layer).")
    if settings.boundary_layers is not None:
        outside = sorted(set(settings.boundary_layers) - set(first.moe_layers))
        if outside:
            raise DiagnosticsError(f"--boundary-layers {outside} are not MoE layers of the models "
                                   f"(0-based MoE layers: {list(first.moe_layers)}).")
    return first.moe_layers, k


def boundary_layers(layers: Sequence[int], settings: CompareSettings) -> tuple[int, ...]:
    """The paper's boundary layers: the first and last ``settings.boundary`` MoE layers (L0 and
    L15 of OLMoE's 16), or ``settings.boundary_layers`` when given."""
    if settings.boundary_layers is not None:
        return tuple(sorted(settings.boundary_layers))
    n = max(0, settings.boundary)
    ordered = sorted(layers)
    if 2 * n >= len(ordered):
        return tuple(ordered)
    return tuple(ordered[:n] + ordered[len(ordered) - n:])


def peak_block(values: dict[int, float], excluded: Sequence[int], width: int) -> dict[str, Any] | None:
    """The run of ``width`` consecutive non-boundary layers with the largest mean value (ties: first).

    Layers must be consecutive integers; the width shrinks to the longest run available.
    """
    candidates = sorted(layer for layer in values if layer not in set(excluded))
    runs: list[list[int]] = []
    for layer in candidates:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    if not runs:
        return None
    width = max(1, min(width, max(len(run) for run in runs)))
    best = None
    for run in runs:
        for start in range(len(run) - width + 1):
            block = run[start:start + width]
            mean = sum(values[layer] for layer in block) / width
            if best is None or mean > best["mean"]:
                best = {"layers": f"{block[0]}-{block[-1]}" if width > 1 else str(block[0]), "first": block[0],
                        "last": block[-1], "mean": mean}
    return best


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_pair(per_task: dict[str, dict[int, dict[str, Any]]], k: int, boundary: Sequence[int],
                   settings: CompareSettings) -> dict[str, Any]:
    """Per-layer values averaged over tasks (each task weighs the same, as the paper averages over
    tasks), then the pair's summary numbers."""
    tasks = list(per_task)
    layers = sorted(per_task[tasks[0]])
    per_layer: dict[int, dict[str, Any]] = {}
    for layer in layers:
        entries = [per_task[task][layer] for task in tasks]
        retention = [sum(e["retention"][j] for e in entries) / len(entries) for j in range(len(entries[0]["retention"]))]
        per_layer[layer] = {
            "layer": layer, "boundary": layer in boundary, "tokens": sum(e["tokens"] for e in entries),
            "js": _mean([e["js"] for e in entries]), "d1": _mean([e["d1"] for e in entries]),
            "dk": _mean([e["dk"] for e in entries]), "retention": retention,
        }
        per_layer[layer]["dk_experts"] = k * per_layer[layer]["dk"]
    inner = [layer for layer in layers if layer not in boundary]
    outer = [layer for layer in layers if layer in boundary]
    d1 = _mean([per_layer[layer]["d1"] for layer in layers])
    dk = _mean([per_layer[layer]["dk"] for layer in layers])
    # reorder share: pooled over layers within a task, then averaged over tasks
    shares = []
    for task in tasks:
        changed = sum(per_task[task][layer]["d1_count"] for layer in layers)
        if changed > 0:
            shares.append(sum(per_task[task][layer]["reorder_count"] for layer in layers) / changed)
    retention = [_mean([per_layer[layer]["retention"][j] for layer in layers]) for j in range(len(per_layer[layers[0]]["retention"]))]
    lost = [1.0 - value for value in retention[:k]]
    window = max(1, min(settings.cutoff_window, k))
    near_cutoff = sum(lost[k - window:]) / sum(lost) if sum(lost) > 1e-12 else None
    js_values = {layer: per_layer[layer]["js"] for layer in layers}
    return {
        "layers": [per_layer[layer] for layer in layers],
        "js_mean": _mean(list(js_values.values())),
        "js_nonboundary_mean": _mean([js_values[layer] for layer in inner]),
        "js_boundary_mean": _mean([js_values[layer] for layer in outer]),
        "boundary_layers": list(boundary),
        "peak_nonboundary_block": peak_block(js_values, boundary, settings.block_width),
        "D1": d1,
        "Dk": dk,
        "k": k,
        "Dk_experts": None if dk is None else k * dk,
        "D1_nonboundary": _mean([per_layer[layer]["d1"] for layer in inner]),
        "Dk_nonboundary": _mean([per_layer[layer]["dk"] for layer in inner]),
        "prioritisation": {
            "d1_over_dk": (d1 / dk) if dk else None,
            "top1_reorder_share": _mean(shares),
            "rank_retention": retention,
            "near_cutoff_share": near_cutoff,
            "cutoff_window": window,
        },
    }


def compare(models: Sequence[RoutedModel], tasks: Sequence[ProbeTask], settings: CompareSettings,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Stream every probe task through every model; return the results dict of ``diagnostics.json``.

    Per batch: one static-top-k forward per model captures the router logits of every MoE layer
    (turned into distributions of the valid tokens) and gives the top-k loss; one more forward
    per extra sweep value; then each pair's per-layer sums are added. Nothing per token survives
    the batch.
    """
    if not models:
        raise DiagnosticsError("no checkpoint given.")
    layers, k = check_compatible(models, settings)
    native = models[0].info.topk
    sweep = settings.sweep
    if sweep is None:
        sweep = tuple(range(max(1, native - SWEEP_HALF_WIDTH), min(models[0].info.num_experts, native + SWEEP_HALF_WIDTH) + 1))
    limits = [m.info.max_positions for m in models if m.info.max_positions]
    seq_len = settings.seq_len or min(limits + [1024])
    if limits and seq_len > min(limits):
        raise DiagnosticsError(f"--seq-len {seq_len} exceeds the models' maximum positions ({min(limits)}).")
    vocab = min(m.info.vocab_size for m in models)
    if len(models) == 1:
        pairs: list[tuple[int, int]] = []
    elif settings.all_pairs:
        pairs = [(i, j) for i in range(len(models)) for j in range(i + 1, len(models))]
    else:
        pairs = [(0, j) for j in range(1, len(models))]
    boundary = boundary_layers(layers, settings)

    pair_acc = {(i, j, task.name): PairAccumulator() for (i, j) in pairs for task in tasks}
    # loss sums: (model, task, k) -> [Σ nll, tokens]
    loss_sums: dict[tuple[int, str, int], list[float]] = {}
    probe_info = []
    for task in tasks:
        sequences = chunk_sequences(task.sequences, seq_len)
        if settings.max_sequences is not None:
            sequences = sequences[:settings.max_sequences]
        largest = max(int(s.max()) for s in sequences)
        if largest >= vocab or min(int(s.min()) for s in sequences) < 0:
            raise DiagnosticsError(f"probe file {task.path}: token id {largest} is outside the models' vocabulary "
                                   f"(0..{vocab - 1}).")
        probe_info.append({"name": task.name, "path": task.path, "sequences": len(sequences),
                           "tokens": sum(int(s.numel()) for s in sequences)})
        for number, (ids, valid) in enumerate(probe_batches(sequences, settings.batch_size)):
            if progress is not None:
                progress(f"{task.name}: batch {number + 1}/{math.ceil(len(sequences) / settings.batch_size)}")
            rows = valid.reshape(-1)
            distributions: list[dict[int, torch.Tensor]] = []
            for index, model in enumerate(models):
                # routers are compared as deployed: each model at its own static top-k
                native_k = model.info.topk
                logits, routers = model.forward(ids, valid, capture=bool(pairs))
                _add_loss(loss_sums, (index, task.name, native_k), logits, ids, valid)
                distributions.append({layer: model.router_distribution(routers[layer][rows]) for layer in routers})
                del logits, routers
                for value in sweep:
                    if value == native_k:
                        continue
                    with model.topk(value):
                        logits, _ = model.forward(ids, valid, capture=False)
                    _add_loss(loss_sums, (index, task.name, value), logits, ids, valid)
                    del logits
            for i, j in pairs:
                for layer in layers:
                    pair_acc[(i, j, task.name)].add(layer, pair_token_sums(distributions[i][layer], distributions[j][layer],
                                                                           k, settings.log_base))
            del distributions

    results: dict[str, Any] = {
        "format": FORMAT,
        "models": [m.info.describe() for m in models],
        "probe": {"tasks": probe_info, "seq_len": seq_len, "batch_size": settings.batch_size,
                  "positions": "every non-padding token of every probe window, teacher-forced, same inputs for all models"},
        "settings": {"k": k, "sweep": list(sweep), "boundary": settings.boundary, "boundary_layers": list(boundary),
                     "block_width": settings.block_width, "cutoff_window": settings.cutoff_window,
                     "js_log_base": settings.log_base, "task_average": "per-task means, then the unweighted mean over tasks"},
        "pairs": {},
        "topk_sweep": {},
    }
    for i, j in pairs:
        per_task = {task.name: pair_acc[(i, j, task.name)].layer_means() for task in tasks}
        summary = summarize_pair(per_task, k, boundary, settings)
        summary["per_task"] = {task: {"D1": _mean([v["d1"] for v in values.values()]),
                                      "Dk": _mean([v["dk"] for v in values.values()]),
                                      "js_mean": _mean([v["js"] for v in values.values()])}
                               for task, values in per_task.items()}
        summary["a"], summary["b"] = models[i].info.label, models[j].info.label
        results["pairs"][f"{models[i].info.label} vs {models[j].info.label}"] = summary
    for index, model in enumerate(models):
        entry: dict[str, Any] = {"native_topk": model.info.topk, "k": {}}
        for value in sorted({model.info.topk, *sweep}):
            nll = sum(loss_sums[(index, task.name, value)][0] for task in tasks)
            count = sum(loss_sums[(index, task.name, value)][1] for task in tasks)
            per_task = {task.name: loss_sums[(index, task.name, value)][0] / loss_sums[(index, task.name, value)][1]
                        for task in tasks}
            entry["k"][str(value)] = {"loss": nll / count, "perplexity": math.exp(nll / count), "tokens": int(count),
                                      "loss_per_task": per_task}
        results["topk_sweep"][model.info.label] = entry
    return results


def _add_loss(sums: dict, key, logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> None:
    """Σ next-token NLL over positions t whose token t and target t+1 are both real (float64)."""
    target_valid = valid[:, 1:] & valid[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                            ids[:, 1:].reshape(-1), reduction="none").double()
    entry = sums.setdefault(key, [0.0, 0])
    entry[0] += float((nll * target_valid.reshape(-1)).sum())
    entry[1] += int(target_valid.sum())


# ================================================================================== κ histograms
def _kappa_from_flat(metrics: dict[str, float]) -> dict[int, dict[int, float]]:
    shares: dict[int, dict[int, float]] = {}
    for key, value in metrics.items():
        match = re.fullmatch(r"elastic_moe/layer_(\d+)/kappa_frac_(\d+)", key)
        if match:
            shares.setdefault(int(match.group(1)), {})[int(match.group(2))] = float(value)
    return shares


def _pmf_from_survival(metrics: dict[str, float]) -> dict[int, float]:
    """q(r) = a(r) − a(r+1) (Eq. 8) from the logged ``survival_rank_<r>`` of any layer."""
    survival: dict[int, float] = {}
    for key, value in metrics.items():
        match = re.fullmatch(r"elastic_moe/layer_\d+/survival_rank_(\d+)", key)
        if match:
            survival[int(match.group(1))] = float(value)
    if not survival:
        return {}
    high = max(survival)
    return {r: survival[r] - survival.get(r + 1, 0.0) for r in range(1, high + 1) if survival[r] - survival.get(r + 1, 0.0) > 0}


def load_kappa(path: str | os.PathLike[str], label: str | None = None) -> dict[str, dict[str, Any]]:
    """κ histograms against the schedule's pmf from a file.

    Accepts a routing-metrics JSON (one dict of ``elastic_moe/layer_<i>/kappa_frac_<r>`` and
    ``.../survival_rank_<r>``, as ``hf.routing_metrics`` / ``mcore.tracking.routing_metrics``
    return), a list or JSON-lines of such dicts (a trainer's log history; entries are averaged),
    a ``{"log_history": [...]}`` trainer state, or an ``elastic-moe demo`` ``summary.json``
    (its elastic runs' training κ histograms).

    Returns:
        {label: {"observed": {layer: {κ: share}}, "pmf": {κ: q(κ)}}}.

    Raises:
        DiagnosticsError: missing file, or no κ shares in it.
    """
    file = Path(path)
    if not file.is_file():
        raise DiagnosticsError(f"κ metrics file {str(path)!r} does not exist.")
    text = file.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise DiagnosticsError(f"{path}: neither JSON nor JSON lines ({error}).") from None
    name = label or file.stem
    if isinstance(data, dict) and str(data.get("format", "")).startswith(DEMO_FORMAT_PREFIX) and "runs" in data:
        return _kappa_from_demo_summary(data, str(path))
    if isinstance(data, dict) and isinstance(data.get("log_history"), list):
        data = data["log_history"]
    entries = data if isinstance(data, list) else [data]
    entries = [e for e in entries if isinstance(e, dict) and _kappa_from_flat(e)]
    if not entries:
        raise DiagnosticsError(f"{path}: no 'elastic_moe/layer_<i>/kappa_frac_<r>' values in it.")
    observed: dict[int, dict[int, float]] = {}
    for entry in entries:
        for layer, shares in _kappa_from_flat(entry).items():
            for budget, share in shares.items():
                observed.setdefault(layer, {}).setdefault(budget, 0.0)
                observed[layer][budget] += share / len(entries)
    return {name: {"observed": observed, "pmf": _pmf_from_survival(entries[-1]), "source": str(path)}}


def _kappa_from_demo_summary(summary: dict[str, Any], where: str, runs: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    out = {}
    schedule = summary.get("schedule") or {}
    pmf = {int(b): float(q) for b, q in zip(schedule.get("budgets", []), schedule.get("pmf", []))}
    for run, entry in summary["runs"].items():
        if runs is not None and run not in runs:
            continue
        if not entry.get("elastic_layers"):
            continue
        observed = {}
        for layer, values in (entry.get("kappa") or {}).items():
            histogram = {int(b): float(c) for b, c in (values.get("histogram") or {}).items()}
            total = sum(histogram.values())
            if total > 0 and values.get("elastic", True):
                observed[int(layer)] = {b: c / total for b, c in histogram.items()}
        if observed:
            out[run] = {"observed": observed, "pmf": pmf, "source": where}
    return out


def demo_kappa_for(models: Sequence[RoutedModel]) -> dict[str, dict[str, Any]]:
    """Training κ histograms of demo runs, from the ``summary.json`` next to their checkpoints."""
    out: dict[str, dict[str, Any]] = {}
    for model in models:
        info = model.info
        if info.kind != "megatron-demo":
            continue
        summary_file = Path(info.path) / "summary.json"
        if not summary_file.is_file():
            continue
        try:
            summary = json.loads(summary_file.read_text())
            found = _kappa_from_demo_summary(summary, str(summary_file), runs=[info.run])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            continue  # the demo's summary format is the demo's; a change there only drops this plot
        for entry in found.values():
            out[info.label] = entry
    return out


# ================================================================================== router swap
def _layers_arg(spec: str | None, num_layers: int, moe_layers: Sequence[int]) -> list[int]:
    if spec is None:
        return list(moe_layers)
    try:
        layers = sorted(parse_layers(spec))
    except ConfigError as error:
        raise DiagnosticsError(str(error)) from None
    outside = [layer for layer in layers if layer >= num_layers]
    if outside:
        raise DiagnosticsError(f"--layers {spec!r} selects layer(s) {outside}, but the model has {num_layers} layers "
                               f"(0-based 0..{num_layers - 1}).")
    not_moe = [layer for layer in layers if layer not in set(moe_layers)]
    if not_moe:
        raise DiagnosticsError(f"--layers {spec!r} selects layer(s) {not_moe} without a router (MoE layers: {list(moe_layers)}).")
    return layers


_MEGATRON_ROUTER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.(.+)$")


def router_swap(donor: CheckpointSpec, target: CheckpointSpec, out: str | os.PathLike[str],
                layers: str | None = None, dtype: str = "float32") -> dict[str, Any]:
    """Write ``target`` with the routers of ``donor`` in ``layers`` (default: every MoE layer).

    Only router parameters and buffers change (transformers: the ``mlp.gate`` module's state;
    Megatron: ``decoder.layers.<i>.mlp.router.*``); every other tensor is the target's (paper
    Table 4: "only the router is replaced"). The output is a checkpoint of the target's kind:
    a transformers folder (``save_pretrained`` plus the target's tokenizer files) or a demo-format
    folder with one run ``swapped``. A ``router_swap.json`` records what was done.

    Raises:
        DiagnosticsError: different kinds, expert counts, layer counts or router shapes; layers
            outside the model.
    """
    out_dir = Path(out)
    if donor.kind != target.kind:
        raise DiagnosticsError(f"router swap needs two checkpoints of one kind; got {donor.kind} ({donor.path}) and "
                               f"{target.kind} ({target.path}).")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DiagnosticsError(f"--out {str(out_dir)!r} exists and is not empty.")
    record: dict[str, Any] = {"format": "elastic-moe-router-swap/1", "router_from": dataclasses.asdict(donor),
                              "into": dataclasses.asdict(target)}
    if target.kind == "hf":
        with contextlib.ExitStack() as stack:
            a, b = load_models([donor, dataclasses.replace(target, label=target.label + "#target")], stack, dtype)
            check_compatible([a, b], CompareSettings(k=b.info.topk))
            selected = _layers_arg(layers, b.info.num_layers, b.info.moe_layers)
            for layer in selected:
                source, sink = a.routers[layer].state_dict(), b.routers[layer].state_dict()
                if set(source) != set(sink) or any(source[n].shape != sink[n].shape for n in sink):
                    raise DiagnosticsError(f"layer {layer}: the routers' tensors differ ({sorted(source)} vs {sorted(sink)}).")
                b.routers[layer].load_state_dict(source)
            out_dir.mkdir(parents=True, exist_ok=True)
            b.model.save_pretrained(out_dir)
            # the tokenizer (and generation defaults) travel with the target
            extras = ("special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json")
            for file in Path(target.path).iterdir():
                wanted = file.is_file() and (file.name.startswith("tokenizer") or file.name in extras)
                if wanted and not (out_dir / file.name).exists():
                    shutil.copy2(file, out_dir / file.name)
    else:
        donor_config, target_config = _demo_config(Path(donor.path)), _demo_config(Path(target.path))
        a_tc, b_tc = donor_config["transformer_config"], target_config["transformer_config"]
        for key, what in (("num_moe_experts", "experts per layer"), ("num_layers", "layers"), ("hidden_size", "hidden size")):
            if a_tc[key] != b_tc[key]:
                raise DiagnosticsError(f"{donor.label} has {a_tc[key]} {what} but {target.label} has {b_tc[key]}: "
                                       f"their routers are not interchangeable.")
        selected = _layers_arg(layers, int(b_tc["num_layers"]), range(int(b_tc["num_layers"])))
        state_a = torch.load(Path(donor.path) / donor_config["runs"][donor.run]["checkpoint"], map_location="cpu", weights_only=True)
        state_b = torch.load(Path(target.path) / target_config["runs"][target.run]["checkpoint"], map_location="cpu", weights_only=True)
        keys_a = {key for key in state_a if _MEGATRON_ROUTER_KEY.match(key)}
        keys_b = {key for key in state_b if _MEGATRON_ROUTER_KEY.match(key)}
        if keys_a != keys_b:
            raise DiagnosticsError(f"the router tensors differ: {sorted(keys_a ^ keys_b)}.")
        for key in sorted(keys_b):
            if int(_MEGATRON_ROUTER_KEY.match(key).group(1)) in selected:
                value_a, value_b = state_a[key], state_b[key]
                if isinstance(value_a, torch.Tensor) and isinstance(value_b, torch.Tensor):
                    if value_a.shape != value_b.shape:
                        raise DiagnosticsError(f"{key}: shape {tuple(value_a.shape)} vs {tuple(value_b.shape)}.")
                    value_a = value_a.clone()
                state_b[key] = value_a
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(state_b, out_dir / "swapped.pt")
        config = dict(target_config)
        config["runs"] = {"swapped": dict(target_config["runs"][target.run], checkpoint="swapped.pt",
                                          router_swap={"router_from": f"{donor.path}:{donor.run}",
                                                       "into": f"{target.path}:{target.run}", "layers": selected})}
        (out_dir / "model_config.json").write_text(json.dumps(config, indent=2))
    record["layers"] = selected
    (out_dir / "router_swap.json").write_text(json.dumps(record, indent=2))
    return record


# ================================================================================== output
def write_outputs(results: dict[str, Any], out: Path, kappa: dict[str, dict[str, Any]], plots: bool = True) -> list[str]:
    """diagnostics.json, the CSVs and (``plots``) the PNGs; returns the file names written."""
    out.mkdir(parents=True, exist_ok=True)
    files = ["diagnostics.json"]
    results["kappa"] = {label: {"observed": {str(layer): {str(b): s for b, s in shares.items()}
                                             for layer, shares in entry["observed"].items()},
                                "pmf": {str(b): q for b, q in entry["pmf"].items()}, "source": entry.get("source")}
                        for label, entry in kappa.items()}
    if results.get("pairs"):
        with open(out / "divergence_by_layer.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["pair", "layer", "boundary", "js", "d1", "dk", "dk_experts", "tokens"])
            for pair, summary in results["pairs"].items():
                for row in summary["layers"]:
                    writer.writerow([pair, row["layer"], int(row["boundary"]), f"{row['js']:.8g}", f"{row['d1']:.8g}",
                                     f"{row['dk']:.8g}", f"{row['dk_experts']:.8g}", row["tokens"]])
        with open(out / "pairs.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["pair", "js_mean", "js_nonboundary_mean", "js_boundary_mean", "peak_nonboundary_block",
                             "D1", "Dk", "k", "Dk_experts", "d1_over_dk", "top1_reorder_share", "near_cutoff_share"])
            for pair, s in results["pairs"].items():
                p = s["prioritisation"]
                writer.writerow([pair, _fmt(s["js_mean"]), _fmt(s["js_nonboundary_mean"]), _fmt(s["js_boundary_mean"]),
                                 (s["peak_nonboundary_block"] or {}).get("layers", ""), _fmt(s["D1"]), _fmt(s["Dk"]),
                                 s["k"], _fmt(s["Dk_experts"]), _fmt(p["d1_over_dk"]), _fmt(p["top1_reorder_share"]),
                                 _fmt(p["near_cutoff_share"])])
        files += ["divergence_by_layer.csv", "pairs.csv"]
    if results.get("topk_sweep"):
        with open(out / "topk_sweep.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["model", "k", "native_topk", "loss", "perplexity", "tokens"])
            for label, entry in results["topk_sweep"].items():
                for value, row in entry["k"].items():
                    writer.writerow([label, value, entry["native_topk"], f"{row['loss']:.8g}", f"{row['perplexity']:.8g}",
                                     row["tokens"]])
        files.append("topk_sweep.csv")
    if kappa:
        with open(out / "kappa.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["source", "layer", "kappa", "observed_share", "pmf"])
            for label, entry in kappa.items():
                for layer, shares in sorted(entry["observed"].items()):
                    for budget in sorted(set(shares) | set(entry["pmf"])):
                        writer.writerow([label, layer, budget, _fmt(shares.get(budget, 0.0)), _fmt(entry["pmf"].get(budget, 0.0))])
        files.append("kappa.csv")
    if plots:
        from elastic_moe_plugin.tools.diagnose import plots as diagnostics_plots

        written = diagnostics_plots.plot_all(results, kappa, out)
        results["plots"] = written
        files += written
    results["files"] = files
    (out / "diagnostics.json").write_text(json.dumps(results, indent=2))
    return files


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.8g}"


def format_report(results: dict[str, Any]) -> str:
    """A short human-readable summary of ``diagnostics.json``."""
    lines = []
    probe = results["probe"]
    tokens = sum(task["tokens"] for task in probe["tasks"])
    lines.append(f"probe: {len(probe['tasks'])} file(s), {tokens} tokens in windows of <= {probe['seq_len']}; "
                 f"k = {results['settings']['k']}; JS in log base {results['settings']['js_log_base']:g}")
    for pair, s in results["pairs"].items():
        p = s["prioritisation"]
        peak = s["peak_nonboundary_block"]
        lines.append(f"\n{pair}")
        lines.append(f"  {'layer':>5} {'JS':>10} {'D1':>8} {'Dk':>8}  ")
        for row in s["layers"]:
            lines.append(f"  {row['layer']:>5} {row['js']:>10.5f} {row['d1']:>8.4f} {row['dk']:>8.4f}"
                         f"{'  boundary' if row['boundary'] else ''}")
        lines.append(f"  JS mean {s['js_mean']:.5f} | non-boundary {_num(s['js_nonboundary_mean'])} | boundary "
                     f"{_num(s['js_boundary_mean'])} (layers {s['boundary_layers']})"
                     + (f" | peak non-boundary block L{peak['layers']} ({peak['mean']:.5f})" if peak else ""))
        lines.append(f"  D1 {s['D1']:.4f}  Dk {s['Dk']:.4f} (= {s['Dk_experts']:.3f} of {s['k']} experts)  "
                     f"D1/Dk {_num(p['d1_over_dk'], '.3f')}  top-1 reorders inside the shared set "
                     f"{_num(p['top1_reorder_share'], '.3f')}  near-cutoff share (last {p['cutoff_window']} ranks) "
                     f"{_num(p['near_cutoff_share'], '.3f')}")
        lines.append("  rank retention P(rank j of one model in the other's top-k): "
                     + " ".join(f"{j + 1}:{v:.3f}" for j, v in enumerate(p["rank_retention"])))
    if results["topk_sweep"]:
        labels = list(results["topk_sweep"])
        ks = sorted({int(v) for entry in results["topk_sweep"].values() for v in entry["k"]})
        lines.append("\ninference top-k sweep, probe loss (perplexity):")
        lines.append("  " + f"{'k':>3} " + " ".join(f"{label:>22}" for label in labels))
        for value in ks:
            cells = []
            for label in labels:
                row = results["topk_sweep"][label]["k"].get(str(value))
                native = results["topk_sweep"][label]["native_topk"]
                cells.append(f"{row['loss']:.4f} ({row['perplexity']:.2f}){'*' if value == native else ' '}"
                             if row else "-")
            lines.append("  " + f"{value:>3} " + " ".join(f"{c:>22}" for c in cells))
        lines.append("  (* = the checkpoint's own top-k)")
    return "\n".join(lines)


def _num(value: float | None, spec: str = ".5f") -> str:
    return "n/a" if value is None else format(value, spec)


# ================================================================================== CLI
def _parse_sweep(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    if text.strip().lower() in ("none", "off", ""):
        return ()
    values: set[int] = set()
    for item in text.replace(" ", "").split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not match:
            raise DiagnosticsError(f"--topk-sweep {text!r}: expected values or ranges such as '4-12' or '2,4,8'.")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise DiagnosticsError(f"--topk-sweep {text!r}: reversed range {item!r}.")
        values.update(range(first, last + 1))
    return tuple(sorted(values))


def configure_parser(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="diagnose_command", required=True, metavar="{compare,swap,kappa}")

    compare_parser = commands.add_parser(
        "compare", help="router divergence, D1/Dk, prioritisation and a top-k sweep on a probe set",
        description="Stream a probe set through checkpoints (transformers folders or elastic-moe demo outputs) and "
                    "write per-layer router divergence, D1/Dk, expert prioritisation near the cutoff, an inference "
                    "top-k sweep and plots (paper §6).")
    compare_parser.add_argument("checkpoints", nargs="+", metavar="[LABEL=]PATH",
                                help="transformers folder, demo folder (all runs), DEMO_DIR:RUN or DEMO_DIR/RUN.pt")
    compare_parser.add_argument("--probe", action="append", required=True, metavar="FILE",
                                help="token ids (.pt/.npy/.json/.jsonl/.txt of ints) or, with --tokenizer, text lines; "
                                "repeat for several tasks (averaged with equal weight)")
    compare_parser.add_argument("--tokenizer", default=None, help="tokenizer name or folder for text probe files")
    compare_parser.add_argument("--out", default="diagnostics_out", help="output folder (default: diagnostics_out/)")
    compare_parser.add_argument("--k", type=int, default=None, help="top-k of the sets in Dk (default: the models')")
    compare_parser.add_argument("--topk-sweep", default=None, metavar="K",
                                help="inference top-k values, e.g. '4-12' or '2,4,8'; 'off' to skip (default: k-2..k+2)")
    compare_parser.add_argument("--boundary", type=int, default=1,
                                help="first and last N MoE layers count as boundary layers (default 1: L0 and L_last)")
    compare_parser.add_argument("--boundary-layers", default=None, metavar="LAYERS",
                                help="explicit 0-based boundary layers, e.g. '0,15' (overrides --boundary)")
    compare_parser.add_argument("--block-width", type=int, default=5, help="width of the peak non-boundary block (default 5)")
    compare_parser.add_argument("--cutoff-window", type=int, default=2,
                                help="last deployed ranks that count as near the cutoff (default 2)")
    compare_parser.add_argument("--js-base", choices=("2", "e"), default="2", help="log base of JS (default 2: bits)")
    compare_parser.add_argument("--batch-size", type=int, default=8, help="probe windows per batch (default 8)")
    compare_parser.add_argument("--seq-len", type=int, default=None, help="probe window length (default: model maximum, <= 1024)")
    compare_parser.add_argument("--max-sequences", type=int, default=None, help="cap on windows per probe file")
    compare_parser.add_argument("--all-pairs", action="store_true", help="compare every pair (default: first vs each other)")
    compare_parser.add_argument("--kappa-metrics", action="append", default=[], metavar="FILE",
                                help="routing-metrics JSON / JSONL / demo summary.json for the κ histogram plot")
    compare_parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                                help="transformers weights dtype (default float32)")
    compare_parser.add_argument("--no-plots", action="store_true", help="write JSON and CSV only")
    compare_parser.add_argument("--json", action="store_true", help="print diagnostics.json instead of the report")
    compare_parser.set_defaults(diagnose_handler=_run_compare)

    swap = commands.add_parser(
        "swap", help="write a checkpoint: one model's experts and everything else, another's routers",
        description="Router swap (paper Table 4): load the routers of --router-from into --into (all MoE layers or "
                    "--layers) and write the result as a checkpoint of the same kind.")
    swap.add_argument("--router-from", required=True, metavar="[LABEL=]PATH", help="router donor")
    swap.add_argument("--into", required=True, metavar="[LABEL=]PATH", help="target (experts, attention, embeddings)")
    swap.add_argument("--out", required=True, help="output folder (must be new or empty)")
    swap.add_argument("--layers", default=None, help="0-based layers to swap, e.g. '3-7' (default: every MoE layer)")
    swap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    swap.set_defaults(diagnose_handler=_run_swap)

    kappa = commands.add_parser(
        "kappa", help="plot realised κ histograms against the schedule's pmf from logged routing metrics",
        description="Plot κ shares per layer against the budget pmf from a routing-metrics JSON/JSONL (hf / mcore "
                    "routing_metrics, a trainer log history) or an elastic-moe demo summary.json.")
    kappa.add_argument("files", nargs="+", metavar="FILE")
    kappa.add_argument("--out", default="diagnostics_out", help="output folder (default: diagnostics_out/)")
    kappa.set_defaults(diagnose_handler=_run_kappa)


def _single(spec: str, role: str) -> CheckpointSpec:
    specs = parse_checkpoint(spec)
    if len(specs) != 1:
        raise DiagnosticsError(f"{role} {spec!r} holds {len(specs)} runs ({', '.join(s.run for s in specs)}); "
                               f"pick one with DIR:RUN.")
    return specs[0]


def _run_compare(args: argparse.Namespace) -> int:
    specs = [spec for text in args.checkpoints for spec in parse_checkpoint(text)]
    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as error:
            raise DiagnosticsError(f"cannot load tokenizer {args.tokenizer!r}: {error}") from None
    tasks = [load_probe(path, tokenizer=tokenizer) for path in args.probe]
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):
        for index, task in enumerate(tasks):
            task.name = f"{index}:{task.name}"
    boundary_layers_value = None
    if args.boundary_layers is not None:
        try:
            boundary_layers_value = tuple(sorted(parse_layers(args.boundary_layers)))
        except ConfigError as error:
            raise DiagnosticsError(str(error)) from None
    for name in ("batch_size", "block_width", "cutoff_window"):
        if getattr(args, name) < 1:
            raise DiagnosticsError(f"--{name.replace('_', '-')} must be >= 1.")
    if args.seq_len is not None and args.seq_len < 2:
        raise DiagnosticsError("--seq-len must be >= 2.")
    settings = CompareSettings(
        k=args.k, sweep=_parse_sweep(args.topk_sweep), boundary=args.boundary, boundary_layers=boundary_layers_value,
        block_width=args.block_width, cutoff_window=args.cutoff_window,
        log_base=2.0 if args.js_base == "2" else math.e, batch_size=args.batch_size, seq_len=args.seq_len,
        max_sequences=args.max_sequences, all_pairs=args.all_pairs,
    )
    kappa = {}
    for file in args.kappa_metrics:
        kappa.update(load_kappa(file))
    with contextlib.ExitStack() as stack:
        models = load_models(specs, stack, args.dtype)
        # a live progress line only on a terminal; logs and captured output stay clean
        progress = (lambda text: print(f"\relastic-moe diagnose: {text}   ", end="", file=sys.stderr, flush=True)) \
            if sys.stderr.isatty() else None
        results = compare(models, tasks, settings, progress)
        if progress is not None:
            print(file=sys.stderr)
        kappa = {**demo_kappa_for(models), **kappa}
    out = Path(args.out)
    write_outputs(results, out, kappa, plots=not args.no_plots)
    print(json.dumps(results, indent=2) if args.json else format_report(results)
          + f"\n\nwrote {', '.join(results['files'])} to {out}/")
    return 0


def _run_swap(args: argparse.Namespace) -> int:
    donor, target = _single(args.router_from, "--router-from"), _single(args.into, "--into")
    record = router_swap(donor, target, args.out, args.layers, args.dtype)
    print(f"wrote {args.out}: routers of {donor.label} ({donor.path}) in layers {record['layers']} into "
          f"{target.label} ({target.path}); everything else is {target.label}'s.")
    return 0


def _run_kappa(args: argparse.Namespace) -> int:
    kappa = {}
    for file in args.files:
        kappa.update(load_kappa(file))
    out = Path(args.out)
    results = {"format": FORMAT, "pairs": {}, "topk_sweep": {}}
    files = write_outputs(results, out, kappa, plots=True)
    print(f"wrote {', '.join(files)} to {out}/")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return args.diagnose_handler(args)
    except DiagnosticsError as error:
        print(f"elastic-moe diagnose {args.diagnose_command}: error: {error}", file=sys.stderr)
        return 2
