# One entry point for set-up, the demo and the tests. `make demo` and `make test` each set up
# everything they need on a fresh machine (Python 3.11+, CPU only).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The lower end of the supported megatron-core range lives in its own folder and is put first on
# PYTHONPATH for a second test pass, so one venv covers both ends of >=0.16,<0.20.
MCORE_LOW := 0.16.1
MCORE_HIGH := 0.19.2
MCORE_LOW_DIR := .mcore-$(MCORE_LOW)
MCORE_BRIDGE := 1.6.5
MCORE_BRIDGE_DIR := .mcore-bridge
# The newest transformers the transformers door supports, in a folder of its own put first on
# PYTHONPATH for a third test pass (ms-swift 4.6 caps the venv's transformers below 5.20). 5.25
# asks for a newer huggingface-hub and for kernels than the venv has: they go in the same folder.
TRANSFORMERS_HIGH := 5.25.0
TRANSFORMERS_HIGH_DIR := .transformers-$(TRANSFORMERS_HIGH)
# DeepSpeed for the tests of the transformers door's engines (ZeRO-2/3 on CPU ranks, docs/transformers.md,
# "Engines"). Its only release is an sdist whose setup imports torch: built against the venv's torch
# (--no-build-isolation; an isolated build would pull a CUDA torch), with no op compiled ahead
# (DS_BUILD_OPS=0). The one op a CPU run uses, deepspeed_shm_comm, is JIT-compiled at the first
# DeepSpeed world into TORCH_EXTENSIONS_DIR, kept in build/ so a checkout compiles it once.
DEEPSPEED := 0.19.8
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/build/torch_extensions
# torchtitan for the third door (docs/torchtitan.md), in a folder of its own put first on PYTHONPATH
# for its lane: 0.3.0 asks datasets<4.8, ms-swift's venv holds 4.8.4 (torchtitan imports and runs
# with it; `pip check` of the venv stays clean). With the requirements the venv lacks, --no-deps:
# its others (tokenizers, safetensors, tensorboard, einops, pillow) are in the venv; wandb, which it
# imports only when a run asks for W&B, is left out.
TORCHTITAN := 0.3.0
TORCHTITAN_DIR := .torchtitan-$(TORCHTITAN)
TORCHTITAN_REQUIREMENTS := torchtitan==$(TORCHTITAN) torchdata==0.11.0 torch_checkpointing==0.1.1 tyro==1.0.17 \
	docstring_parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 expecttest==0.3.0
