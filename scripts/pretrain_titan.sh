#!/usr/bin/env bash
# 1.42B-A365M MoE pretraining on FineWeb-Edu with torchtitan 0.3 (torchrun -m torchtitan.train, FSDP with
# EP=4; pip install 'elastic-moe-plugin[titan]') on 2 nodes x 8 GPUs. Run once per node (or from
# scripts/slurm_example.sbatch with SETTING=pretrain_titan).
#   scripts/pretrain_titan.sh SCHEDULE [elastic-moe launch options] [-- framework args]
#   DRY_RUN=1 scripts/pretrain_titan.sh 6-10                   # print the command, run nothing
#   NODE_RANK=1 MASTER_ADDR=node0 scripts/pretrain_titan.sh 6-10 --set args.dataloader.dataset_path=/data/fineweb-edu
#   scripts/pretrain_titan.sh 6-10 --rehearse                   # this machine's CPU first: tiny model, 3 steps
# SCHEDULE is a recipe in configs/pretrain_titan/: top8 7-9 6-10 5-11 6-10_sigma1.0 6-10_sigma3.0
# 6-10_L3-7 6-10_L8-12 top9 top10 top-p0.4.
exec "$(dirname "${BASH_SOURCE[0]}")/_launch.sh" pretrain_titan "$@"
