"""What the routers of a ``megatron sft`` process did, read from outside: a start-up observer.

``install(path)`` (called at interpreter start by the ``sitecustomize`` that
``test_megatron_sft.py`` writes for a run) registers one global module forward hook. It only reads:

- every training forward of a megatron-core ``TopKRouter`` (grad enabled, ``module.training``;
  mcore-bridge's subclass included) appends one JSON line to ``PATH.<RANK>.jsonl``: the 0-based
  global layer, the bincount of experts per token (``routing_map.sum(-1)``, the κ the token
  dispatcher receives) and ``checksum = Σ_t (t+1)·κ_t`` (equal checksums and counts for two runs:
  the same κ token by token, with overwhelming probability);
- at the first such forward, one line ``{"te": ...}``: ``HAVE_TE`` of every loaded ``megatron.*``
  module that has one, whether ``transformer_engine`` is in ``sys.modules``, megatron-core's cached
  TE version, the stand-ins the CPU runtime served, and which class ``TEGroupedLinear`` is in
  megatron-core's module and in mcore-bridge's ``patcher``.
"""

from __future__ import annotations

import json
import os
import sys

_STATE = {"reported": False}


def _te_report() -> dict:
    have_te = {name: bool(module.HAVE_TE) for name, module in sorted(sys.modules.items())
               if name.startswith("megatron.") and module is not None and isinstance(getattr(module, "HAVE_TE", None), bool)}
    utils = sys.modules.get("megatron.core.utils")
    extensions = sys.modules.get("megatron.core.extensions.transformer_engine")
    patcher = sys.modules.get("mcore_bridge.patcher")
    served = []
    runtime = sys.modules.get("elastic_moe_plugin.cpu_runtime.megatron_swift")
    if runtime is not None:
        served = runtime.served_stand_ins()
    return {
        "have_te": have_te,
        "transformer_engine_in_sys_modules": "transformer_engine" in sys.modules,
        "megatron_te_version": repr(getattr(utils, "_te_version", None)),
        "served": served,
        "megatron_TEGroupedLinear": repr(getattr(extensions, "TEGroupedLinear", "absent")),
        "bridge_TEGroupedLinear": repr(getattr(patcher, "TEGroupedLinear", "absent")),
    }


def install(path: str) -> None:
    import torch

    target = f"{path}.{os.environ.get('RANK', '0')}.jsonl"

    def write(record: dict) -> None:
        with open(target, "a") as sink:
            sink.write(json.dumps(record) + "\n")

    def hook(module, inputs, output):
        router = sys.modules.get("megatron.core.transformer.moe.router")
        if router is None or not isinstance(module, router.TopKRouter):
            return
        if not (module.training and torch.is_grad_enabled()):
            return
        if not _STATE["reported"]:
            _STATE["reported"] = True
            write({"te": _te_report()})
        kappa = output[1].sum(dim=-1).long()  # routing_map [T, E] -> experts per token
        counts = torch.bincount(kappa, minlength=module.config.num_moe_experts + 1).tolist()
        checksum = int((kappa * torch.arange(1, kappa.numel() + 1)).sum())
        write({"layer": int(module.layer_number) - 1, "counts": counts, "checksum": checksum})

    torch.nn.modules.module.register_module_forward_hook(hook)
