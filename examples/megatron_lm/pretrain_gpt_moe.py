"""Pretrain a GPT model (dense or MoE) with Megatron-LM's own training loop, ``megatron.training``.

The kind of script Megatron-LM users write around ``megatron.training.pretrain``: Megatron's
argument parser and ``validate_args``, ``initialize_megatron``, its GPT model builder
(``megatron/training/models/gpt.py``, from the flags: ``--num-layers``, ``--num-experts``,
``--moe-router-topk``, ...), ``train_step``, ``training_log`` and checkpointing; the data are
Megatron's GPT datasets (``--data-path`` for indexed data, ``--mock-data`` for synthetic tokens).
The script itself holds only what a training script must supply: a dataset provider and a forward
step with its loss.

With Elastic Expert Routing (every rank; the ``--elastic-moe-*`` flags never reach Megatron)::

    torchrun --nproc-per-node 8 -m elastic_moe_plugin.megatron_lm examples/megatron_lm/pretrain_gpt_moe.py \\
        <megatron args> --elastic-moe-schedule 6-10 [--elastic-moe-layers 3-7]

On a CPU-only machine, ``-m elastic_moe_plugin.megatron_lm --cpu examples/megatron_lm/pretrain_gpt_moe.py
<megatron args>`` with the flags a CPU run needs (docs/megatron.md, "Megatron-LM on the CPU");
``tests/mcore/test_megatron_lm.py`` runs it so, on 1 and 2 gloo ranks (TP=2 with sequence parallelism).

Stock Megatron-LM, for comparison: ``torchrun --nproc-per-node 8 examples/megatron_lm/pretrain_gpt_moe.py
<megatron args>``. Written for the ``megatron.training`` of megatron-core 0.19, whose ``pretrain``
takes a config container; that package needs Python 3.12 (on 3.11 with the wheel, enable
``elastic_moe_plugin.cpu_runtime.megatron_training`` first; ``--cpu`` does).

Data layout: every rank of the first and last pipeline stage builds the dataset (the same samples
from the same seed), so tensor-parallel peers need no broadcast of the batch. Context parallelism
needs sequences split over its ranks, which this script does not do: it refuses
``--context-parallel-size > 1``.
"""

from functools import partial

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils.common_utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def datasets_provider(num_samples, vp_stage=None):
    """(train, valid, test) GPT datasets of ``num_samples`` = (train, valid, test) sequences each."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_class.__name__} train/valid/test splits ...")
    return BlendedMegatronDatasetBuilder(
        dataset_class, num_samples, lambda: is_first_or_last_pipeline_stage(vp_stage), config
    ).build()


# Megatron's data pipeline asks every rank for its own iterator (core datasets are distributed-aware).
datasets_provider.is_distributed = True


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch on its device: tokens, labels, loss_mask [B, S], attention_mask, position_ids."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * len(BATCH_KEYS)  # middle stages receive activations, not tokens
    batch = next(data_iterator)
    device = torch.cuda.current_device()
    return tuple(batch[key].to(device, non_blocking=True) if batch.get(key) is not None else None for key in BATCH_KEYS)


def loss_func(loss_mask, output_tensor):
    """Sum of the token losses where ``loss_mask`` is 1, that token count, and the logged ``lm loss``."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch through the model; Megatron's schedule calls the returned loss function."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, getattr(model, "vp_stage", None))
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def main() -> None:
    args = parse_and_validate_args()
    if args.context_parallel_size > 1:
        raise SystemExit(f"{__file__}: --context-parallel-size={args.context_parallel_size} needs sequences split "
                         f"over the context-parallel ranks, which this script does not do; use 1.")
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
