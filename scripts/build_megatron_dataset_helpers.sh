#!/usr/bin/env bash
# Build Megatron-LM's C++ dataset helpers (megatron/core/datasets/helpers_cpp<ext>) in a checkout,
# for the Python that will run it. Needed once per checkout and Python (the megatron-core wheel
# ships them compiled; a source tree does not):
#   scripts/build_megatron_dataset_helpers.sh PATH/TO/Megatron-LM
#   PYTHON     the interpreter that will run Megatron-LM (default: python3); it needs pybind11
#              (pip install pybind11, build-time only) and a C++17 compiler (CXX, default c++)
# It runs the checkout's own Makefile, with the include flags and extension suffix of $PYTHON
# rather than of whatever `python3` / `python3-config` come first on PATH. At start-up
# Megatron-LM's initialize_megatron runs the same `make` on rank 0 and exits the job if it fails;
# once the helpers are built that make has nothing to do.
set -euo pipefail
checkout="${1:?usage: scripts/build_megatron_dataset_helpers.sh PATH/TO/Megatron-LM (the folder that holds megatron/)}"
python="${PYTHON:-python3}"
datasets="$checkout/megatron/core/datasets"
if [ ! -f "$datasets/helpers.cpp" ] || [ ! -f "$datasets/Makefile" ]; then
  echo "error: $datasets has no helpers.cpp and Makefile: pass a Megatron-LM checkout (the folder that holds" \
       "megatron/core/datasets/Makefile); the megatron-core wheel needs no build." >&2
  exit 2
fi
if ! includes="$("$python" -m pybind11 --includes)"; then
  echo "error: $python cannot import pybind11: $python -m pip install pybind11 (or set PYTHON)." >&2
  exit 2
fi
suffix="$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
make -C "$datasets" CPPFLAGS="$includes" LIBEXT="$suffix" ${CXX:+CXX="$CXX"}
# Load the built extension by itself (importing megatron.core would import all of megatron-core).
"$python" - "$datasets/helpers_cpp$suffix" <<'EOF'
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("helpers_cpp", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(f"built {sys.argv[1]}: {', '.join(sorted(n for n in dir(module) if not n.startswith('_')))}")
EOF
