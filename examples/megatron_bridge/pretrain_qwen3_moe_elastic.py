"""Qwen3-30B-A3B pretraining from a Megatron-Bridge recipe, with Elastic Expert Routing.

Megatron-Bridge (``pip install megatron-bridge``: 0.4 or later, Python 3.12) builds megatron-core
models from a recipe's model provider, inside ``pretrain()``; its routers are megatron-core
``TopKRouter``s, so ``mcore.apply`` before ``pretrain()`` makes them elastic. Run on every rank::

    torchrun --nproc-per-node 8 examples/megatron_bridge/pretrain_qwen3_moe_elastic.py \\
        --elastic-moe-schedule 6-10 --elastic-moe-layers 3-7 \\
        model.expert_model_parallel_size=8 train.train_iters=500 logger.log_interval=10

The ``--elastic-moe-*`` flags are this script's (the same ``ElasticConfig`` flags as
``python -m elastic_moe_plugin.megatron_lm``); everything after them is Bridge's ``key=value``
overrides of the recipe. Written against Megatron-Bridge 0.6 (``megatron.bridge.recipes``,
``training.pretrain``, ``training.callbacks``); not run in this repository's CI, which has Python 3.11
(docs/megatron.md, "Megatron-Bridge"; ``scripts/gpu_check.sh`` runs it where Bridge is installed).
"""

import argparse

from megatron.bridge.recipes.qwen.qwen3_moe import qwen3_30b_a3b_pretrain_config
from megatron.bridge.training.callbacks import Callback
from megatron.bridge.training.gpt_step import forward_step
from megatron.bridge.training.pretrain import pretrain
from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

from elastic_moe_plugin import mcore
from elastic_moe_plugin.core.config import ModelShape, add_cli_arguments, config_from_cli
from elastic_moe_plugin.mcore.graph_options import ROUTER_SCOPES


class RoutingMetrics(Callback):
    """Bridge's own training loop logs its aux losses only: add the routing metrics at its log steps."""

    def on_train_step_end(self, context):
        state = context.state
        step = state.train_state.step + 1  # Bridge counts the step after this event
        if step % state.cfg.logger.log_interval == 0:  # on every rank: the report all-reduces
            mcore.log_routing_metrics(context.model, step, state.tensorboard_logger, state.wandb_logger)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_arguments(parser, prefix="--elastic-moe-")
    known, overrides = parser.parse_known_args()

    cfg = qwen3_30b_a3b_pretrain_config()  # a ConfigContainer: reads the model's config, builds nothing
    process_config_with_overrides(cfg, cli_overrides=overrides)
    model = cfg.model  # a megatron-core TransformerConfig with a provide()
    # The recipe graphs the router (scopes moe_router, moe_preprocess): a replay would reuse the κ of
    # its capture, so graph the attention only. Its moe_router_fusion stays: static layers and
    # evaluation keep the fused top-k.
    scopes = [getattr(scope, "name", scope) for scope in model.cuda_graph_scope or []]
    if model.cuda_graph_impl != "none" and set(scopes) & set(ROUTER_SCOPES):
        model.cuda_graph_scope = [scope for scope in scopes if scope not in ROUTER_SCOPES] or ["attn"]

    # checked against the recipe's model here, before any GPU work (a ConfigError names the fix)
    shape = ModelShape(model.moe_router_topk, model.num_moe_experts, model.num_layers)
    elastic = config_from_cli(known, model=shape)
    mcore.apply(elastic)  # before pretrain(): its setup has the provider build the routers
    pretrain(cfg, forward_step, callbacks=[RoutingMetrics()])


if __name__ == "__main__":
    main()
