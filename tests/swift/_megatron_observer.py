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
  megatron-core's module and in mcore-bridge's ``patcher``;
- with ``replay_stock=True``, each forward's line also compares the router's output with stock
  routing of the same input (:func:`_against_stock`), and says which router was built (score
  function, expert bias, q/k norms).
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


def _against_stock(module, inputs: tuple, probs, routing_map) -> dict:
    """Megatron-core's stock routing of this forward's input, replayed after the forward: the
    original ``TopKRouter.routing`` (the plugin's wrapper keeps it as ``__wrapped__``; without the
    plugin it is the method itself) on ``module.gating(input)``, the logits the forward routed (no
    input jitter or forced balancing is configured here). Gradients are off, so the replay records no
    aux loss and adds no expert-bias counts (megatron-core and mcore-bridge guard both on
    ``torch.is_grad_enabled()``), and it draws no random number: the run goes on as if unobserved.

    Returns ``stock_equal`` (the forward's weights and map equal stock's bit for bit) and, over the
    tokens routed to stock's k experts, how many kept stock's experts
    (``at_k_same_experts``) and the largest difference of their weights."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    stock = getattr(TopKRouter.routing, "__wrapped__", TopKRouter.routing)
    padding_mask = inputs[1] if len(inputs) > 1 else None
    with torch.no_grad():
        stock_probs, stock_map = stock(module, module.gating(inputs[0]), padding_mask=padding_mask)
        probs, routing_map = probs.detach(), routing_map.detach()
        at_k = routing_map.sum(dim=-1) == module.topk
        same = (routing_map == stock_map).all(dim=-1) & at_k
        difference = (probs[same] - stock_probs[same]).abs().max().item() if bool(same.any()) else 0.0
    return {
        "stock_equal": torch.equal(probs, stock_probs) and torch.equal(routing_map, stock_map),
        "at_k_same_experts": int(same.sum()),
        "at_k_max_weight_difference": difference,
        "score_function": module.score_function,
        "expert_bias": module.expert_bias is not None,
        "qk_layernorm": bool(module.config.qk_layernorm),
    }


def install(path: str, replay_stock: bool = False) -> None:
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
        record = {"layer": int(module.layer_number) - 1, "counts": counts, "checksum": checksum}
        if replay_stock:
            record.update(_against_stock(module, inputs, *output))
        write(record)

    torch.nn.modules.module.register_module_forward_hook(hook)
