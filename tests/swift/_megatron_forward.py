"""Megatron's forward of a Megatron-SWIFT checkpoint, built and loaded the way ``megatron export`` does.

    python _megatron_forward.py OUT.pt MEGATRON_EXPORT_FLAGS...    # a single rank: RANK=0 WORLD_SIZE=1 MASTER_*

Parses the flags with ms-swift 4.6's own ``MegatronExportArguments`` (which re-reads the
checkpoint's ``args.json``, and so re-imports the plugin file it was trained with), prepares the
template, builds the model with ``swift.megatron.model.get_mcore_model`` (mcore-bridge), loads the
checkpoint with ``swift.megatron.utils.load_mcore_checkpoint`` (the calls of
``MegatronExport.convert_mcore2hf``), and runs one eval-mode, no-grad forward of a fixed batch.
Saves ``{"input_ids": [2, 48], "logits": [2, 48, vocab]}`` (float32) to OUT.pt. Run under the CPU
runtime (the bootstrap on ``PYTHONPATH``) with ``ELASTIC_MOE_SCHEDULE=static``: a static forward.

``megatron export --test_convert_precision true`` would compare the two models itself, but with
transformers 5.19 it cannot build the Hugging Face side in the same process (mcore-bridge 1.6.5
replaces transformers' default RoPE initialiser with one that reads ``config.rope_theta``, which a
5.19 ``Qwen3MoeConfig`` does not have), hence this forward and ``_hf_logits.py``.
"""

import sys

import torch

VOCAB, BATCH, LENGTH, SEED = 384, 2, 48, 0


def main(out: str, argv: list[str]) -> None:
    from swift.megatron.arguments import MegatronExportArguments
    from swift.megatron.model import get_mcore_model
    from swift.megatron.utils import load_mcore_checkpoint
    from swift.pipelines import prepare_model_template
    from swift.utils import parse_args

    args, remaining = parse_args(MegatronExportArguments, argv)
    if remaining:
        raise SystemExit(f"unknown flags: {remaining}")
    _, template = prepare_model_template(args, load_model=False, download_model=True)
    model = get_mcore_model(args, template.processor.model_info.config)[0]
    load_mcore_checkpoint(args, [model], load_arg="mcore_model")
    model.eval()
    input_ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(SEED))
    position_ids = torch.arange(LENGTH).unsqueeze(0).expand(BATCH, -1)
    device = next(model.parameters()).device  # the CPU under the CPU runtime, a GPU otherwise
    with torch.no_grad():
        logits = model(input_ids=input_ids.to(device), position_ids=position_ids.to(device), attention_mask=None)
    torch.save({"input_ids": input_ids, "logits": logits[..., :VOCAB].float().cpu().contiguous()}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
