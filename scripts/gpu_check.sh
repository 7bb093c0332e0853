#!/usr/bin/env bash
# Device checks that need a CUDA GPU (two for the megatron sft two-rank runs; they cannot run on the
# CPU-only CI machine). Run so far: the bench_cuda section, on one H200 on 2026-12-04 (its figures in
# docs/performance.md and docs/diagnostics.md); the other sections are unrun.
#   scripts/gpu_check.sh [WORK_DIR]        # default WORK_DIR: a fresh temporary directory
# Run from anywhere with the environment that has elastic-moe-plugin, ms-swift and, for the
# Megatron-SWIFT section, megatron-core + mcore-bridge + Transformer Engine installed.
#   PYTHON     interpreter of that environment (default: python3); `megatron` must be on PATH
#   GPU_CHECK_SECTIONS  the sections to run, by their function names (default: all), e.g.
#              GPU_CHECK_SECTIONS="bench_cuda mcore_checks" for the Megatron-core bench modes alone
#   GPU_CHECK_COMPARE_ARGS   compare_study's flags (default: --device cuda --scale 100 --seeds 2
#              --arms static,2-6); GPU_CHECK_COMPARE_TIMEOUT its budget in seconds (default: 540)
# Dry run of the compare_study section on a CPU, at a tiny size (a minute or two):
#   GPU_CHECK_SECTIONS=compare_study GPU_CHECK_COMPARE_ARGS="--device cpu --quick --steps 4" \
#     PYTHON=.venv/bin/python scripts/gpu_check.sh /tmp/gpu_dry
# Exit status: non-zero if any section fails. Every section is self-contained and offline.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
python="${PYTHON:-python3}"
work="${1:-$(mktemp -d -t elastic_moe_gpu_check.XXXXXX)}"
# whether the section named $1 runs (GPU_CHECK_SECTIONS unset or empty: every section)
wanted() { [[ -z "${GPU_CHECK_SECTIONS:-}" || " ${GPU_CHECK_SECTIONS} " == *" $1 "* ]]; }
mkdir -p "$work"
echo "gpu_check: work dir $work"

# ==================================================================================================
# Section: Megatron-core adapter on CUDA, issue 5. bench_cuda (`elastic-moe bench --only mcore-cuda`;
# < 8 minutes) reruns the dispatcher checks on CUDA, counts device-to-host syncs per layer for stock
# top-8, elastic iid and elastic balanced (CUDA sync debug mode and aten._local_scalar_dense), and
# times a MoE layer (E=128, k=8, H=2048, F=768, T=8192, bf16) forward+backward, stock vs 6-10,
# interleaved; it writes the bench's JSON report (exit status 1 when a check fails); before it, the
# logging cost (`--only log-metrics`). mcore_checks: the CPU test files of the dispatchers (they force the
# CPU path on a GPU machine: a sanity check of the installed stack), and `elastic-moe bench --quick
# --json` on CUDA (the same suite as on CPU).
# ==================================================================================================
bench_cuda() {
  local dir="$work/mcore"
  mkdir -p "$dir"
  # a logging step of 48 MoE layers, log_metrics layers against means (docs/diagnostics.md's GPU rows)
  (cd "$repo" && timeout 180 "$python" -m elastic_moe_plugin.cli bench --only log-metrics --threads 1 --json) \
    > "$dir/log_metrics.json"
  echo "bench --only log-metrics on CUDA: $dir/log_metrics.json"
  (cd "$repo" && timeout 480 "$python" -m elastic_moe_plugin.cli bench --only mcore-cuda --json) | tee "$dir/mcore_cuda.json"
  return "${PIPESTATUS[0]}"
}
mcore_checks() {
  local dir="$work/mcore"
  mkdir -p "$dir"
  (cd "$repo" && TORCH_COMPILE_DISABLE=1 timeout 300 "$python" -m pytest -q -x -p no:cacheprovider \
    tests/mcore/test_mcore_dispatch.py tests/mcore/test_mcore_layer.py) 2>&1 | tee "$dir/cpu_pytest.log"
  (cd "$repo" && timeout 300 "$python" -m elastic_moe_plugin.cli bench --quick --json) > "$dir/bench_quick.json"
  echo "bench --quick --json on CUDA: $dir/bench_quick.json"
}
if wanted bench_cuda; then bench_cuda; fi
if wanted mcore_checks; then mcore_checks; fi
# ==================================================================================================
# End of section: Megatron-core adapter on CUDA
# ==================================================================================================

