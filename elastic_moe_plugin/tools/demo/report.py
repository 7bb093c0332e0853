"""The demo's outputs as data and text: ``model_config.json``, ``summary.json`` and the table.

``summary["runs"][name]`` is :func:`~elastic_moe_plugin.tools.demo.train.train_run`'s
measurements; per-layer entries are keyed by the 0-based layer index as a string. The table puts
the static run and the elastic run side by side: losses, the inference top-k' sweep, the realised
mean κ, the exposure P(κ ≥ r) against the schedule's survival a(r), tokens-per-expert imbalance
max/mean, the load-balancing loss, throughput and wall time.
"""

from __future__ import annotations

import dataclasses
import math
import platform
from pathlib import Path
from typing import Any

import torch

from elastic_moe_plugin.core.schedule import BudgetSchedule
from elastic_moe_plugin.tools.demo.corpus import Corpus
from elastic_moe_plugin.tools.demo.device import device_entry
from elastic_moe_plugin.tools.demo.settings import FORMAT, PAPER_NOTE, DemoSettings


def model_config_file(
    config: dict[str, Any],
    settings: DemoSettings,
    corpus: Corpus,
    results: dict[str, dict[str, Any]],
    mcore_version: str,
) -> dict[str, Any]:
    """``model_config.json``: :func:`~elastic_moe_plugin.tools.demo.model.model_config` plus the
    runs' checkpoints and what :func:`~elastic_moe_plugin.tools.demo.model.load_trained` needs."""
    config_file = dict(config)
    config_file.update(
        format=FORMAT,
        seq_len=settings.seq_len,
        data=corpus.to_dict(),
        seed=settings.seed,
        megatron_core=mcore_version,
        **device_entry(settings.device),
        runs={
            name: {"checkpoint": f"{name}.pt", "elastic_config": results[name]["elastic_config"]} for name in results
        },
        how_to_load="elastic_moe_plugin.tools.demo.load_trained(out_dir, 'static' | 'elastic') after "
        "cpu_runtime.enable(); cpu_runtime.initialize_model_parallel() (the checkpoints hold CPU tensors, "
        "whatever the device trained on)",
    )
    return config_file


def build_summary(
    settings: DemoSettings,
    corpus: Corpus,
    schedule: BudgetSchedule,
    results: dict[str, dict[str, Any]],
    parameters: int,
    mcore_version: str,
    out: Path,
) -> dict[str, Any]:
    """``summary.json`` without ``files`` and ``wall_time_s`` (known only once everything is written)."""
    return {
        "format": FORMAT,
        "settings": dataclasses.asdict(settings) | {"tokens": settings.tokens},
        "versions": {"megatron_core": mcore_version, "torch": torch.__version__, "python": platform.python_version()},
        **device_entry(settings.device),
        "torch_threads": torch.get_num_threads(),
        "parameters": parameters,
        "data": corpus.to_dict(),
        "schedule": {
            "spec": schedule.spec(),
            "center": schedule.center,
            "sigma": schedule.sigma,
            "budgets": list(schedule.budgets),
            "pmf": list(schedule.pmf),
            "survival": list(schedule.exposure(max(schedule.high, settings.topk) + 1)),
        },
        "runs": results,
        "heldout_delta_elastic_minus_static": results["elastic"]["heldout_loss"] - results["static"]["heldout_loss"],
        "note": PAPER_NOTE,
        "out_dir": str(out),
    }


_COLUMN = 17


def _row(label: str, static: str, elastic: str) -> str:
    return f"  {label:<40}{static:>{_COLUMN}}{elastic:>{_COLUMN}}"


