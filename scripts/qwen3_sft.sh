#!/usr/bin/env bash
# Qwen3-30B-A3B-Base SFT on Infinity-Instruct 7M Core (Megatron-SWIFT, PP=2 x EP=8)
# on 2 nodes x 8 GPUs. Run once per node (or from scripts/slurm_example.sbatch).
#   scripts/qwen3_sft.sh SCHEDULE [elastic-moe launch options] [-- framework args]
#   DRY_RUN=1 scripts/qwen3_sft.sh 6-10                   # print the command, run nothing
#   NODE_RANK=1 MASTER_ADDR=node0 scripts/qwen3_sft.sh 6-10
# SCHEDULE is a recipe in configs/qwen3_sft/: top8 7-9 6-10 5-11 6-10_sigma1.0 6-10_sigma3.0
# 6-10_L3-7 6-10_L8-12 top9 top10 top-p0.4.
exec "$(dirname "${BASH_SOURCE[0]}")/_launch.sh" qwen3_sft "$@"