PYTEST_ARGS ?=
UV_VERSION := 0.13.9
UV_INSTALL := $(BIN)/uv pip install -q --python $(BIN)/python
export TORCH_COMPILE_DISABLE := 1
# Let Python cache the bytecode of what it imports. Where PYTHONDONTWRITEBYTECODE is set (as on
# this project's 2-core machine) and uv (which writes no .pyc at install time) installed a package,
# every process would compile the modules it imports from source again: 4 to 7 s of CPU in each
# `swift sft` or `megatron sft` process's start-up (ms-swift, modelscope, peft, pydantic), about
# 1 s in each process on megatron-core 0.16.1 or transformers 5.25. Compiling the whole venv at
# install time instead (uv --compile-bytecode) adds about 70 s to a fresh set-up, most of it for
# modules no test imports.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup constraints swift-hook demo docs lint format test test-fast test-mcore-low coverage bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile dev-constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch is pinned for dev/test only: a CPU wheel of 2.13.0 is on local disk, while an unpinned
	# torch would pull a multi-GB CUDA build. The package itself asks only for torch>=2.6. pip takes
	# torch (it reads the machine's pip configuration, which says where that wheel lies); uv, which
	# installs the rest about ten times faster than pip on the 2-core CI machine, finds it installed.
	$(BIN)/pip install -q torch==2.13.0 uv==$(UV_VERSION)
	$(UV_INSTALL) -c dev-constraints.txt -e ".[dev,plot,hf,swift,eval]" torch==2.13.0
	$(MAKE) swift-hook VENV=$(VENV)
	# megatron-core >=0.17 declares Requires-Python>=3.12, yet its cp311 wheel imports and runs on
	# 3.11 (its megatron/training needs typing.override, which cpu_runtime.megatron_training supplies for
	# the tests that run Megatron-LM's training loop). pip, not uv, because only pip can be told to
	# ignore Requires-Python; --no-deps because its runtime deps (torch, numpy, packaging>=24.2) are
	# already here and pip would otherwise try a numpy sdist that needs 3.12.
	$(BIN)/pip install -q --no-deps --ignore-requires-python megatron-core==$(MCORE_HIGH)
	rm -rf $(MCORE_LOW_DIR)
	$(UV_INSTALL) --no-deps --target $(MCORE_LOW_DIR) megatron-core==$(MCORE_LOW)
	# mcore-bridge (Megatron-SWIFT's model layer: ms-swift 4.6 imports it unconditionally and asks
	# >=1.6.3) into the venv, so that `megatron sft` imports; on CPU it runs under
	# elastic_moe_plugin.cpu_runtime.megatron_swift (docs/swift.md). After megatron-core 0.19.2 and
	# with --no-deps: its own pins (megatron-core>=0.16,<0.20, modelscope, peft>=0.11,<0.21,
	# safetensors, tqdm, transformers>=4.33) are all met by what is installed above, and --no-deps keeps
	# the installer from re-resolving megatron-core at all (in an environment without it, it picks
	# 0.16.1, the newest that declares Python 3.11 support). `pip check` then proves every requirement
	# of the venv, mcore-bridge's included, is satisfied, megatron-core 0.19.2 still in place.
	$(UV_INSTALL) --no-deps mcore-bridge==$(MCORE_BRIDGE)
	DS_BUILD_OPS=0 $(UV_INSTALL) -c dev-constraints.txt --no-build-isolation deepspeed==$(DEEPSPEED)
	$(BIN)/pip check
	# The same files in a folder of its own: tests/mcore/test_mcore_bridge_router.py looks there when
	# the installed package cannot be found (it finds the venv's first now).
	rm -rf $(MCORE_BRIDGE_DIR)
	$(UV_INSTALL) --no-deps --target $(MCORE_BRIDGE_DIR) mcore-bridge==$(MCORE_BRIDGE)
	rm -rf $(TRANSFORMERS_HIGH_DIR)
	$(UV_INSTALL) --no-deps --target $(TRANSFORMERS_HIGH_DIR) transformers==$(TRANSFORMERS_HIGH) \
		"huggingface-hub==2.4.0" "kernels==0.19.1"
	rm -rf $(TORCHTITAN_DIR)
	$(UV_INSTALL) --no-deps --target $(TORCHTITAN_DIR) $(TORCHTITAN_REQUIREMENTS)
	touch $@

# Rewrite dev-constraints.txt (after a change of the extras in pyproject.toml): set up a scratch venv
# as `setup` does but without the constraints, and write down every distribution it installed but
# the package itself, torch's build label dropped. The next `make setup` rebuilds .venv to them.
CONSTRAINTS_VENV := .constraints-venv
constraints:
	rm -rf $(CONSTRAINTS_VENV) && $(PYTHON) -m venv $(CONSTRAINTS_VENV)
	$(CONSTRAINTS_VENV)/bin/pip install -q torch==2.13.0 uv==$(UV_VERSION)
	$(CONSTRAINTS_VENV)/bin/uv pip install -q --python $(CONSTRAINTS_VENV)/bin/python ".[dev,plot,hf,swift,eval]" \
		torch==2.13.0
	DS_BUILD_OPS=0 $(CONSTRAINTS_VENV)/bin/uv pip install -q --python $(CONSTRAINTS_VENV)/bin/python \
		--no-build-isolation deepspeed==$(DEEPSPEED)
	{ sed -n '/^#/p' dev-constraints.txt; $(CONSTRAINTS_VENV)/bin/pip freeze \
		| grep -v -i -e '^elastic[-_]moe[-_]plugin' -e '^uv==' -e '^deepspeed==' | sed 's/+cpu$$//' | sort -f; } \
		> dev-constraints.txt.new && mv dev-constraints.txt.new dev-constraints.txt
	rm -rf $(CONSTRAINTS_VENV)

# An editable install gets no elastic-moe-swift.pth (the wheel's start-up hook that makes
# `swift sft --plugin elastic_moe` work; docs/swift.md): put the checkout's copy where the wheel puts
# it, at the root of the venv's site-packages, so the README's venv runs the flag as typed.
swift-hook:
	$(BIN)/python -c "import shutil, sysconfig; shutil.copy('elastic-moe-swift.pth', sysconfig.get_paths()['purelib'])"

demo: setup
	$(BIN)/elastic-moe demo

# The form of the package's code: ruff's lint and format check, then mypy (configured in pyproject.toml).
lint: setup
	$(BIN)/ruff check elastic_moe_plugin
	$(BIN)/ruff format --check elastic_moe_plugin
	$(BIN)/mypy

# Regenerate the docs' tables that are generated from code (the transformers families).
docs: setup
	$(BIN)/python -c "import pathlib; from elastic_moe_plugin.hf.family_docs import with_tables; \
	page = pathlib.Path('docs/transformers.md'); page.write_text(with_tables(page.read_text()))"

