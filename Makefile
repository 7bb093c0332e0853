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
PYTEST_ARGS ?=
export TORCH_COMPILE_DISABLE := 1

.PHONY: setup swift-hook demo docs lint format test test-fast test-mcore-low coverage bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch is pinned for dev/test only: a CPU wheel of 2.13.0 is on local disk, while an unpinned
	# torch would pull a multi-GB CUDA build. The package itself asks only for torch>=2.6.
	$(BIN)/pip install -q torch==2.13.0 numpy "packaging>=24.2"
	$(BIN)/pip install -q -e ".[dev,plot,hf,swift,eval]" torch==2.13.0
	$(MAKE) swift-hook VENV=$(VENV)
	# megatron-core >=0.17 declares Requires-Python>=3.12, yet its cp311 wheel imports and runs on
	# 3.11 (its megatron/training needs typing.override, which cpu_runtime.megatron_training supplies for
	# the tests that run Megatron-LM's training loop). With dependencies pip would
	# try a numpy sdist that needs 3.12, so install it alone; its runtime deps (torch, numpy,
	# packaging>=24.2) are already here.
	$(BIN)/pip install -q --no-deps --ignore-requires-python megatron-core==$(MCORE_HIGH)
	rm -rf $(MCORE_LOW_DIR)
	$(BIN)/pip install -q --no-deps --target $(MCORE_LOW_DIR) megatron-core==$(MCORE_LOW)
	# mcore-bridge (Megatron-SWIFT's model layer: ms-swift 4.6 imports it unconditionally and asks
	# >=1.6.3) into the venv, so that `megatron sft` imports; on CPU it runs under
	# elastic_moe_plugin.cpu_runtime.megatron_swift (docs/swift.md). After megatron-core 0.19.2 and
	# with --no-deps: its own pins (megatron-core>=0.16,<0.20, modelscope, peft>=0.11,<0.21,
	# safetensors, tqdm, transformers>=4.33) are all met by what is installed above, and --no-deps keeps
	# pip from re-resolving megatron-core at all (in an environment without it, pip picks 0.16.1, the
	# newest that declares Python 3.11 support). `pip check` then proves every requirement of the
	# venv, mcore-bridge's included, is satisfied, megatron-core 0.19.2 still in place.
	$(BIN)/pip install -q --no-deps mcore-bridge==$(MCORE_BRIDGE)
	$(BIN)/pip check
	# The same files in a folder of its own: tests/mcore/test_mcore_bridge_router.py looks there when
	# the installed package cannot be found (it finds the venv's first now).
	rm -rf $(MCORE_BRIDGE_DIR)
	$(BIN)/pip install -q --no-deps --target $(MCORE_BRIDGE_DIR) mcore-bridge==$(MCORE_BRIDGE)
	rm -rf $(TRANSFORMERS_HIGH_DIR)
	$(BIN)/pip install -q --no-deps --target $(TRANSFORMERS_HIGH_DIR) transformers==$(TRANSFORMERS_HIGH) \
		"huggingface-hub==2.4.0" "kernels==0.19.1"
	touch $@

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
	$(BIN)/python -c "import pathlib; from elastic_moe_plugin.hf.family_table import with_tables; \
	page = pathlib.Path('docs/transformers.md'); page.write_text(with_tables(page.read_text()))"

# Rewrite the package in ruff's format and apply its safe fixes (what `make lint` then accepts).
format: setup
	$(BIN)/ruff check --fix elastic_moe_plugin
	$(BIN)/ruff format elastic_moe_plugin

# Full suite against megatron-core 0.19.2 and transformers 5.19, then the Megatron tests again against
# 0.16.1, then the transformers tests against 5.25 (the newest release the transformers door supports). Each pass
# prints its slowest tests. Serial on purpose: pytest-xdist (-n 2 --dist loadfile) took 553 s against
# 494 s serial for the first pass on the 2-core CI machine (the multi-process tests oversubscribe it).
DURATIONS ?= 25
test: setup
	$(BIN)/python -m pytest --durations=$(DURATIONS) $(PYTEST_ARGS)
	PYTHONPATH=$(MCORE_LOW_DIR) $(BIN)/python -m pytest -m megatron --durations=$(DURATIONS) $(PYTEST_ARGS)
	PYTHONPATH=$(CURDIR)/$(TRANSFORMERS_HIGH_DIR) $(BIN)/python -m pytest -m "hf and not swift" --durations=$(DURATIONS) $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" -x -q $(PYTEST_ARGS)

test-mcore-low: setup
	PYTHONPATH=$(MCORE_LOW_DIR) $(BIN)/python -m pytest -m megatron $(PYTEST_ARGS)

# The package's line and branch coverage over the three passes of `make test` (in-process code only:
# the subprocess runs of the end-to-end tests are not traced), configured in pyproject.toml.
coverage: setup
	rm -f .coverage
	$(BIN)/python -m pytest --cov --cov-report= $(PYTEST_ARGS)
	PYTHONPATH=$(MCORE_LOW_DIR) $(BIN)/python -m pytest -m megatron --cov --cov-append --cov-report= $(PYTEST_ARGS)
	PYTHONPATH=$(CURDIR)/$(TRANSFORMERS_HIGH_DIR) $(BIN)/python -m pytest -m "hf and not swift" --cov --cov-append \
		--cov-report= $(PYTEST_ARGS)
	$(BIN)/python -m coverage report

clean:
	rm -rf $(VENV) $(MCORE_LOW_DIR) $(MCORE_BRIDGE_DIR) demo_out .pytest_cache .coverage
