"""What Megatron-LM's command line already decides, checked before the training script runs.

``python -m elastic_moe_plugin.megatron_lm SCRIPT ARGS`` knows every Megatron-LM flag before
Megatron parses them, initialises torch.distributed and builds the model (``initialize_megatron``:
tens of seconds on a loaded CPU, minutes of allocation on a cluster). The refusals those flags
decide are raised here, at once, with the rules the router applies when it is built
(:func:`elastic_moe_plugin.mcore.options.check_model_options`: one rule, two call sites):

- the schedule and its centre against ``--moe-router-topk`` and ``--num-experts``, the layer
  range against ``--num-layers``, or against ``--hybrid-layer-pattern``, where it must also select
  one of the pattern's MoE (``E``) layers (:class:`~elastic_moe_plugin.core.errors.ConfigError`,
  every fix validated against that model);
- options that fix the top-k (``--moe-enable-routing-replay``, ``--moe-router-load-balancing-type
  sinkhorn`` / ``quantile_balancing``, ``--transformer-impl inference_optimized``,
  ``--batch-invariant-mode``, ``--moe-apply-probs-on-input``), a CUDA graph that captures the
  router (:mod:`.graph_options`), group-limited routing too narrow for the schedule
  (:class:`~elastic_moe_plugin.core.errors.UnsupportedMegatronError`). ``--moe-router-fusion`` is
  accepted: static layers and evaluation keep the fused top-k.

The flags are read by a parser of these flags alone, with Megatron-LM's names, types and defaults
(``tests/mcore/test_megatron_args.py`` compares them with ``TransformerConfig`` and Megatron-LM's own
parser), so nothing imports megatron here. Where the command line does not decide the model (no
``--num-experts``: the script may set it through ``args_defaults``; ``--yaml-cfg``;
``--use-checkpoint-args``; a heterogeneous-layers config), nothing is checked here and the router
checks run at model build as before.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Sequence

from elastic_moe_plugin.core.config import ElasticConfig, ModelShape
from elastic_moe_plugin.mcore import hybrid_pattern
from elastic_moe_plugin.mcore.options import MEGATRON_LM_FLAGS, check_model_options

#: flags that make the command line's model options not final: the check leaves them to model build
UNDECIDED_BY = (
    "--yaml-cfg",
    "--use-checkpoint-args",
    "--heterogeneous-layers-config-path",
    "--heterogeneous-layers-config-encoded-json",
)
#: flags that spell the decoder as a hybrid pattern: the layers and which of them are MoE come from it
#: (:mod:`.hybrid_pattern`), and ``--num-layers`` is ignored, as Megatron-LM ignores it
LAYERS_DERIVED_BY = ("--hybrid-layer-pattern", "--hybrid-override-pattern")


def _parser() -> argparse.ArgumentParser:
    """Megatron-LM's flags for the options the checks read; ``dest`` is the ``TransformerConfig``
    attribute (``--num-experts`` sets ``num_moe_experts``), defaults are Megatron-LM's."""
    # Megatron-LM's parser has allow_abbrev=False too; a bad value is Megatron-LM's own parser's to refuse
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add = parser.add_argument
    add("--num-experts", dest="num_moe_experts", type=int, default=None)
    add("--moe-router-topk", dest="moe_router_topk", type=int, default=2)
    add("--num-layers", dest="num_layers", type=int, default=None)
    add("--hybrid-layer-pattern", dest="hybrid_layer_pattern", default=None)
    add("--hybrid-override-pattern", dest="hybrid_override_pattern", default=None)
    add("--moe-router-load-balancing-type", dest="moe_router_load_balancing_type", nargs="+", default="aux_loss")
    add("--moe-router-score-function", dest="moe_router_score_function", default="softmax")
    add("--moe-router-fusion", dest="moe_router_fusion", action="store_true")
    add("--moe-enable-routing-replay", dest="moe_enable_routing_replay", action="store_true")
    add("--transformer-impl", dest="transformer_impl", default="transformer_engine")
    add("--moe-router-num-groups", dest="moe_router_num_groups", type=int, default=None)
    add("--moe-router-group-topk", dest="moe_router_group_topk", type=int, default=None)
    add("--moe-token-dispatcher-type", dest="moe_token_dispatcher_type", default="allgather")
    add("--moe-pad-expert-input-to-capacity", dest="moe_pad_expert_input_to_capacity", action="store_true")
    add("--cuda-graph-impl", dest="cuda_graph_impl", default="none")
    add("--cuda-graph-modules", dest="cuda_graph_modules", nargs="+", default=None)
    add("--cuda-graph-scope", dest="cuda_graph_scope", nargs="+", default=None)
    add("--inference-cuda-graph-scope", dest="inference_cuda_graph_scope", default=None)
    add("--enable-cuda-graph", dest="enable_cuda_graph", action="store_true")  # deprecated: local
    add("--external-cuda-graph", dest="external_cuda_graph", action="store_true")  # deprecated: transformer_engine
    add("--is-hybrid-model", dest="is_hybrid_model", action="store_true")
    add("--batch-invariant-mode", dest="batch_invariant_mode", action="store_true")
    add("--moe-apply-probs-on-input", dest="moe_apply_probs_on_input", action="store_true")
    return parser