# Rewrite the package in ruff's format and apply its safe fixes (what `make lint` then accepts).
format: setup
	$(BIN)/ruff check --fix elastic_moe_plugin
	$(BIN)/ruff format elastic_moe_plugin

# The suite in six lanes, run two at a time (the 2-core CI machine sat at about one busy core with
# the passes one after another: most tests wait on one subprocess or run one thread), each lane's
# output printed whole when it ends, with its slowest tests. Pass 1, against megatron-core 0.19.2 and
# transformers 5.19, is three lanes: the ms-swift runs (tests/swift, with the wheel's packaging tests,
# which share its installed wheel), the tools (tests/tools: the bench, demo, recipes, eval) and the
# rest of the tree. Then the Megatron tests again against megatron-core 0.16.1, the transformers
# tests against 5.25 (the newest release the transformers door supports), and the torchtitan door's
# tests (tests/titan) with torchtitan 0.3.0, each a lane with its folder first on PYTHONPATH; the
# first two leave out tests/tools, whose tools run on the adapters proven there. One torch thread per
# process: two lanes of two-thread processes on two cores spend their time in OpenMP's spin-waits.
# -k: every lane runs and reports even when another fails. `make lint` (about 45 s of mypy on a fresh
# clone) is one more job of the same pool, so that it costs the CPU time it takes instead of its wall
# time before the lanes; the package lane, the longest, starts first, and the order of the others
# keeps the two slots about equally busy.
DURATIONS ?= 15
SWIFT_TESTS := tests/swift tests/test_packaging.py
TITAN_TESTS := tests/titan
TOOLS_TESTS := tests/tools
LANES := package swift tools mcore-low transformers-high titan
LANE_SELECT_swift := $(SWIFT_TESTS)
LANE_SELECT_tools := $(TOOLS_TESTS)
LANE_SELECT_package := $(addprefix --ignore=,$(SWIFT_TESTS) $(TITAN_TESTS) $(TOOLS_TESTS))
LANE_SELECT_titan := $(TITAN_TESTS)
LANE_PATH_titan := $(CURDIR)/$(TORCHTITAN_DIR)
LANE_SELECT_mcore-low := -m megatron --ignore=tests/tools
LANE_SELECT_transformers-high := -m "hf and not swift" --ignore=tests/tools
LANE_PATH_mcore-low := $(CURDIR)/$(MCORE_LOW_DIR)
LANE_PATH_transformers-high := $(CURDIR)/$(TRANSFORMERS_HIGH_DIR)
# what `make coverage` adds to every lane: its own data file, combined at the end
LANE_COVERAGE ?=
.PHONY: $(addprefix lane-,$(LANES))

test: setup
	$(MAKE) --no-print-directory -j2 -k --output-sync=target lane-package lane-swift lane-tools lint \
		lane-mcore-low lane-titan lane-transformers-high

$(addprefix lane-,$(LANES)): lane-%:
	@echo '=== lane $*: pytest $(LANE_SELECT_$*)$(if $(LANE_PATH_$*), with PYTHONPATH=$(LANE_PATH_$*))'
	OMP_NUM_THREADS=1 $(if $(LANE_PATH_$*),PYTHONPATH=$(LANE_PATH_$*)) \
		$(if $(LANE_COVERAGE),COVERAGE_FILE=$(CURDIR)/.coverage.$*) \
		$(BIN)/python -m pytest $(LANE_SELECT_$*) --durations=$(DURATIONS) $(if $(LANE_COVERAGE),--cov --cov-report=) \
		$(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" -x -q $(PYTEST_ARGS)

test-mcore-low: setup
	$(MAKE) --no-print-directory lane-mcore-low

# The package's line and branch coverage over the lanes of `make test` (in-process code only: the
# subprocess runs of the end-to-end tests are not traced), configured in pyproject.toml.
coverage: setup
	rm -f .coverage .coverage.*
	$(MAKE) --no-print-directory -j2 -k --output-sync=target $(addprefix lane-,$(LANES)) LANE_COVERAGE=1; \
		status=$$?; $(BIN)/python -m coverage combine $(addprefix .coverage.,$(LANES)) && \
		$(BIN)/python -m coverage report; exit $$status

clean:
	rm -rf $(VENV) $(CONSTRAINTS_VENV) $(MCORE_LOW_DIR) $(MCORE_BRIDGE_DIR) $(TRANSFORMERS_HIGH_DIR) $(TORCHTITAN_DIR) demo_out .pytest_cache .coverage .coverage.*
