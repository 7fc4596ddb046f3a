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

demo: $(STAMP)
	$(PY) -m engram_train.demo

bench: $(STAMP)
	$(PY) benchmarks/bench_hash.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
