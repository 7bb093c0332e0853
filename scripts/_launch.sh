#!/usr/bin/env bash
# Shared body of the per-setting wrappers: launch configs/SETTING/SCHEDULE.yaml on this node.
# Usage (from a wrapper): _launch.sh SETTING SCHEDULE [elastic-moe launch options] [-- framework args]
#   DRY_RUN=1   print the command and its environment instead of running it
#   PYTHON      the interpreter that has elastic-moe-plugin installed (default: python3)
# The cluster layout comes from the flags, SLURM (SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST),
# NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT/NPROC_PER_NODE, or the recipe (2 nodes x 8 GPUs).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
setting="$1"; shift
if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: scripts/$setting.sh SCHEDULE [elastic-moe launch options] [-- framework args]" >&2
  echo "schedules:" $(cd "$here/../configs/$setting" && ls *.yaml | grep -v '^base.yaml$' | sed 's/\.yaml$//') >&2
  exit 2
fi
schedule="$1"; shift
recipe="$here/../configs/$setting/$schedule.yaml"
if [[ ! -f "$recipe" ]]; then
  echo "scripts/$setting.sh: no recipe configs/$setting/$schedule.yaml" >&2
  echo "schedules:" $(cd "$here/../configs/$setting" && ls *.yaml | grep -v '^base.yaml$' | sed 's/\.yaml$//') >&2
  exit 2
fi
dry=()
if [[ "${DRY_RUN:-0}" != "0" ]]; then dry=(--dry-run); fi
exec "${PYTHON:-python3}" -m elastic_moe_plugin.cli launch "$recipe" "${dry[@]}" "$@"
