# Two entry points: `make test` and `make demo`, on one of two megatron-core lanes:
#   MEGATRON=0.16 (default)  Python 3.11, megatron-core 0.16.1, virtual environment .venv
#   MEGATRON=0.19            Python 3.12, megatron-core 0.19.2, virtual environment .venv-mcore0.19
# Each lane bootstraps its own virtual environment from nothing and skips the install when
# pyproject.toml and the lane's pins have not changed. The pins must match the patch
# registry's TESTED_MEGATRON_CORE (engram_train/runtime/patches.py; a test checks).
MEGATRON ?= 0.16
ifeq ($(MEGATRON),0.16)
MEGATRON_CORE := 0.16.1
PYTHON_VERSION := 3.11
VENV ?= .venv
else ifeq ($(MEGATRON),0.19)
MEGATRON_CORE := 0.19.2
PYTHON_VERSION := 3.12
VENV ?= .venv-mcore0.19
else
$(error MEGATRON=$(MEGATRON) is not a lane: use MEGATRON=0.16 (default) or MEGATRON=0.19)
endif
# The interpreter that creates the lane's environment (PATH, else pyenv); override with PYTHON=.
PYTHON ?= $(shell scripts/find-python $(PYTHON_VERSION))
PY := $(VENV)/bin/python
# torch is installed first and pinned; any torch >= 2.4 works (CUDA builds included; on
# Python 3.12 the registry's CUDA build, which runs on the CPU).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed-mcore$(MEGATRON_CORE)
# Extra pytest arguments, e.g. PYTEST_ARGS="-m every_lane" (the tests CI runs on every lane).
PYTEST_ARGS ?=
# pytest-xdist workers (one per core and one more by default; 0 runs serially). Whole files go to
# a worker (their launches are shared by module fixtures); tests/launch.py caps the ranks running
# at once at the same count (ENGRAM_TEST_SLOTS): a launch keeps ~1.3 cores busy per 2 ranks
# (gloo's waits), and the extra slot fills that idle time (docs/testing.md 'Parallel runs').
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))
# What to run: the whole suite, or e.g. TESTS=tests/test_config.py or TESTS="tests/test_data.py -k split".
TESTS ?= tests

.PHONY: help test demo install torch bench clean

help:
	@echo "make demo      train deepseek_v3_tiny + Engram on the shipped corpus (2 CPU processes)"
	@echo "make test      install the lane's environment if needed, run the test suite (docs/testing.md)"
	@echo "make install   create or update the lane's virtual environment ($(VENV))"
	@echo "make bench     the n-gram hash benchmark (others: benchmarks/)"
	@echo "make clean     remove both lanes' environments and build outputs"
	@echo "variables: MEGATRON=0.16|0.19 (lane), TESTS=..., PYTEST_ARGS=..., PYTEST_WORKERS=N|auto|0, PYTHON=..."

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { scripts/find-python $(PYTHON_VERSION); exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]" "megatron-core==$(MEGATRON_CORE)"
	@rm -f $(VENV)/.installed*
	@touch $(STAMP)

install: $(STAMP)

# The lane's torch alone, its largest download: .ci/run fetches the second lane's while the
# first lane's tests run (no editable install here, so the two never write the same files).
torch:
	@test -n "$(PYTHON)" || { scripts/find-python $(PYTHON_VERSION); exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"

# The DeepSeek-V4.1 reference of the tests (NeMo Automodel and the transformers it pins), in a
# side folder beside the lane's pins; pure-Python wheels, so both lanes share it. Installed only
# when a pinned version is missing (tests/v41_reference.py).
V41_REF := .v41-ref
V41_REF_PINS := transformers==5.18.0 nemo-automodel==0.7.0
.PHONY: v41-ref
v41-ref: $(STAMP)
	@$(foreach pin,$(V41_REF_PINS),test -d $(V41_REF)/$(subst ==,-,$(subst -,_,$(pin))).dist-info &&) true || \
		$(PY) -m pip install -q --no-deps --upgrade --target $(V41_REF) $(V41_REF_PINS)

# Not -q: pytest's header names the lane's Python, torch and megatron-core (tests/conftest.py).
test: $(STAMP) v41-ref
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=20 $(TESTS) $(PYTEST_ARGS)

# The embedded default: deepseek_v3_tiny + Engram on the shipped corpus, 2 CPU processes.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node 2 -m engram_train.train experiment.exp_name=demo

bench: $(STAMP)
	$(PY) benchmarks/bench_hash.py

clean:
	rm -rf .venv .venv-mcore0.19 .pytest_cache build *.egg-info
