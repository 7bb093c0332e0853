#!/usr/bin/env bash
# OLMoE-1B-7B-0924 SFT on Dolci-Instruct-SFT (ms-swift, transformers path)
# on 2 nodes x 8 GPUs. Run once per node (or from scripts/slurm_example.sbatch).
#   scripts/olmoe_sft.sh SCHEDULE [elastic-moe launch options] [-- framework args]
#   DRY_RUN=1 scripts/olmoe_sft.sh 6-10                   # print the command, run nothing
#   NODE_RANK=1 MASTER_ADDR=node0 scripts/olmoe_sft.sh 6-10
# SCHEDULE is a recipe in configs/olmoe_sft/: top8 7-9 6-10 5-11 6-10_sigma1.0 6-10_sigma3.0
# 6-10_L3-7 6-10_L8-12 top9 top10 top-p0.4.
exec "$(dirname "${BASH_SOURCE[0]}")/_launch.sh" olmoe_sft "$@"
