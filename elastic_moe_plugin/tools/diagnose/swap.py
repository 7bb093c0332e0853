"""Router swap (paper Table 4): one checkpoint with another's routers, every other tensor its own.

Router tensors are the ``mlp.gate`` module state (transformers) or
``decoder.layers.<i>.mlp.router.*`` (Megatron demo state dicts). The output is a checkpoint of the
target's kind: a transformers folder (``save_pretrained`` plus the target's tokenizer files) or a
demo-format folder with one run ``swapped``; ``router_swap.json`` records donor, target and layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from elastic_moe_plugin.core.config import parse_layers
from elastic_moe_plugin.core.errors import ConfigError
from elastic_moe_plugin.tools.diagnose.checkpoints import CheckpointSpec, demo_config
from elastic_moe_plugin.tools.diagnose.compare import CompareSettings, check_compatible
from elastic_moe_plugin.tools.diagnose.errors import DiagnosticsError
from elastic_moe_plugin.tools.diagnose.models import HFRoutedModel, load_models

SWAP_FORMAT = "elastic-moe-router-swap/1"
_MEGATRON_ROUTER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.(.+)$")
#: files besides ``tokenizer*`` that travel with a transformers target: its tokenizer and generation defaults
_HF_EXTRA_FILES = ("special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json")


def select_router_layers(spec: str | None, num_layers: int, moe_layers: Sequence[int]) -> list[int]:
    """The 0-based layers named by ``spec`` (e.g. ``"3-7"``; None: every MoE layer).

    Raises:
        DiagnosticsError: a malformed spec, a layer outside the model, or a layer without a router.
    """
    if spec is None:
        return list(moe_layers)
    try:
        layers = sorted(parse_layers(spec))
    except ConfigError as error:
        raise DiagnosticsError(str(error)) from None
    outside = [layer for layer in layers if layer >= num_layers]
    if outside:
        raise DiagnosticsError(
            f"--layers {spec!r} selects layer(s) {outside}, but the model has {num_layers} layers "
            f"(0-based 0..{num_layers - 1})."
        )
    not_moe = [layer for layer in layers if layer not in set(moe_layers)]
    if not_moe:
        raise DiagnosticsError(
            f"--layers {spec!r} selects layer(s) {not_moe} without a router (MoE layers: {list(moe_layers)})."
        )
    return layers


def _swap_hf(donor: CheckpointSpec, target: CheckpointSpec, out_dir: Path, layers: str | None, dtype: str) -> list[int]:
    with contextlib.ExitStack() as stack:
        a, b = load_models([donor, dataclasses.replace(target, label=target.label + "#target")], stack, dtype)
        assert isinstance(a, HFRoutedModel) and isinstance(b, HFRoutedModel)  # what "hf" specs load as
        check_compatible([a, b], CompareSettings(k=b.info.topk))
        selected = select_router_layers(layers, b.info.num_layers, b.info.moe_layers)
        for layer in selected:
            source, sink = a.routers[layer].state_dict(), b.routers[layer].state_dict()
            if set(source) != set(sink) or any(source[n].shape != sink[n].shape for n in sink):
                raise DiagnosticsError(
                    f"layer {layer}: the routers' tensors differ ({sorted(source)} vs {sorted(sink)})."
                )
            b.routers[layer].load_state_dict(source)
        out_dir.mkdir(parents=True, exist_ok=True)
        b.model.save_pretrained(out_dir)
        for file in Path(target.path).iterdir():
            wanted = file.is_file() and (file.name.startswith("tokenizer") or file.name in _HF_EXTRA_FILES)
            if wanted and not (out_dir / file.name).exists():
                shutil.copy2(file, out_dir / file.name)
    return selected


def _check_demo_routers_interchangeable(
    donor: CheckpointSpec, target: CheckpointSpec, donor_transformer: dict[str, Any], target_transformer: dict[str, Any]
) -> None:
    for key, what in (
        ("num_moe_experts", "experts per layer"),
        ("num_layers", "layers"),
        ("hidden_size", "hidden size"),
    ):
        if donor_transformer[key] != target_transformer[key]:
            raise DiagnosticsError(
                f"{donor.label} has {donor_transformer[key]} {what} but {target.label} has "
                f"{target_transformer[key]}: their routers are not interchangeable."
            )


def _copy_router_tensors(donor_state: dict[str, Any], target_state: dict[str, Any], selected: Sequence[int]) -> None:
    """Replace the target's router entries of the ``selected`` layers by (copies of) the donor's, in place."""
    donor_keys = {key for key in donor_state if _MEGATRON_ROUTER_KEY.match(key)}
    target_layers = {key: int(match.group(1)) for key in target_state if (match := _MEGATRON_ROUTER_KEY.match(key))}
    if donor_keys != set(target_layers):
        raise DiagnosticsError(f"the router tensors differ: {sorted(donor_keys ^ set(target_layers))}.")
    for key in sorted(target_layers):
        if target_layers[key] in selected:
            donor_value, target_value = donor_state[key], target_state[key]
            # non-tensor entries (``_extra_state``: None) are taken over as they are
            if isinstance(donor_value, torch.Tensor) and isinstance(target_value, torch.Tensor):
                if donor_value.shape != target_value.shape:
                    raise DiagnosticsError(f"{key}: shape {tuple(donor_value.shape)} vs {tuple(target_value.shape)}.")
                donor_value = donor_value.clone()
            target_state[key] = donor_value


def _demo_config_of(spec: CheckpointSpec) -> dict[str, Any]:
    config = demo_config(Path(spec.path))
    assert config is not None, f"{spec.path}: a demo checkpoint's folder holds its model_config.json (parse_checkpoint)"
    return config


def _swap_demo(donor: CheckpointSpec, target: CheckpointSpec, out_dir: Path, layers: str | None) -> list[int]:
    donor_config, target_config = _demo_config_of(donor), _demo_config_of(target)
    target_transformer = target_config["transformer_config"]
    _check_demo_routers_interchangeable(donor, target, donor_config["transformer_config"], target_transformer)
    num_layers = int(target_transformer["num_layers"])
    selected = select_router_layers(layers, num_layers, range(num_layers))
    donor_state = torch.load(
        Path(donor.path) / donor_config["runs"][donor.run]["checkpoint"], map_location="cpu", weights_only=True
    )
    target_state = torch.load(
        Path(target.path) / target_config["runs"][target.run]["checkpoint"], map_location="cpu", weights_only=True
    )
    _copy_router_tensors(donor_state, target_state, selected)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(target_state, out_dir / "swapped.pt")
    config = dict(target_config)
    config["runs"] = {
        "swapped": dict(
            target_config["runs"][target.run],
            checkpoint="swapped.pt",
            router_swap={
                "router_from": f"{donor.path}:{donor.run}",
                "into": f"{target.path}:{target.run}",
                "layers": selected,
            },
        )
    }
    (out_dir / "model_config.json").write_text(json.dumps(config, indent=2))
    return selected


def router_swap(
    donor: CheckpointSpec,
    target: CheckpointSpec,
    out: str | os.PathLike[str],
    layers: str | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
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
        raise DiagnosticsError(
            f"router swap needs two checkpoints of one kind; got {donor.kind} ({donor.path}) and "
            f"{target.kind} ({target.path})."
        )
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DiagnosticsError(f"--out {str(out_dir)!r} exists and is not empty.")
    record: dict[str, Any] = {
        "format": SWAP_FORMAT,
        "router_from": dataclasses.asdict(donor),
        "into": dataclasses.asdict(target),
    }
    if target.kind == "hf":
        record["layers"] = _swap_hf(donor, target, out_dir, layers, dtype)
    else:
        record["layers"] = _swap_demo(donor, target, out_dir, layers)
    (out_dir / "router_swap.json").write_text(json.dumps(record, indent=2))
    return record
