"""Offline routing diagnostics of trained MoE checkpoints (paper §4.5-4.6, §6; docs/diagnostics.md).

- :mod:`~elastic_moe_plugin.tools.diagnose.probe`: probe files -> token-id windows -> padded batches.
- :mod:`~elastic_moe_plugin.tools.diagnose.checkpoints`: ``[LABEL=]PATH`` -> checkpoint specs.
- :mod:`~elastic_moe_plugin.tools.diagnose.models`: loaded checkpoints that also return each MoE
  layer's router logits (transformers; Megatron demo checkpoints on the CPU).
- :mod:`~elastic_moe_plugin.tools.diagnose.divergence`: JS, D1, Dk, reorders and rank retention
  of two routers on the same tokens.
- :mod:`~elastic_moe_plugin.tools.diagnose.compare`: the streaming pass over probe tasks, the
  per-pair summaries and the inference top-k sweep.
- :mod:`~elastic_moe_plugin.tools.diagnose.kappa`: realised κ histograms and the schedule's pmf.
- :mod:`~elastic_moe_plugin.tools.diagnose.swap`: router swap between two checkpoints of one kind.
- :mod:`~elastic_moe_plugin.tools.diagnose.report` and :mod:`~elastic_moe_plugin.tools.diagnose.plots`:
  ``diagnostics.json``, CSVs, PNGs and the text report.

The command line is :mod:`elastic_moe_plugin.cli.diagnose`.
"""

from __future__ import annotations

from elastic_moe_plugin.tools.diagnose.checkpoints import CheckpointSpec, parse_checkpoint
from elastic_moe_plugin.tools.diagnose.compare import (
    FORMAT,
    CompareSettings,
    boundary_layers,
    check_compatible,
    compare,
    peak_block,
    summarize_pair,
)
from elastic_moe_plugin.tools.diagnose.divergence import PairAccumulator, js_divergence, pair_token_sums
from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError
from elastic_moe_plugin.tools.diagnose.kappa import demo_kappa_for, load_kappa
from elastic_moe_plugin.tools.diagnose.models import (
    HFRoutedModel,
    MegatronDemoModel,
    ModelInfo,
    RoutedModel,
    load_models,
    megatron_session,
)
from elastic_moe_plugin.tools.diagnose.probe import ProbeTask, chunk_sequences, load_probe, probe_batches
from elastic_moe_plugin.tools.diagnose.report import format_report, write_outputs
from elastic_moe_plugin.tools.diagnose.swap import router_swap, select_router_layers

__all__ = [
    "FORMAT",
    "CheckpointSpec",
    "CompareSettings",
    "DiagnosticsError",
    "HFRoutedModel",
    "MegatronDemoModel",
    "ModelInfo",
    "PairAccumulator",
    "ProbeTask",
    "RoutedModel",
    "boundary_layers",
    "check_compatible",
    "chunk_sequences",
    "compare",
    "demo_kappa_for",
    "format_report",
    "js_divergence",
    "load_kappa",
    "load_models",
    "load_probe",
    "megatron_session",
    "pair_token_sums",
    "parse_checkpoint",
    "peak_block",
    "probe_batches",
    "router_swap",
    "select_router_layers",
    "summarize_pair",
    "write_outputs",
]
