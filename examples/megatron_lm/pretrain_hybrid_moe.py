"""Pretrain a hybrid model (attention, MLP, MoE and Mamba layers by pattern) with Megatron-LM's own
training loop, ``megatron.training``.

The twin of ``pretrain_gpt_moe.py`` for megatron-core 0.19's ``HybridModel``: the decoder is spelled
by ``--hybrid-layer-pattern``, one symbol per layer (``*`` attention, ``E`` MoE, ``-`` MLP, ``M``
Mamba, ``|`` a pipeline-stage boundary), so ``*E*E*E*E`` is 8 layers whose MoE layers are 1, 3, 5
and 7 (0-based: ``--elastic-moe-layers 3-5`` selects the MoE layers 3 and 5). Megatron builds the
model from the flags (``megatron.training.argument_utils.hybrid_config_from_args``: a
``HybridModelConfig`` whose builder calls ``HybridModel(config, hybrid_stack_spec, vocab_size,
max_sequence_length, hybrid_layer_pattern, ...)``); the layer modules are those of ``--spec MODULE
NAME``, by default Megatron's Transformer Engine stack spec. The data, the forward step and its loss
are those of ``pretrain_gpt_moe.py`` (next to this file), imported from it.

With Elastic Expert Routing (every rank; the ``--elastic-moe-*`` flags never reach Megatron)::

    torchrun --nproc-per-node 8 -m elastic_moe_plugin.megatron_lm examples/megatron_lm/pretrain_hybrid_moe.py \\
        --hybrid-layer-pattern "*E*E*E*E" <megatron args> --elastic-moe-schedule 6-10 [--elastic-moe-layers 3-5]

On a CPU-only machine, ``-m elastic_moe_plugin.megatron_lm --cpu examples/megatron_lm/pretrain_hybrid_moe.py
<megatron args>`` with the flags a CPU run needs (docs/megatron.md, "Megatron-LM on the CPU"); without ``--spec``,
``--cpu`` adds ``--spec elastic_moe_plugin.cpu_runtime.hybrid hybrid_stack_spec``, the CPU runtime's
local stack spec (no Mamba layers there: they need ``mamba_ssm``). ``tests/mcore/test_megatron_lm_hybrid.py``
runs it so, on 1 gloo rank.

Stock Megatron-LM, for comparison: ``torchrun --nproc-per-node 8 examples/megatron_lm/pretrain_hybrid_moe.py
<megatron args>``. Written for the ``megatron.training`` of megatron-core 0.19, whose ``pretrain``
takes a config container; megatron-core 0.16 has no ``HybridModel``. Context parallelism is refused,
as in ``pretrain_gpt_moe.py``.
"""

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import hybrid_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from pretrain_gpt_moe import datasets_provider, forward_step


def main() -> None:
    args = parse_and_validate_args()
    if args.hybrid_layer_pattern is None:
        raise SystemExit(f"{__file__}: pass --hybrid-layer-pattern (e.g. '*E*E*E*E'); for a GPT model use "
                         f"pretrain_gpt_moe.py.")
    if args.context_parallel_size > 1:
        raise SystemExit(f"{__file__}: --context-parallel-size={args.context_parallel_size} needs sequences split "
                         f"over the context-parallel ranks, which this script does not do; use 1.")
    # HybridModelConfig: the transformer config of the flags, the pattern, and the stack spec of --spec
    config = pretrain_cfg_container_from_args(args, hybrid_config_from_args(args))
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