def _number(x: float | None, fmt: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _header_lines(summary: dict[str, Any]) -> list[str]:
    s, elastic = summary["settings"], summary["runs"]["elastic"]
    k, elastic_layers = s["topk"], elastic["elastic_layers"]
    head = f"elastic {elastic['schedule']}" if elastic["schedule"] != "static" else "elastic (static)"
    return [
        f"elastic-moe demo: tiny Megatron-core MoE GPT on {summary.get('device', 'cpu').upper()} "
        f"(megatron-core {summary['versions']['megatron_core']}, "
        f"torch {summary['versions']['torch']})",
        f"  model   {s['num_layers']} layers, hidden {s['hidden_size']}, {s['num_experts']} experts "
        f"(ffn {s['expert_ffn_hidden_size']}), top-{k}, MoE in every layer, allgather dispatcher, "
        f"aux loss {s['aux_loss_coeff']:g}, {summary['parameters']:,} parameters",
        f"  data    {summary['data']['description']}",
        f"  budget  {s['tokens']:,} tokens per run ({s['steps']} steps x {s['batch_size']} x {s['seq_len']}), "
        f"seed {s['seed']}, AdamW lr {s['lr']:g}, {summary['torch_threads']} torch thread(s)",
        f"  elastic schedule {elastic['schedule']} around k={k} (sigma={s['sigma']:g}), elastic layers "
        f"{', '.join(map(str, elastic_layers)) if elastic_layers else 'none'}; "
        f"inference is static top-{k} in both runs",
        "",
        _row("", "static", head),
    ]


def _loss_lines(summary: dict[str, Any]) -> list[str]:
    static, elastic = summary["runs"]["static"], summary["runs"]["elastic"]
    k = summary["settings"]["topk"]
    lines = [
        _row(
            f"final train loss (last {static['final_train_loss_steps']} steps)",
            _number(static["final_train_loss"]),
            _number(elastic["final_train_loss"]),
        ),
        _row(f"held-out loss (static top-{k})", _number(static["heldout_loss"]), _number(elastic["heldout_loss"])),
        "  held-out loss, inference top-k' sweep:",
    ]
    for kk in static["topk_sweep"]:
        mark = "  <- trained k" if int(kk) == k else ""
        lines.append(
            _row(f"    top-{kk}", _number(static["topk_sweep"][kk]), _number(elastic["topk_sweep"][kk])) + mark
        )
    return lines


def _routing_lines(summary: dict[str, Any]) -> list[str]:
    static, elastic = summary["runs"]["static"], summary["runs"]["elastic"]
    k, layers = summary["settings"]["topk"], range(summary["settings"]["num_layers"])
    elastic_layers = elastic["elastic_layers"]
    col = _COLUMN
    lines = ["  realised mean κ per layer (training):"]
    for layer in layers:
        st, el = static["kappa"][str(layer)], elastic["kappa"][str(layer)]
        tag = "elastic" if el["elastic"] else "static"
        lines.append(_row(f"    layer {layer} ({tag})", _number(st["mean"]), _number(el["mean"])))
    if elastic_layers:
        ranks = len(elastic["exposure"]["0"]["observed"])
        lines.append("  exposure P(κ ≥ r), elastic run, mean over elastic layers vs the schedule's survival:")
        lines.append(f"  {'    rank r':<40}{'observed':>{col}}{'schedule':>{col}}{'static step':>{col}}")
        for r in range(1, ranks + 1):
            observed = _mean(elastic["exposure"][str(layer)]["observed"][r - 1] for layer in elastic_layers)
            expected = elastic["exposure"][str(elastic_layers[0])]["schedule"][r - 1]
            lines.append(f"  {'    ' + str(r):<40}{observed:>{col}.4f}{expected:>{col}.4f}{float(r <= k):>{col}.0f}")
    window = static["imbalance"]["train_window_steps"]
    lines.append(f"  tokens-per-expert imbalance max/mean (training, last {window} steps):")
    for layer in layers:
        lines.append(
            _row(
                f"    layer {layer}",
                _number(static["imbalance"]["train"][str(layer)], ".2f"),
                _number(elastic["imbalance"]["train"][str(layer)], ".2f"),
            )
        )
    lines.append(
        _row(
            f"    held-out, top-{k}, mean over layers",
            _number(_mean(static["imbalance"]["heldout"].values()), ".2f"),
            _number(_mean(elastic["imbalance"]["heldout"].values()), ".2f"),
        )
    )
    lines.append(
        _row(
            "load-balancing loss (mean/layer)",
            _number(_mean(static["aux_loss"].values())),
            _number(_mean(elastic["aux_loss"].values())),
        )
    )
    return lines


def _footer_lines(summary: dict[str, Any]) -> list[str]:
    static, elastic = summary["runs"]["static"], summary["runs"]["elastic"]
    k, seed = summary["settings"]["topk"], summary["settings"]["seed"]
    delta = elastic["heldout_loss"] - static["heldout_loss"]
    return [
        _row(
            "train throughput (tokens/s)",
            _number(static["tokens_per_s"], ",.0f"),
            _number(elastic["tokens_per_s"], ",.0f"),
        ),
        _row("wall time (s)", _number(static["wall_time_s"], ".1f"), _number(elastic["wall_time_s"], ".1f")),
        "",
        f"  measured: held-out loss at top-{k}, elastic - static = {delta:+.4f} "
        f"({'elastic lower' if delta < 0 else 'static lower' if delta > 0 else 'equal'}), seed {seed}, "
        f"total wall time {summary['wall_time_s']:.1f} s.",
        "  Training losses are under each run's own training routing (elastic: sampled κ); every held-out "
        "loss uses static routing.",
        "  " + PAPER_NOTE,
        f"  files: {summary['out_dir']}/ ({', '.join(summary['files'])})",
    ]


def format_table(summary: dict[str, Any]) -> str:
    """The side-by-side table ``elastic-moe demo`` prints (``summary`` as in ``summary.json``)."""
    return "\n".join(_header_lines(summary) + _loss_lines(summary) + _routing_lines(summary) + _footer_lines(summary))
