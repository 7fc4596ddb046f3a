# Two entry points: `make test` and `make demo`. Both bootstrap .venv from nothing
# and are no-ops for the install when pyproject.toml has not changed.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned; any torch >= 2.4 works (CUDA builds included).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test demo install bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The embedded default: deepseek_v3_tiny + Engram on the shipped corpus, 2 CPU processes.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node 2 -m engram_train.train experiment.exp_name=demo

bench: $(STAMP)
	$(PY) benchmarks/bench_hash.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