# ==================================================================================================
# Section: megatron sft end to end on GPUs (Megatron-SWIFT, ms-swift 4.6 + mcore-bridge), issues 6, 22
# The CPU suite's runs and assertions (tests/swift/test_megatron_sft.py) with the recipe's GPU layout:
# Transformer Engine, grouped-GEMM experts (--moe_grouped_gemm true), no CPU runtime; float32 weights,
# TE's unfused attention and no padding-free batches so that the exact stock/static comparison and the
# float32 export tolerance keep their meaning. Checked there: stock vs ELASTIC_MOE_SCHEDULE=static equal
# loss, grad_norm and load-balancing loss on every step; 1-3 around top-2 gives per-layer κ histograms
# within 4 standard errors of the pmf, the plan line and the κ metrics in logging.jsonl; PP=2 (with
# only the second stage's layer elastic) on two ranks, which needs two visible GPUs (else skipped:
# the pytest summary says so); save at step 2 and resume for steps 3-4 equal to the uninterrupted run,
# κ token by token; megatron export --to_hf of the elastic checkpoint, loaded in plain transformers with
# the plugin unimportable, equal to Megatron's static forward within 1e-5. Unrun: no GPU has been lent to
# this project yet, so this section is written against the CPU runs, not observed on a GPU.
# ==================================================================================================
megatron_sft_tests() {
  local dir="$work/megatron_sft"
  mkdir -p "$dir"
  (
    cd "$repo"
    export MEGATRON_SFT_TEST_DEVICE=cuda
    timeout 1200 "$python" -m pytest -q -s -rs -p no:cacheprovider tests/swift/test_megatron_sft.py
  ) 2>&1 | tee "$dir/pytest.log"
  return "${PIPESTATUS[0]}"
}
if wanted megatron_sft_tests; then megatron_sft_tests; fi
# ==================================================================================================
# End of section: megatron sft end to end on GPUs
# ==================================================================================================

