#!/usr/bin/env bash
# torchtitan's own MoE unit tests with the elastic-moe door applied at κ ≡ k (docs/torchtitan.md,
# "What is covered"). torchtitan ships its tests only in its source repository, so this takes a
# checkout of the release the door supports:
#   git clone --branch v0.3.0 https://github.com/pytorch/torchtitan && scripts/titan_upstream_tests.sh torchtitan
# Extra arguments go to pytest (e.g. -k router). On a CPU host the CPU runtime stands in for CUDA.
set -euo pipefail
checkout=${1:?usage: scripts/titan_upstream_tests.sh TORCHTITAN_CHECKOUT [pytest args]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
# the MoE tests that run on a CPU (the fused-SwiGLU ones need triton kernels; test_compile_moe compiles)
tests=(test_moe.py test_gpt_oss_moe.py test_expert_parallel.py test_fsdp_moe_sharding.py
       test_activation_checkpoint.py test_optimizer_param_groups.py)
cd "$checkout"
paths=()
for test in "${tests[@]}"; do [[ -f tests/unit_tests/$test ]] && paths+=("tests/unit_tests/$test"); done
PYTHONPATH="$here/tests/titan:$checkout:${PYTHONPATH:-}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
    "$python" -m pytest -p upstream_door "${paths[@]}" -q "$@"