def megatron_options(megatron_args: Sequence[str]) -> types.SimpleNamespace | None:
    """The model options ``megatron_args`` decide, under ``TransformerConfig``'s attribute names, or
    None where the command line does not decide the model (module docstring)."""
    words = [word.split("=", 1)[0] for word in megatron_args]
    if any(flag in words for flag in UNDECIDED_BY):
        return None
    try:
        known, _ = _parser().parse_known_args(list(megatron_args))
    except argparse.ArgumentError:  # a value Megatron-LM's own parser will refuse, with its own message
        return None
    if known.num_moe_experts is None:
        return None
    balancing = known.moe_router_load_balancing_type
    if isinstance(balancing, list) and len(balancing) == 1:  # as Megatron-LM's validate_args reduces it
        known.moe_router_load_balancing_type = balancing[0]
    known.moe_layers = None
    if any(flag in words for flag in LAYERS_DERIVED_BY):
        layers = hybrid_pattern.parse(hybrid_pattern.pattern_of(known) or "")
        known.num_layers = None if layers is None else layers.num_layers
        known.moe_layers = None if layers is None else layers.moe_layers
    if known.cuda_graph_modules is None:  # megatron-core 0.19 migrates --cuda-graph-scope into the modules
        known.cuda_graph_modules = known.cuda_graph_scope or []
    return types.SimpleNamespace(**vars(known))


def model_shape(megatron_args: Sequence[str]) -> ModelShape | None:
    """The model an ElasticConfig meets, as ``megatron_args`` decide it (None: not decided)."""
    options = megatron_options(megatron_args)
    if options is None:
        return None
    return ModelShape(options.moe_router_topk, options.num_moe_experts, options.num_layers, options.moe_layers)


def check_megatron_args(config: ElasticConfig, megatron_args: Sequence[str]) -> None:
    """Refuse, before Megatron starts, what the router would refuse at model build (module docstring).

    Raises:
        ConfigError: the schedule, its centre or the layers do not fit the model of the flags.
        UnsupportedMegatronError: every flag that cannot route per-token budgets, in one message.
    """
    options = megatron_options(megatron_args)
    if options is None or not config.enabled:
        return
    if options.moe_layers is not None:  # a hybrid pattern: `layers` must select one of its MoE layers
        config.resolve(
            num_experts=options.num_moe_experts,
            topk=options.moe_router_topk,
            num_layers=options.num_layers,
            moe_layers=options.moe_layers,
        )
    check_model_options(
        options,
        config,
        score_function=options.moe_router_score_function,
        routing_type=options.moe_router_load_balancing_type,
        options=MEGATRON_LM_FLAGS,
        num_layers=options.num_layers,
    )


__all__ = ["LAYERS_DERIVED_BY", "UNDECIDED_BY", "check_megatron_args", "megatron_options", "model_shape"]