# ==================================================================================================
# Section: megatron sft --plugin elastic_moe (Megatron-SWIFT, the one-flag form), issue 16
# The tiny Qwen3-MoE (top-4), 2 steps in the recipe's layout (grouped-GEMM experts under Transformer
# Engine, bf16), run from a folder outside the checkout with `--plugin
# elastic_moe` (the start-up hook turns it into --external_plugins/--callbacks in the entry
# process). Where this environment has no hook (an editable install of a checkout), a
# sitecustomize hands the checkout's elastic-moe-swift.pth to site.addsitedir, as the tests do.
# Passes if the run exits 0, the plugin is loaded before the model is built, the start-up plan line
# is logged, and 2 training steps log elastic_moe/mean_kappa within 10% of 4.
# ==================================================================================================
megatron_sft_plugin_flag() {
  local dir="$work/megatron_sft_plugin"
  mkdir -p "$dir/elsewhere"
  "$python" "$repo/tests/swift/_tiny_assets.py" "$dir/assets" > "$dir/assets.json"
  local model="$dir/assets/qwen3_moe" dataset="$dir/assets/train.jsonl" out="$dir/out"
  local hook_path=""
  if [ "$("$python" -c 'from elastic_moe_plugin.swift.plugin_flag import hook_installed; print(hook_installed())')" != "True" ]; then
    mkdir -p "$dir/hook/site"
    cp "$repo/elastic-moe-swift.pth" "$dir/hook/site/"
    printf 'import site\nsite.addsitedir(%s)\n' "'$dir/hook/site'" > "$dir/hook/sitecustomize.py"
    hook_path="$dir/hook"
    echo "gpu_check: no installed start-up hook here; using the checkout's .pth through $hook_path/sitecustomize.py"
  fi
  (
    cd "$dir/elsewhere"
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" NPROC_PER_NODE=1 MASTER_PORT="${MASTER_PORT:-29532}"
    export ELASTIC_MOE_SCHEDULE=2-6 ELASTIC_MOE_SAMPLING=iid
    if [ -n "$hook_path" ]; then export PYTHONPATH="$hook_path${PYTHONPATH:+:$PYTHONPATH}"; fi
    megatron sft \
      --model "$model" --model_type qwen3_moe --template qwen3 \
      --dataset "$dataset" --split_dataset_ratio 0 --check_model false \
      --plugin elastic_moe \
      --tuner_type full --finetune true \
      --expert_model_parallel_size 1 --moe_token_dispatcher_type alltoall \
      --moe_grouped_gemm true --moe_permute_fusion false --moe_aux_loss_coeff 0.01 \
      --micro_batch_size 4 --global_batch_size 4 --max_length 512 \
      --train_iters 2 --logging_steps 1 --lr 1e-5 --min_lr 1e-6 \
      --torch_dtype bfloat16 --bf16 true \
      --dataset_num_proc 1 --dataloader_num_workers 0 \
      --no_save_optim true --no_save_rng true --save_steps 1000 \
      --output_dir "$out" --add_version false
  ) > "$dir/megatron_sft.log" 2>&1 || { tail -80 "$dir/megatron_sft.log"; return 1; }
  "$python" - "$dir/megatron_sft.log" "$out/logging.jsonl" <<'PY'
import json
import sys

log = open(sys.argv[1]).read()
assert "elastic-moe: plugin elastic_moe: passing it to ms-swift as --external_plugins" in log, "the hook did not act"
assert "[INFO:elastic_moe] rank 0/1: plugin loaded" in log, "the plugin did not load"
assert "elastic-moe plan (megatron-core, 2 MoE layers): elastic 2-6 around k=4" in log, "no start-up plan line"
rows = [json.loads(line) for line in open(sys.argv[2]) if line.strip()]
steps = [row for row in rows if "elastic_moe/mean_kappa" in row]
for row in steps:
    print(f"megatron sft --plugin step {row.get('iteration')}: loss={row.get('loss')} "
          f"elastic_moe/mean_kappa={row['elastic_moe/mean_kappa']:.4f}")
assert len(steps) >= 2, f"expected 2 logged training steps with elastic metrics, got {len(steps)}: {rows}"
for row in steps:
    assert abs(row["elastic_moe/mean_kappa"] - 4.0) <= 0.4, row["elastic_moe/mean_kappa"]
print("megatron sft --plugin elastic_moe: OK")
PY
}
if wanted megatron_sft_plugin_flag; then megatron_sft_plugin_flag; fi
# ==================================================================================================
# End of section: megatron sft --plugin elastic_moe
# ==================================================================================================

# ==================================================================================================
# Section: Megatron fast paths and HybridModel on CUDA, issue 39 (tests/gpu/test_megatron_fast_paths.py)
# moe_router_fusion with Transformer Engine's real fused router: TE's three fused functions are
# called exactly on the static layers in training and on every layer in evaluation, and the static
# layers equal the fused path without the plugin bit for bit; an elastic router's training forward
# under torch.cuda.graph is refused, the same router in evaluation captures and replays equal to
# eager, and the start-up check refuses cuda_graph_modules=['moe_router'] and accepts ['attn'];
# a HybridModel with Megatron's own TE hybrid spec routes κ on exactly the selected layer numbers.
# Then the Megatron-Bridge example (docs/megatron.md) where megatron-bridge imports, for 5 iterations
# (informative only: its recipe reads the model's config from the Hugging Face hub).
# ==================================================================================================
megatron_fast_paths() {
  local dir="$work/megatron_fast_paths"
  mkdir -p "$dir"
  (cd "$repo" && timeout 600 "$python" -m pytest -q -rs -p no:cacheprovider tests/gpu) 2>&1 | tee "$dir/pytest.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
  if "$python" -c "import megatron.bridge" 2>/dev/null; then
    (cd "$repo" && timeout 1200 torchrun --standalone --nproc-per-node 1 \
      examples/megatron_bridge/pretrain_qwen3_moe_elastic.py --elastic-moe-schedule 6-10 --elastic-moe-layers 3-7 \
      model.num_layers=8 model.expert_model_parallel_size=1 train.train_iters=5 logger.log_interval=1) \
      > "$dir/megatron_bridge.log" 2>&1 \
      || echo "megatron-bridge example failed, not counted (its recipe reads the model's config from the" \
              "Hugging Face hub, which an offline machine cannot reach): $dir/megatron_bridge.log"
    if grep -q "elastic_moe" "$dir/megatron_bridge.log"; then echo "megatron-bridge example: routing metrics logged"; fi
  else
    echo "megatron-bridge is not installed (it needs Python 3.12): its example is not run"
  fi
}
if wanted megatron_fast_paths; then megatron_fast_paths; fi
# ==================================================================================================
# End of section: Megatron fast paths and HybridModel on CUDA
# ==================================================================================================

