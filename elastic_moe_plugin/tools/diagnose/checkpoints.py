"""Checkpoint specs of ``elastic-moe diagnose``: ``[LABEL=]PATH`` -> what to load, without loading it.

A spec is a transformers folder (``config.json``) or one run of an ``elastic-moe demo`` output
folder (``model_config.json`` with ``format: elastic-moe-demo/*`` and a ``runs`` table naming each
run's ``.pt`` state dict).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError

DEMO_FORMAT_PREFIX = "elastic-moe-demo/"


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    label: str
    kind: str  # "hf" | "megatron-demo"
    path: str
    run: str | None = None


def demo_config(folder: Path) -> dict[str, Any] | None:
    """The demo's ``model_config.json`` in ``folder``, or None when ``folder`` is no demo output."""
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


def _split_label(spec: str) -> tuple[str | None, str]:
    # a path that itself contains '=' wins over the LABEL=PATH reading
    if "=" in spec and not Path(spec).exists():
        label, path = spec.split("=", 1)
        return label, path
    return None, spec


def _run_of_checkpoint_file(file: Path, path: str) -> tuple[Path, str]:
    """``DEMO_DIR/<checkpoint>.pt`` -> (DEMO_DIR, the run whose checkpoint it is)."""
    config = demo_config(file.parent)
    if config is None:
        raise DiagnosticsError(f"{path}: a .pt checkpoint needs the demo's model_config.json next to it.")
    runs = [name for name, entry in config["runs"].items() if entry.get("checkpoint") == file.name]
    if not runs:
        raise DiagnosticsError(f"{path}: model_config.json lists no run with checkpoint {file.name!r}.")
    return file.parent, runs[0]


def _demo_specs(folder: Path, config: dict[str, Any], run: str | None, label: str | None) -> list[CheckpointSpec]:
    runs = list(config["runs"]) if run is None else [run]
    for name in runs:
        if name not in config["runs"]:
            raise DiagnosticsError(
                f"{folder}: no run {name!r} in model_config.json (runs: {', '.join(config['runs'])})."
            )
        if not (folder / config["runs"][name]["checkpoint"]).is_file():
            raise DiagnosticsError(f"{folder}: checkpoint file {config['runs'][name]['checkpoint']!r} is missing.")
    if label is not None and len(runs) > 1:
        return [CheckpointSpec(f"{label}-{name}", "megatron-demo", str(folder), name) for name in runs]
    return [CheckpointSpec(label or name, "megatron-demo", str(folder), name) for name in runs]


def parse_checkpoint(spec: str) -> list[CheckpointSpec]:
    """``[LABEL=]PATH`` -> checkpoint specs; a demo folder without a run expands to all its runs.

    PATH is a transformers folder (``config.json``), a demo folder (``model_config.json`` with
    ``format: elastic-moe-demo/*``), ``DEMO_DIR:RUN`` or ``DEMO_DIR/<checkpoint>.pt``.
    """
    label, path = _split_label(spec)
    candidate = Path(path)
    run = None
    if not candidate.exists() and ":" in path:
        head, _, tail = path.rpartition(":")
        if Path(head).is_dir():
            candidate, run = Path(head), tail
    if candidate.is_file() and candidate.suffix in (".pt", ".pth"):
        candidate, run = _run_of_checkpoint_file(candidate, path)
    if not candidate.exists():
        raise DiagnosticsError(f"checkpoint {path!r} does not exist.")
    if not candidate.is_dir():
        raise DiagnosticsError(f"checkpoint {path!r} is not a folder (a transformers checkpoint or a demo output).")
    demo = demo_config(candidate)
    if demo is not None:
        return _demo_specs(candidate, demo, run, label)
    if (candidate / "config.json").is_file():
        return [CheckpointSpec(label or candidate.name, "hf", str(candidate))]
    raise DiagnosticsError(
        f"{path}: neither a transformers checkpoint (config.json) nor an elastic-moe demo output (model_config.json)."
    )