# ==================================================================================================
# Section: a GPU-sized elastic-moe compare study on one CUDA GPU, issue 51. compare_study trains the
# demo's Megatron-core GPT at --scale 100 (8 layers, hidden 512, 16 experts of ffn 384, top-4; batch
# 128 x 64 tokens, 1000 steps; about 100x the demo's parameters) for 2 seeds x (static, 2-6) on
# Megatron's own CUDA path (--device cuda: NCCL, world size 1, no CPU runtime), within a budget of
# GPU_CHECK_COMPARE_TIMEOUT seconds (540). The study is resumable (every finished run is kept in
# results.json; rerun with the same WORK_DIR to go on), so running out of time is not a failure when at
# least one complete pair (a seed with the static arm and another arm) is in results.json. Then
# `compare --report` prints the table of what finished (its router measures, D1/Dk, load the
# checkpoints on the CPU, in that separate process). Unrun: no GPU has been lent to this project
# yet, so this section has only been dry-run on a CPU (the command in this file's header).
# ==================================================================================================
compare_study() {
  local dir="$work/compare_study" rc=0
  local budget="${GPU_CHECK_COMPARE_TIMEOUT:-540}"
  local -a args
  read -r -a args <<< "${GPU_CHECK_COMPARE_ARGS:---device cuda --scale 100 --seeds 2 --arms static,2-6}"
  mkdir -p "$dir"
  (cd "$repo" && timeout "$budget" "$python" -m elastic_moe_plugin.cli compare "${args[@]}" --out "$dir") 2>&1 \
    | tee -a "$dir/compare.log" || rc=$?
  if [ "$rc" -eq 124 ]; then
    echo "gpu_check: compare stopped at its ${budget} s budget; looking for a complete pair in $dir/results.json"
    (cd "$repo" && "$python" - "$dir/results.json") <<'PY' || return 1
import sys
from pathlib import Path

from elastic_moe_plugin.tools.compare.study import complete_seeds, read_results

path = Path(sys.argv[1])
if not path.is_file():
    sys.exit("gpu_check: no complete pair (one seed, both arms) within the budget: no run finished")
data = read_results(path)
arms = data["plan"]["arms"]
pairs = {arm: complete_seeds(data, [arms[0], arm]) for arm in arms[1:]}
print(f"complete pairs ({arms[0]} vs arm: seeds): {pairs}; runs finished: {len(data['runs'])}")
sys.exit(0 if any(pairs.values()) else "gpu_check: no complete pair (one seed, both arms) within the budget")
PY
  elif [ "$rc" -ne 0 ]; then
    echo "gpu_check: elastic-moe compare failed (exit status $rc): $dir/compare.log"
    return 1
  fi
  (cd "$repo" && timeout 300 "$python" -m elastic_moe_plugin.cli compare --report --out "$dir") 2>&1 \
    | tee "$dir/report.log"
  return "${PIPESTATUS[0]}"
}
if wanted compare_study; then compare_study; fi
# ==================================================================================================
# End of section: a GPU-sized elastic-moe compare study
# ==================================================================================================

echo "gpu_check: every section run passed (${GPU_CHECK_SECTIONS:-all})"
